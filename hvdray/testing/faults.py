"""Test-only fault injection: a worker dies, or its node is removed or joined by another, at a named point.

Inactive unless the worker's environment holds ``HVDRAY_TEST_FAULTS`` (a JSON plan, made by :func:`plan`
and handed to the workers with ``executor.start(extra_env_vars=...)``); then, the first time any worker
of rank ``rank`` reaches ``point`` in a membership epoch ``>= min_epoch`` (of ``size`` workers, and later
than the epoch in which the fault ``after`` fired, where the plan names them), exactly one worker of the
job (the first to claim ``<dir>/fired``) acts:

- ``exit``: its process ends at once (``os._exit``), as a crash would;
- ``remove_node``: it writes ``<dir>/fired`` (its node id, pid, rank, epoch), sends that as a record to
  the run's callbacks and blocks; the test removes that node (``Cluster.remove_node``), which ends the
  process once it notices its raylet is gone (the test waits for that before it releases the worker,
  which would otherwise go on and might even return its result first);
- ``join``: the same, but the test adds a node and then creates ``<dir>/released``, which lets it go on.

:func:`combine` arms several such faults at once, each with its own directory (and its own once-per-job
claim), e.g. two ranks dying at the same point, or one dying while another's node is being removed; with
``after``, a chain of faults that hit one job in turn, each in an epoch formed after the last one fired.

:class:`Responder` is that test side, a callback of ``executor.run``. The points, in the order an elastic worker meets them:
``epoch_forming`` (it was given a rank in a new epoch, before its rendezvous), ``rendezvous`` (its first
call to the rendezvous store: a key written or read), ``init`` (its ring is up, ``hvd.init()`` or the reset has not returned), ``sync`` (the
state sync at the start of each try), ``step`` (the test's own training step calls :func:`reached`),
``commit`` (the state saved, the commit's allreduce not yet done) and ``after_commit``.

This module imports neither Ray nor torch; it costs one dictionary lookup per point when inactive.
Test-only: never arm it in a real job.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Optional

from hvdray import ray_logger

ENV = "HVDRAY_TEST_FAULTS"
EVENT = "hvdray_test_fault"  # the record a blocked worker sends to the run's callbacks
POINTS = ("epoch_forming", "rendezvous", "init", "sync", "step", "commit", "after_commit")
ACTIONS = ("exit", "remove_node", "join")
_BLOCK_LIMIT_S = 300.0  # a blocked worker whose test never answers ends itself rather than hang
_GONE_LIMIT_S = 30.0  # how long the test waits for a removed node's worker process to end

_plans: list[dict[str, Any]] = []
_loaded = False
_context: dict[str, Any] = {"epoch": 0, "size": None, "node_id": None}


def plan(point: str, action: str, directory: str, rank: int = 1, min_epoch: int = 1,
         size: Optional[int] = None, after: Optional[str] = None) -> dict[str, str]:
    """The ``extra_env_vars`` that arm one fault; ``directory`` must exist and be shared with the test.

    ``size``: only in an epoch of that many workers. ``after``: the directory of another fault of the
    same job; this one is armed once that one has fired, in a later epoch than the one it fired in."""
    if point not in POINTS:
        raise ValueError(f"point must be one of {POINTS}, got {point!r}")
    if action not in ACTIONS:
        raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
    if not os.path.isdir(directory):
        raise ValueError(f"directory must be an existing directory, got {directory!r}")
    if size is not None and int(size) < 1:
        raise ValueError(f"size must be a number of workers (1 or more) or None, got {size!r}")
    if after is not None and (not os.path.isdir(after) or os.path.samefile(after, directory)):
        raise ValueError(f"after must be another fault's existing directory, got {after!r}")
    spec = {"point": point, "action": action, "dir": directory, "rank": int(rank), "min_epoch": int(min_epoch),
            "size": None if size is None else int(size), "after": after}
    return {ENV: json.dumps(spec)}


def combine(*plans: dict[str, str]) -> dict[str, str]:
    """The ``extra_env_vars`` that arm every fault of ``plans`` (each made by :func:`plan`, each with a
    directory of its own), so that two or more faults can hit the same job."""
    if len(plans) < 2:
        raise ValueError(f"plans must be at least two plans made by plan(), got {len(plans)}")
    specs = []
    for index, made in enumerate(plans):
        if not isinstance(made, dict) or set(made) != {ENV}:
            raise TypeError(f"plans[{index}] must be the dict plan() returns, got {made!r}")
        specs.append(json.loads(made[ENV]))
    directories = [spec["dir"] for spec in specs]
    if len(set(directories)) != len(directories):
        raise ValueError(f"plans must each have a directory of their own, got {directories}")
    return {ENV: json.dumps(specs)}


def set_context(**values: Any) -> None:
    """What the worker knows that a point needs: ``epoch`` and ``size`` (membership), ``node_id`` (its Ray
    node)."""
    _context.update(values)


def reached(point: str) -> None:
    """Called at each named point; acts on each armed fault that names this worker there."""
    for spec in _armed():
        if spec["point"] == point:
            _act(spec, point)


def _act(spec: dict[str, Any], point: str) -> None:
    rank = int(os.environ.get("HOROVOD_RANK", "-1"))
    if rank != spec["rank"] or _context["epoch"] < spec["min_epoch"]:
        return
    if spec.get("size") is not None and _context["size"] != spec["size"]:
        return
    if spec.get("after") is not None:
        before = _read_fired(spec["after"])
        if before is None or _context["epoch"] <= before["epoch"]:
            return
    fired = os.path.join(spec["dir"], "fired")
    try:
        fd = os.open(fired + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # another worker (or an earlier try) already fired: once per job
    os.close(fd)
    info = {"point": point, "action": spec["action"], "rank": rank, "epoch": _context["epoch"],
            "size": _context["size"], "node_id": _context["node_id"], "pid": os.getpid(), "dir": spec["dir"]}
    _write_atomically(fired, json.dumps(info))
    if spec["action"] == "exit":
        os._exit(1)
    ray_logger.log({"event": EVENT, **info})  # the test's Responder acts on it in the driver
    released = os.path.join(spec["dir"], "released")
    deadline = time.monotonic() + _BLOCK_LIMIT_S
    while not os.path.exists(released):
        if time.monotonic() > deadline:
            os._exit(3)
        time.sleep(0.05)


def _armed() -> list[dict[str, Any]]:
    """The armed faults (none when ``HVDRAY_TEST_FAULTS`` is unset): one plan's, or :func:`combine`'s."""
    global _plans, _loaded
    if not _loaded:
        raw = os.environ.get(ENV)
        loaded = json.loads(raw) if raw else []
        _plans = loaded if isinstance(loaded, list) else [loaded]
        _loaded = True
    return _plans


def _read_fired(directory: str) -> Optional[dict[str, Any]]:
    """What the fault of ``directory`` recorded when it fired (None if it has not)."""
    path = os.path.join(directory, "fired")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


class Responder:
    """The test's side of a plan, passed to ``executor.run(fn, callbacks=[responder])``: when the blocked
    worker's record arrives it removes that worker's node or adds one (in the driver's thread, where
    ``ray.cluster_utils.Cluster`` must be called), then releases the worker."""

    def __init__(self, directory: str, remove_node: Callable[[str], None], add_node: Callable[[], None]) -> None:
        self.directory = directory
        self._remove_node, self._add_node = remove_node, add_node

    def __call__(self, record: dict[str, Any]) -> None:
        if record.get("event") != EVENT or record.get("dir") != self.directory:
            return  # another fault's record (see combine)
        try:
            if record["action"] == "remove_node":
                self._remove_node(record["node_id"])
                _wait_until_gone(int(record["pid"]), _GONE_LIMIT_S)
            else:
                self._add_node()
        finally:
            _write_atomically(os.path.join(self.directory, "released"), "")

    def fired(self) -> Optional[dict[str, Any]]:
        """What fired: point, action, rank, epoch, size, node id and pid (None if nothing did)."""
        return _read_fired(self.directory)


def _wait_until_gone(pid: int, seconds: float) -> None:
    """Until process ``pid`` (on this machine, as a ``Cluster``'s nodes are) has ended or is a zombie:
    a removed node's worker ends only when it notices that its raylet is gone."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.05)
