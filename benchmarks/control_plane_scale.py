"""Control-plane scale: the rendezvous and the negotiation of N ranks, simulated in one process.

For N = 16, 64, 256, 1024 this runs hvdray's own control-plane code with N lightweight in-process
members (threads, no tensors, no sockets):

* **rendezvous** (one membership epoch): the real :class:`~hvdray.driver.coordinator_host.CoordinatorHost` (an
  in-process object on an asyncio loop instead of an actor, reached through the real
  :class:`~hvdray.driver.coordinator_host.CoordinatorClient` and token check), its rank assignment
  (``assign``), and every member's real :class:`~hvdray.worker.rendezvous.CoordinatorStore` under
  :class:`~hvdray.collective.transport.mesh_store.FullMeshStore`, through which each member replays
  what its ``Communicator`` asks of the store: Gloo's full-mesh connect of the job's group (one
  ``set`` of its pairs' addresses, then a ``wait`` and a ``get`` of every rank's key, in rank order:
  the sequence a real ``ProcessGroupGloo`` issues, with records of a real one's size, checked by
  ``tests/unit/test_control_plane_scale.py``),
  the node's shared-memory segment name (set by local rank 0, read by the others), on several
  nodes the connect of its cross-node group, and there the records of the small-message connections
  (``transport.sockets.partner_records``, the real code: one record set, one wait for its partners'
  below it, for the job's group and the cross-node one). Counted: every coordinator call (store operations and
  the assignment) and the value bytes the members read.
* **negotiation** (per training step): every member's real engine
  :class:`~hvdray.collective.engine.agreement.Agreement` sorts ``--tensors`` named requests, fills its
  flag vector, the flags are AND-ed, a full round's :class:`RoundMessage`\\ s are encoded, gathered and
  decoded, absorbed and planned, as the engine loop does. Counted per step: control collectives
  and their bytes per rank; messages are those collectives' point-to-point messages under the
  transport the job would use: the flags' AND crosses the nodes (``--ranks-per-node`` > 1:
  hierarchical, shared memory inside a node) or all ranks (1) by recursive doubling over the ranks' own
  connections (P log2 P messages); a full round's two allgathers (lengths, messages) take the same
  connections (a recursive doubling of the rows each rank holds: P log2 P messages each for a power of
  two, a few more for the ranks folded in otherwise).

``--rendezvous`` picks how the members read the Gloo records: ``parts`` (hvdray: one gathered wait
per group, each record cut to the reader's part, ``hvdray.collective.gloo_record``), ``whole`` (one
gathered wait, whole records: O(N) bytes a record, O(N^3) in all) or ``per-key`` (no ``FullMeshStore``:
what Gloo asks of a plain store, a wait and a get per record, O(N^2) calls). ``--baseline`` adds the
other two for the plot, ``--plot PATH`` saves the curves as a PNG (``docs/img/control_plane_scale.png``).

    python benchmarks/control_plane_scale.py --sizes 16 64 256 1024 --plot docs/img/control_plane_scale.png
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import secrets
import socket
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from hvdray.collective import gloo_record
from hvdray.collective.engine.agreement import Agreement
from hvdray.collective.engine.handle import Handle, Request
from hvdray.collective.engine.negotiation import RoundMessage
from hvdray.collective.protocol import OpDesc, OpKind, ReduceOp
from hvdray.collective.topology import WorkerSlot
from hvdray.collective.transport.gloo import recursive_doubling_messages
from hvdray.collective.transport.sockets import partner_records, partners
from hvdray.collective.transport.mesh_store import FullMeshStore
from hvdray.driver.coordinator_host import CoordinatorClient, CoordinatorHost
from hvdray.worker.rendezvous import CoordinatorStore

#: bytes of the device address in a rank's Gloo record (torch 2.x's TCP transport: a sockaddr_storage
#: and a sequence number): checked against a real ProcessGroupGloo by tests/unit/test_control_plane_scale.py
GLOO_DEVICE_ADDRESS_BYTES = 136
RENDEZVOUS_MODES = ("parts", "whole", "per-key")
TIMEOUT_S = 600.0


# -- the in-process coordinator ------------------------------------------------------------------
class InProcessCoordinator:
    """A :class:`CoordinatorHost` on an asyncio loop in a thread, with an actor handle's ``method.remote()``
    shape: every job call counted by method, with the bytes of the rendezvous values it answers."""

    def __init__(self) -> None:
        token = secrets.token_bytes(32)
        self.digest = hashlib.sha256(token).digest()
        self.log: list[tuple[str, tuple[Any, ...]]] = []  # every call, in the order it was sent
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="coordinator", daemon=True)
        self._thread.start()
        self.host = self._on_loop(lambda: CoordinatorHost(self.digest)).result()
        self.client = CoordinatorClient(self, token)
        self.calls: Counter[str] = Counter()
        self.value_bytes = 0
        self._lock = threading.Lock()

    def _on_loop(self, fn: Callable[[], Any]) -> Future:
        async def call() -> Any:
            result = fn()
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(call(), self.loop)

    def __getattr__(self, method: str) -> "_Method":
        if method.startswith("_"):
            raise AttributeError(method)
        return _Method(self, method)

    def count(self, method: str, result: Any) -> None:
        """Runs on the coordinator's thread (a done callback), so in C: a Python step per value read would
        be N^2 steps of the benchmark's own, counted as the coordinator's CPU (they were, before
        2026-11-27: about 1.5 s of the 2.2-3.4 s reported at N = 1024)."""
        values_bytes = 0
        if method in ("kv_read", "kv_get") and result[1] is not None:
            answer = result[1]
            if method == "kv_get":
                values_bytes = len(answer)
            elif isinstance(answer, tuple):  # one reader's parts of a Gloo group's records: (heads, pair ids)
                values_bytes = sum(map(len, answer[0])) + len(answer[1])
            else:
                values_bytes = sum(map(len, answer))
        with self._lock:
            self.calls[method] += 1
            self.value_bytes += values_bytes

    def cpu_seconds(self) -> float:
        """CPU time the coordinator's thread has used: the serial part of a rendezvous."""
        return self._on_loop(time.thread_time).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


@dataclass
class _Method:
    owner: InProcessCoordinator
    name: str

    def remote(self, *args: Any) -> Future:
        owner, name = self.owner, self.name
        with owner._lock:  # the order the loop gets them in
            owner.log.append((name, args))
            future = owner._on_loop(lambda: getattr(owner.host, name)(*args))
        counted = args[1] if name == "call" else name  # call(token, method, ...): count the job's method
        future.add_done_callback(lambda f: f.exception() is None and owner.count(counted, f.result()))
        return future


def coordinator_cpu_alone(digest: bytes, calls: list[tuple[str, tuple[Any, ...]]]) -> float:
    """CPU seconds a fresh coordinator spends on ``calls``, sent to it in their order in one thread with
    nothing else running (each call runs until its first wait before the next is sent): the
    coordinator's own cost. In the simulation its thread shares one interpreter with N member
    threads, and its CPU time there also counts the GIL's hand-offs between them."""
    async def replay() -> float:
        host = CoordinatorHost(digest)
        pending = []
        started = time.thread_time()
        for name, args in calls:
            result = getattr(host, name)(*args)
            if asyncio.iscoroutine(result):
                pending.append(asyncio.ensure_future(result))
                await asyncio.sleep(0)
        await asyncio.gather(*pending)
        return time.thread_time() - started

    return asyncio.run(replay())


def resolve(future: Future) -> Any:
    """What ``ray.get`` is to the actor: the answer of one in-process coordinator call."""
    return future.result()


# -- the rendezvous ------------------------------------------------------------------------------
def gloo_connect(store: dist.Store, rank: int, size: int) -> None:
    """What a ``ProcessGroupGloo`` of ``size`` ranks (one device) asks of its store while it connects: its
    record (host name, device address, one pair identifier per rank), then every rank's record."""
    address = bytes(GLOO_DEVICE_ADDRESS_BYTES)
    store.set(f"0/{rank}", gloo_record.record(socket.gethostname().encode(), address, list(range(size))))
    for peer in range(size):
        store.wait([f"0/{peer}"])
        own_pair_id = store.get(f"0/{peer}")[-8 * (size - rank):][:8]  # all of the record that Gloo uses
        if peer != rank and own_pair_id != rank.to_bytes(8, sys.byteorder):
            raise RuntimeError(f"rank {rank} read rank {peer}'s record without its own pair identifier")


class WholeRecords(dist.Store):
    """``store`` without its record parts: a gathered wait brings back whole records."""

    def __init__(self, store: CoordinatorStore) -> None:
        super().__init__()
        self._store = store

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return self._store.get(key)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self._store.wait(keys)


def gloo_store(store: CoordinatorStore, rank: int, size: int, mode: str) -> dist.Store:
    """The store a member's Gloo group connects through, for ``--rendezvous mode``."""
    if mode == "parts":
        return FullMeshStore(store, rank, size)
    if mode == "whole":
        return FullMeshStore(WholeRecords(store), rank, size)
    return store


def member_rendezvous(sim: InProcessCoordinator, epoch: int, rank: int, size: int, per_node: int,
                      mode: str, gloo: str = "lazy") -> None:
    """One member's rendezvous, as its ``Communicator`` runs it (job group, node segment, cross-node group).

    ``gloo="lazy"`` (hvdray): a job on several nodes connects its partner connections first and runs
    its setup over them, and its Gloo groups connect only at a first alltoall (not replayed); one
    node's job connects its Gloo group for the setup. ``"eager"``: every Gloo group connects in the
    rendezvous, as hvdray's did before 2026-11-28 and as a job's does at its first alltoall."""
    store = CoordinatorStore(sim.client, f"e{epoch}/gen1/", TIMEOUT_S, resolve=resolve)
    node, local_rank = divmod(rank, per_node)
    nodes = size // per_node
    if nodes > 1:  # peer_sockets: the job's partner connections
        partner_records(store.prefixed("hvdray-tcp/"), rank, size, _socket_record(rank, size))
    if gloo == "eager" or nodes == 1:
        gloo_connect(gloo_store(store, rank, size, mode), rank, size)
    if per_node > 1:  # the node's shared-memory segment: local rank 0 names it, the others read the name
        key = f"hvdray-shm/{node * per_node}"
        if local_rank == 0:
            store.set(key, f"hvdray-{node}".encode())
        else:
            store.get(key)
    if per_node > 1 and nodes > 1:  # hierarchical: the group of this local rank across the nodes
        if gloo == "eager":
            gloo_connect(gloo_store(store.prefixed(f"hvdray-cross/{local_rank}/"), node, nodes, mode), node, nodes)
        partner_records(store.prefixed(f"hvdray-tcp-cross/{local_rank}/"), node, nodes, _socket_record(node, nodes))


def _socket_record(rank: int, size: int) -> Optional[bytes]:
    """A listener's record (address, port, 32-byte key in hex) as ``PeerSockets.connect`` publishes it,
    for a rank with a partner above it (None: it does not listen)."""
    return f"10.0.{rank // 250}.{rank % 250} 40000 {'0' * 64}".encode() if partners(rank, size)[1] else None


def rendezvous(size: int, per_node: int, mode: str, gloo: str = "lazy") -> dict[str, Any]:
    """One epoch's rank assignment and every member's rendezvous; coordinator calls counted."""
    sim = InProcessCoordinator()
    try:
        slots = [WorkerSlot(node_id=f"node-{r // per_node}", hostname=f"host-{r // per_node}",
                            ip=f"10.0.{r // per_node // 250}.{r // per_node % 250}") for r in range(size)]
        started, coordinator_cpu = time.perf_counter(), sim.cpu_seconds()
        epoch, infos, _ = resolve(sim.client.assign.remote(slots))
        if [i.rank for i in infos] != list(range(size)):
            raise RuntimeError("the coordinator did not rank the slots in node order")
        with ThreadPoolExecutor(max_workers=size) as pool:
            for done in [pool.submit(member_rendezvous, sim, epoch, r, size, per_node, mode, gloo)
                         for r in range(size)]:
                done.result()
        seconds = time.perf_counter() - started
        coordinator_cpu = sim.cpu_seconds() - coordinator_cpu
        calls = dict(sim.calls)
        return {
            "seconds": seconds,
            "coordinator_cpu_seconds": coordinator_cpu,
            "coordinator_cpu_alone_seconds": coordinator_cpu_alone(sim.digest, sim.log),
            "coordinator_calls": sum(calls.values()),
            "store_ops": sum(n for m, n in calls.items() if m.startswith("kv_")),
            "calls_by_method": calls,
            "value_bytes": sim.value_bytes,
        }
    finally:
        sim.close()


# -- the negotiation -----------------------------------------------------------------------------
def _requests(tensors: int) -> list[Request]:
    return [
        Request(OpDesc(f"grad.{i}", OpKind.ALLREDUCE, torch.float32, (1024,), ReduceOp.AVERAGE), None, None,
                Handle(f"grad.{i}"))
        for i in range(tensors)
    ]


def flag_messages(size: int, per_node: int) -> int:
    """Point-to-point messages of one AND of the flag vector: inside a node the ranks share memory
    (hierarchical, ``per_node`` > 1) and the node's part crosses the nodes; with one rank per node
    every rank takes part: a recursive doubling over the ranks' own connections (P log2 P messages)."""
    group = size // per_node if per_node > 1 else size
    return recursive_doubling_messages(group)


def round_messages(size: int) -> int:
    """Point-to-point messages of a full round's two allgathers (every rank's length, then every message
    padded to the longest) over the ranks' own connections: ``SocketAllgather``'s recursive doubling,
    whose ranks 0..P-1 send their block once per round and once more where it holds rows of ranks from P
    on, which send their row in and get the result back (``transport/socket_strategies.py``)."""
    power = 1 << (size.bit_length() - 1)
    messages = 2 * (size - power)  # the folded ranks' rows in, the results out
    bit = 1
    while bit < power:
        messages += sum(1 + ((rank & ~(bit - 1)) + power < size) for rank in range(power))
        bit <<= 1
    return 2 * messages


def negotiation(size: int, per_node: int, tensors: int, steps: int) -> list[dict[str, Any]]:
    """``steps`` training steps of ``tensors`` allreduces: per step, the control collectives every rank's
    real Agreement runs (the flags' AND; a full round's message allgather), with their bytes."""
    members = [Agreement(r, size, 64 << 20, math.inf, 0.0, 1024, None) for r in range(size)]
    per_step = []
    for step in range(steps):
        collectives = flag_bytes = round_bytes = ran = sent = 0
        for member in members:
            member.sort(_requests(tensors))
        while any(m.slot_requests or m.outbox for m in members):  # engine cycles
            if collectives > 8:
                raise RuntimeError(f"step {step} did not finish in {collectives} control collectives")
            flags = [m.fill_flags(bool(m.outbox), blocked=True) for m in members]
            combined = flags[0].clone()
            for f in flags[1:]:
                combined.bitwise_and_(f)
            for f in flags:
                f.copy_(combined)
            collectives += 1
            sent += flag_messages(size, per_node)
            flag_bytes += combined.numel()
            read = [m.read_flags() for m in members]
            if read[0][2]:  # a full round: every rank's message to every rank
                payloads = [m.message(False, False, 1, None).encode() for m in members]
                collectives += 1
                sent += round_messages(size)
                round_bytes += sum(len(p) for p in payloads)
                messages = [RoundMessage.decode(p) for p in payloads]  # decoded once: every rank decodes alike
                for member in members:
                    member.absorb(messages)
            plans = [m.ready_plan(r[0], 0) for m, r in zip(members, read)]
            ran += len(plans[0])
        if not ran:
            raise RuntimeError(f"step {step}: the members agreed on nothing to run")
        per_step.append({
            "control_collectives": collectives,
            "bytes_per_rank": flag_bytes + round_bytes,
            "messages": sent,
        })
    return per_step


# -- the report ----------------------------------------------------------------------------------
def measure(sizes: list[int], per_node: int, tensors: int, steps: int, mode: str,
            gloo: str = "lazy") -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        if size % per_node:
            raise ValueError(f"--sizes: {size} is not a multiple of --ranks-per-node {per_node}")
        row = {"size": size, "rendezvous": rendezvous(size, per_node, mode, gloo),
               "steps": negotiation(size, per_node, tensors, steps)}
        rows.append(row)
        r, last = row["rendezvous"], row["steps"][-1]
        print(f"N={size:5d}: rendezvous {r['seconds']:.2f} s (coordinator CPU {r['coordinator_cpu_seconds']:.2f} s, "
              f"its calls replayed alone {r['coordinator_cpu_alone_seconds']:.2f} s), "
              f"{r['store_ops']} store ops, "
              f"{r['coordinator_calls']} coordinator calls, {r['value_bytes'] / 2**20:.1f} MiB read; "
              f"first step {row['steps'][0]['control_collectives']} control collectives, steady step "
              f"{last['control_collectives']} ({last['bytes_per_rank']} B per rank, {last['messages']} messages)",
              flush=True)
    return rows


def growth_exponent(rows: list[dict[str, Any]], value: Callable[[dict[str, Any]], float]) -> float:
    """The slope of log(value) against log(N) between the smallest and the largest N."""
    first, last = rows[0], rows[-1]
    return math.log(value(last) / value(first)) / math.log(last["size"] / first["size"])


def plot(rows: list[dict[str, Any]], baseline: dict[str, list[dict[str, Any]]] | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baseline = baseline or {}
    sizes = [r["size"] for r in rows]
    fig, (calls, volume, step) = plt.subplots(1, 3, figsize=(15, 4.2))
    calls.loglog(sizes, [r["rendezvous"]["store_ops"] for r in rows], "o-", label="store ops")
    if baseline.get("eager"):
        calls.loglog(sizes, [r["rendezvous"]["store_ops"] for r in baseline["eager"]], "d-.",
                     label="store ops (Gloo connected in the rendezvous)")
    calls.loglog(sizes, [r["rendezvous"]["coordinator_calls"] for r in rows], "s--", label="coordinator calls")
    if baseline.get("per-key"):
        calls.loglog([r["size"] for r in baseline["per-key"]], [r["rendezvous"]["store_ops"] for r in baseline["per-key"]],
                     "x:", label="store ops (Gloo connected, per-key waits)")
    calls.loglog(sizes, [n * math.log2(n) for n in sizes], color="grey", lw=0.8, label="N log2 N")
    calls.set_title("rendezvous of one epoch: calls")
    volume.loglog(sizes, [r["rendezvous"]["value_bytes"] for r in rows], "o-", label="bytes read")
    if baseline.get("eager"):
        volume.loglog(sizes, [r["rendezvous"]["value_bytes"] for r in baseline["eager"]], "d-.",
                      label="bytes read (Gloo connected, record parts)")
    if baseline.get("whole"):
        volume.loglog([r["size"] for r in baseline["whole"]], [r["rendezvous"]["value_bytes"] for r in baseline["whole"]],
                      "+:", label="bytes read (Gloo connected, whole records)")
    scale = rows[0]["rendezvous"]["value_bytes"] / sizes[0] ** 2
    volume.loglog(sizes, [scale * n * n for n in sizes], color="grey", lw=0.8, label="N^2")
    volume.loglog(sizes, [scale * n ** 3 / sizes[0] for n in sizes], color="grey", lw=0.8, ls="--", label="N^3")
    first = rows[0]["rendezvous"]["value_bytes"] / (sizes[0] * math.log2(sizes[0]))
    volume.loglog(sizes, [first * n * math.log2(n) for n in sizes], color="grey", lw=0.8, ls=":", label="N log2 N")
    volume.set_title("rendezvous of one epoch: bytes through the coordinator")
    step.loglog(sizes, [r["steps"][-1]["messages"] for r in rows], "o-", label="control messages / steady step")
    step.loglog(sizes, [r["steps"][-1]["bytes_per_rank"] for r in rows], "s--", label="control bytes / rank / step")
    step.loglog(sizes, [r["rendezvous"]["coordinator_cpu_alone_seconds"] for r in rows], "^-.",
                label="rendezvous: coordinator CPU s (its calls alone)")
    step.loglog(sizes, [n * math.log2(n) for n in sizes], color="grey", lw=0.8, label="N log2 N")
    step.set_title("per step (negotiation); coordinator CPU")
    for axes in (calls, volume, step):
        axes.set_xlabel("ranks N")
        axes.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--tensors", type=int, default=16, help="named allreduces per training step")
    parser.add_argument("--steps", type=int, default=3, help="training steps (the first negotiates names)")
    parser.add_argument("--rendezvous", choices=RENDEZVOUS_MODES, default="parts",
                        help="how members read the Gloo records (see above)")
    parser.add_argument("--gloo", choices=("lazy", "eager"), default="lazy",
                        help="lazy: Gloo groups connect at a first alltoall (hvdray); eager: in the rendezvous "
                             "(hvdray before 2026-11-28, and a job that calls alltoall)")
    parser.add_argument("--baseline", action="store_true",
                        help="also run the rendezvous of the other --rendezvous modes (for the plot)")
    parser.add_argument("--baseline-max", type=int, default=256,
                        help="largest N of the per-key baseline (its N^2 store calls take minutes beyond)")
    parser.add_argument("--plot", default=None, help="save the curves as a PNG here")
    parser.add_argument("--json", default=None, help="write the measurements here")
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.sizes) or args.sizes != sorted(args.sizes):
        parser.error("--sizes must be increasing and at least 2")
    if args.ranks_per_node < 1 or args.tensors < 1 or args.steps < 2:
        parser.error("--ranks-per-node and --tensors must be at least 1, --steps at least 2")
    torch.set_num_threads(1)
    rows = measure(args.sizes, args.ranks_per_node, args.tensors, args.steps, args.rendezvous, args.gloo)
    baseline = None
    if args.baseline:
        baseline = {}
        if args.gloo == "lazy":  # the same, with every Gloo group connected in the rendezvous
            print(f"baseline (--gloo eager --rendezvous {args.rendezvous}):")
            baseline["eager"] = measure(args.sizes, args.ranks_per_node, args.tensors, 2, args.rendezvous, "eager")
        for mode in RENDEZVOUS_MODES:  # how the Gloo records are read matters where they are read: eager
            if mode != args.rendezvous:
                print(f"baseline (--gloo eager --rendezvous {mode}):")
                sizes = [n for n in args.sizes if mode != "per-key" or n <= args.baseline_max]
                baseline[mode] = measure(sizes, args.ranks_per_node, args.tensors, 2, mode, "eager")
    print(f"\ngrowth exponents (N^k): store ops {growth_exponent(rows, lambda r: r['rendezvous']['store_ops']):.2f}, "
          f"coordinator calls {growth_exponent(rows, lambda r: r['rendezvous']['coordinator_calls']):.2f}, "
          f"bytes read {growth_exponent(rows, lambda r: r['rendezvous']['value_bytes']):.2f}, "
          f"steady-step messages {growth_exponent(rows, lambda r: r['steps'][-1]['messages']):.2f}")
    if args.plot:
        plot(rows, baseline, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "baseline": baseline}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
