"""The elastic driver: an explicit state machine that keeps a worker group training as Ray nodes come and go.

States and what moves between them::

    STARTING ──first epoch formed──▶ RUNNING ──a member returned──▶ FINISHING ──▶ FINISHED
                                      │    ▲
         new workers started, members │    │ every live worker waits for the next epoch:
         told to re-form at a commit  ▼    │ a new membership epoch is formed
                                   RESIZING / RECOVERING ◀── a worker died, or a member's ring broke
                                                              (from STARTING, RUNNING or RESIZING)

    ERRORED from anywhere: reset_limit exceeded, below min_workers for longer than elastic_timeout,
    an exception raised by the user's function, or the coordinator lost.

Leaving STARTING, RESIZING or RECOVERING forms a new membership epoch in the coordinator: the
survivors (in their old rank order) then the new workers. Every transition is logged and sent to the
run's callbacks as ``{"event": "elastic", ...}``.
"""

from __future__ import annotations

import enum
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import ray

from hvdray.driver.placement import node_worker_options
from hvdray.worker.actor import Worker
from hvdray.collective.topology import WorkerSlot
from hvdray.driver.discovery import HostDiscovery, slots_per_node
from hvdray.settings import Settings

log = logging.getLogger(__name__)

_TICK_S = 0.05
_PING_TIMEOUT_S = 2.0


class DriverState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RESIZING = "resizing"
    RECOVERING = "recovering"
    FINISHING = "finishing"
    FINISHED = "finished"
    ERRORED = "errored"


class ElasticJobError(RuntimeError):
    """An elastic job could not go on: reset_limit exceeded, or too few workers for elastic_timeout."""


@dataclass(frozen=True)
class ElasticLimits:
    """The sizes and limits an elastic job keeps to (validated by the executor)."""

    min_workers: int
    max_workers: int
    reset_limit: Optional[int]
    cooldown_range: Optional[tuple[float, float]]
    elastic_timeout: float


@dataclass
class _Member:
    """One worker actor of the job and what the driver knows about it."""

    worker_id: str
    actor: Any
    slot: WorkerSlot
    ref: Optional[ray.ObjectRef] = None
    rank: Optional[int] = None  # in the current epoch; None until it is a member
    done: bool = False
    result: Any = None


@dataclass
class _Launch:
    """A worker actor being created; it joins the job once it answers (or is dropped at its deadline)."""

    worker_id: str
    node_id: str
    actor: Any
    slot_ref: ray.ObjectRef
    deadline: float


@dataclass
class Blacklist:
    """Nodes where a worker failed; with a cooldown range they come back after an exponential backoff."""

    cooldown_range: Optional[tuple[float, float]]
    _until: dict[str, float] = field(default_factory=dict)
    _failures: dict[str, int] = field(default_factory=dict)

    def add(self, node_id: str) -> float:
        """Blacklist ``node_id``; returns the cooldown in seconds (inf: for good)."""
        count = self._failures[node_id] = self._failures.get(node_id, 0) + 1
        if self.cooldown_range is None:
            delay = math.inf
        else:
            low, high = self.cooldown_range
            delay = min(high, low * 2 ** (count - 1))
        self._until[node_id] = time.monotonic() + delay
        return delay

    def blocked(self, node_id: str) -> bool:
        return self._until.get(node_id, 0.0) > time.monotonic()


class ElasticDriver:
    """Runs one ``executor.run(fn)`` of an elastic job from start to a result or a clear error."""

    def __init__(
        self,
        executor_id: str,
        limits: ElasticLimits,
        settings: Settings,
        discovery: HostDiscovery,
        coordinator: Any,
        secret: bytes,
        cpus_per_worker: float,
        gpus_per_worker: float,
        runtime_env: Optional[dict[str, Any]],
        blacklist: Blacklist,
    ) -> None:
        self._executor_id = executor_id
        self._limits = limits
        self._settings = settings
        self._worker_settings = settings.model_copy(
            update={"discovery": None, "elastic_timeout": limits.elastic_timeout}
        )
        self._discovery = discovery
        self._coordinator = coordinator
        self._secret = secret
        self._cpus = cpus_per_worker
        self._gpus = gpus_per_worker
        self._runtime_env = runtime_env
        self._blacklist = blacklist
        self._workers: dict[str, _Member] = {}
        self._launching: dict[str, _Launch] = {}
        self._state = DriverState.STARTING
        self._epoch = 0
        self._resets = 0
        self._below_min_since: Optional[float] = None
        self._next_discovery = 0.0
        self._rejoin_deadline = 0.0
        self._error: Optional[BaseException] = None
        self._call: tuple[Callable[..., Any], list[Any], dict[str, Any]] = (lambda: None, [], {})
        self._callbacks: list[Callable[[dict[str, Any]], None]] = []

    # -- the machine ----------------------------------------------------------------------------
    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        callbacks: Sequence[Callable[[dict[str, Any]], None]],
    ) -> list[Any]:
        """Drive the job until every member of the last epoch returned; results in rank order."""
        self._call = (fn, list(args), dict(kwargs))
        self._callbacks = list(callbacks)
        self._report(None, DriverState.STARTING, "job started")
        handlers = {
            DriverState.STARTING: self._on_starting,
            DriverState.RUNNING: self._on_running,
            DriverState.RESIZING: self._on_resizing,
            DriverState.RECOVERING: self._on_recovering,
            DriverState.FINISHING: self._on_finishing,
        }
        try:
            while self._state not in (DriverState.FINISHED, DriverState.ERRORED):
                self._deliver_logs()  # first: a worker's records arrive before the transition its exit causes
                handlers[self._state]()
                time.sleep(_TICK_S)
            self._deliver_logs()
        except ray.exceptions.RayActorError as exc:  # worker deaths are handled above: this is the coordinator
            raise ElasticJobError(f"the job's coordinator actor died ({exc}); the elastic job cannot go on") from exc
        finally:
            self.stop()
        if self._error is not None:
            raise self._error
        members = sorted((m for m in self._workers.values() if m.done), key=lambda m: m.rank)
        return [m.result for m in members]

    def _move(self, new: DriverState, reason: str) -> None:
        old, self._state = self._state, new
        if new is DriverState.RECOVERING:
            # survivors notice a broken ring within a collective timeout; later ones are stuck
            self._rejoin_deadline = time.monotonic() + self._settings.timeout_s
        self._report(old, new, reason)

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._move(DriverState.ERRORED, str(error))

    def _on_starting(self) -> None:
        """Place workers on the discovered slots; form the first epoch once they have all started."""
        if self._watch_runs() or not self._place_workers() or self._launching:
            return
        self._form_epoch_when_ready(deadline=None)

    def _on_running(self) -> None:
        if self._watch_runs():
            return
        if self._members_waiting():
            self._move(DriverState.RECOVERING, "a member left its epoch after a peer failure")
            return
        if self._collect_launched():
            ray.get(self._coordinator.notify_hosts_updated.remote())
            self._move(DriverState.RESIZING, f"new workers started: {len(self._workers)} in the job")
            return
        if time.monotonic() >= self._next_discovery:
            self._next_discovery = time.monotonic() + self._settings.discovery_interval_s
            slots = self._discover()
            if slots is None:
                return
            lost = [w for w, m in self._workers.items() if m.slot.node_id not in slots]
            if lost:
                self._remove(lost, blacklist=False)
                self._move(DriverState.RECOVERING, f"hosts of worker(s) {lost} left the discovery")
                return
            self._launch(self._free_slots(slots))

    def _on_resizing(self) -> None:
        """New workers wait in hvd.init; members join them when they commit next."""
        if self._watch_runs():
            return
        self._collect_launched()
        self._form_epoch_when_ready(deadline=None)

    def _on_recovering(self) -> None:
        """Drop the dead, start replacements only if below min_workers, re-form the ring from the rest."""
        self._probe_liveness()
        if self._watch_runs():
            return
        if not self._place_workers():
            return
        self._form_epoch_when_ready(deadline=self._rejoin_deadline)

    def _on_finishing(self) -> None:
        """A member returned: wait for the others of its epoch, drop everyone else."""
        self._watch_runs()
        members = [m for m in self._workers.values() if m.rank is not None]
        waiting = self._waiting_ids()
        if all(m.done or m.worker_id in waiting for m in members):
            self._remove([m.worker_id for m in self._workers.values() if not m.done], blacklist=False)
            self._cancel_launches()
            self._move(DriverState.FINISHED, f"{sum(m.done for m in members)} member(s) returned")

    # -- forming epochs ------------------------------------------------------------------------
    def _form_epoch_when_ready(self, deadline: Optional[float]) -> None:
        """When every live worker waits for a new epoch, form it (checking reset_limit first)."""
        waiting = self._waiting_ids()
        late = [w for w in self._workers if w not in waiting]
        if late:
            if deadline is not None and time.monotonic() > deadline:
                log.warning("hvdray elastic: worker(s) %s did not rejoin within timeout_s; dropping them", late)
                self._remove(late, blacklist=True)
            return
        if len(self._workers) < self._limits.min_workers:
            self._move(DriverState.RECOVERING, f"only {len(self._workers)} worker(s) left")
            return
        if self._epoch > 0:
            if self._limits.reset_limit is not None and self._resets >= self._limits.reset_limit:
                self._fail(ElasticJobError(
                    f"the elastic job needed reset number {self._resets + 1}, more than reset_limit="
                    f"{self._limits.reset_limit}; giving up"
                ))
                return
            self._resets += 1
        order = sorted(self._workers.values(), key=lambda m: (m.rank is None, m.rank if m.rank is not None else 0))
        ids = [m.worker_id for m in order]
        self._epoch, infos, _ = ray.get(
            self._coordinator.assign.remote([m.slot for m in order], ids), timeout=self._settings.timeout_s
        )
        for member, info in zip(order, infos):
            member.rank = info.rank
        self._move(DriverState.RUNNING, f"membership epoch {self._epoch} formed with {len(ids)} worker(s)")

    def _waiting_ids(self) -> set[str]:
        return set(ray.get(self._coordinator.waiting.remote()))

    def _members_waiting(self) -> list[str]:
        """Members of the running epoch that left it: their ring broke."""
        waiting = self._waiting_ids()
        return [w for w, m in self._workers.items() if w in waiting and m.rank is not None]

    # -- placing workers ----------------------------------------------------------------------------
    def _place_workers(self) -> bool:
        """Start workers on free slots; True when at least ``min_workers`` run (else wait, then fail)."""
        self._collect_launched()
        if len(self._workers) < self._limits.min_workers or self._state is DriverState.STARTING:
            if time.monotonic() >= self._next_discovery:
                self._next_discovery = time.monotonic() + self._settings.discovery_interval_s
                slots = self._discover()
                if slots is not None:
                    self._launch(self._free_slots(slots))
        if len(self._workers) >= self._limits.min_workers:
            self._below_min_since = None
            return True
        now = time.monotonic()
        if self._below_min_since is None:
            self._below_min_since = now
            log.info("hvdray elastic: %d worker(s), waiting for min_workers=%d", len(self._workers),
                     self._limits.min_workers)
        elif now - self._below_min_since > self._limits.elastic_timeout:
            self._fail(ElasticJobError(
                f"only {len(self._workers)} worker(s) could run, fewer than min_workers={self._limits.min_workers}, "
                f"for more than elastic_timeout={self._limits.elastic_timeout} s"
            ))
        return False

    def _discover(self) -> Optional[dict[str, int]]:
        """Slots per node from the discovery; None when it failed (the job goes on, asking again later)."""
        try:
            return slots_per_node(self._discovery)
        except Exception:  # noqa: BLE001 - a failing discovery must not end the job
            log.warning("hvdray elastic: host discovery failed", exc_info=True)
            return None

    def _free_slots(self, slots: dict[str, int]) -> dict[str, int]:
        """Slots not yet used by this job, per node, never more in total than max_workers allows."""
        room = self._limits.max_workers - len(self._workers) - len(self._launching)
        held = self.held()
        free: dict[str, int] = {}
        for node_id in sorted(slots):
            if room <= 0:
                break
            if self._blacklist.blocked(node_id):
                continue
            extra = min(slots[node_id] - held.get(node_id, 0), room)
            if extra > 0:
                free[node_id] = extra
                room -= extra
        return free

    def held(self) -> dict[str, int]:
        """Workers this job runs per node (Ray's free resources do not count them)."""
        held: dict[str, int] = {}
        for node_id in [m.slot.node_id for m in self._workers.values()] + [l.node_id for l in self._launching.values()]:
            held[node_id] = held.get(node_id, 0) + 1
        return held

    def _launch(self, free: dict[str, int]) -> None:
        """Create one worker actor per free slot; they join in :meth:`_collect_launched` once they answer."""
        options: dict[str, Any] = {"runtime_env": self._runtime_env} if self._runtime_env else {}
        deadline = time.monotonic() + self._settings.placement_group_timeout_s
        for node_id, count in free.items():
            for _ in range(count):
                worker_id = uuid.uuid4().hex[:8]
                actor = ray.remote(Worker).options(
                    name=f"hvdray-{self._executor_id}-elastic-{worker_id}",
                    max_concurrency=2,  # ping answers while run is busy
                    **node_worker_options(node_id, self._cpus, self._gpus),
                    **options,
                ).remote()
                self._launching[worker_id] = _Launch(worker_id, node_id, actor, actor.slot.remote(), deadline)
        if free:
            log.info("hvdray elastic: starting %d worker(s) on %s", sum(free.values()),
                     {n[:8]: c for n, c in free.items()})
            # Ray's view of free resources lags the new actors: look again only once it has caught up
            self._next_discovery = time.monotonic() + 2 * self._settings.discovery_interval_s

    def _collect_launched(self) -> int:
        """Workers that answered are configured and given ``fn`` (they wait in hvd.init); returns how many."""
        if not self._launching:
            return 0
        refs = {launch.slot_ref: launch for launch in self._launching.values()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        joined = 0
        for ref, launch in refs.items():
            if ref not in ready and time.monotonic() < launch.deadline:
                continue
            del self._launching[launch.worker_id]
            try:
                if ref not in ready:
                    raise TimeoutError(f"it did not start within placement_group_timeout_s="
                                       f"{self._settings.placement_group_timeout_s} s")
                slot = ray.get(ref)
                ray.get(launch.actor.configure.remote(
                    None, 0, self._worker_settings, self._secret, self._coordinator, (), launch.worker_id
                ), timeout=self._settings.timeout_s)
            except Exception as exc:  # noqa: BLE001 - the node went away or is full; discovery will tell
                log.warning("hvdray elastic: could not start a worker on node %s: %s", launch.node_id[:8], exc)
                ray.kill(launch.actor, no_restart=True)
                if isinstance(exc, ray.exceptions.RayActorError):
                    self._blacklist.add(launch.node_id)
                continue
            fn, args, kwargs = self._call
            member = _Member(launch.worker_id, launch.actor, slot)
            member.ref = launch.actor.run.remote(fn, args, kwargs)
            self._workers[launch.worker_id] = member
            joined += 1
        return joined

    def _cancel_launches(self) -> None:
        for launch in self._launching.values():
            ray.kill(launch.actor, no_restart=True)
        self._launching.clear()

    # -- watching workers ----------------------------------------------------------------------------
    def _watch_runs(self) -> bool:
        """Collect finished runs. True when the state changed (a death, a user error, a member finished)."""
        refs = {m.ref: m for m in self._workers.values() if m.ref is not None and not m.done}
        if not refs:
            return False
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        dead, finished = [], False
        for ref in done:
            member = refs[ref]
            try:
                member.result = ray.get(ref)
                member.done = True
                finished = finished or member.rank is not None
            except ray.exceptions.RayActorError:
                dead.append(member.worker_id)
            except ray.exceptions.OutOfMemoryError:
                log.warning("hvdray elastic: worker %s was killed because its node ran out of memory", member.worker_id)
                dead.append(member.worker_id)
            except ray.exceptions.RayTaskError as exc:
                if member.rank is None and self._state in (DriverState.FINISHING, DriverState.FINISHED):
                    continue
                self._fail(_with_rank(exc, member))
                return True
        if dead:
            self._remove(dead, blacklist=True)
            if self._state is not DriverState.FINISHING:
                self._move(DriverState.RECOVERING, f"worker(s) {dead} died")
                return True
        if finished and self._state is not DriverState.FINISHING:
            self._move(DriverState.FINISHING, "a member returned from the training function")
            return True
        return False

    def _probe_liveness(self) -> None:
        """Workers that do not answer a ping within a couple of seconds are gone (their node may be down)."""
        candidates = {m.actor.ping.remote(): w for w, m in self._workers.items() if not m.done}
        if not candidates:
            return
        answered, _ = ray.wait(list(candidates), num_returns=len(candidates), timeout=_PING_TIMEOUT_S)
        gone = [w for ref, w in candidates.items() if ref not in answered]
        for ref in answered:
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - any failure to answer means the worker is gone
                gone.append(candidates[ref])
        if gone:
            self._remove(gone, blacklist=True)

    def _remove(self, worker_ids: Sequence[str], blacklist: bool) -> None:
        for worker_id in worker_ids:
            member = self._workers.pop(worker_id, None)
            if member is None:
                continue
            ray.kill(member.actor, no_restart=True)
            if blacklist:
                delay = self._blacklist.add(member.slot.node_id)
                log.warning("hvdray elastic: worker %s on node %s lost; node blacklisted for %s s",
                            worker_id, member.slot.node_id[:8], delay)
        ray.get(self._coordinator.forget.remote(list(worker_ids)))

    def stop(self) -> None:
        """Kill every worker of this run (the coordinator belongs to the executor)."""
        for member in self._workers.values():
            ray.kill(member.actor, no_restart=True)
        self._cancel_launches()

    # -- reporting ---------------------------------------------------------------------------------
    def _report(self, old: Optional[DriverState], new: DriverState, reason: str) -> None:
        record = {
            "event": "elastic",
            "state": new.value,
            "previous": old.value if old is not None else None,
            "reason": reason,
            "epoch": self._epoch,
            "workers": len(self._workers),
            "resets": self._resets,
            "time": time.time(),
        }
        log.info("hvdray elastic: %s -> %s (%s); epoch %d, %d worker(s), %d reset(s)",
                 record["previous"], new.value, reason, self._epoch, len(self._workers), self._resets)
        for cb in self._callbacks:
            cb(record)

    def _deliver_logs(self) -> None:
        if not self._callbacks:
            return
        for record in ray.get(self._coordinator.drain_logs.remote()):
            for cb in self._callbacks:
                cb(record)


def _with_rank(exc: ray.exceptions.RayTaskError, member: _Member) -> BaseException:
    error = exc.as_instanceof_cause()
    if hasattr(error, "add_note"):
        where = f"rank {member.rank}" if member.rank is not None else "a worker not yet in the ring"
        error.add_note(f"hvdray: raised on {where} (worker {member.worker_id}); the job was stopped")
    return error
