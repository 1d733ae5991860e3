"""Private Gloo process groups and the strategies that run over one: the small-message recursive doubling
and gather-reduce, Gloo's own allreduce (a ring), allgather and broadcast.

A group is built on a store handed in by the caller (the coordinator's rendezvous in a job, an
in-memory store for a single process). ``torch.distributed.init_process_group`` is never called, so a
user's own ``torch.distributed`` code keeps working beside hvdray.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from hvdray.collective.errors import HorovodInternalError, NetworkDeviceError
from hvdray.collective.transport.mesh_store import FullMeshStore
from hvdray.collective.transport.reductions import REDUCERS, TransportOp, reduce_in_order
from hvdray.collective.transport.strategy import (
    AllgatherStrategy,
    AllreduceStrategy,
    BroadcastStrategy,
    ReducescatterStrategy,
    on_contiguous,
)

log = logging.getLogger(__name__)

#: over Gloo, an allreduce whose every-rank copies total at most this many bytes is an allgather plus a
#: reduction of the rows in rank order (identical on every rank): on the 2-core development machine
#: that is 1.4-2.4x the speed of Gloo's own allreduce for 12 B to 256 KB between 2 processes and
#: 1.3-1.6x for 256 B to 256 KB between 4, while from 1 MB Gloo's allreduce is as fast or faster
#: (``python benchmarks/gloo_small.py``)
GATHER_REDUCE_BYTES = 512 << 10

#: over Gloo, a small allreduce (at most this many bytes) among at least
#: :data:`RECURSIVE_DOUBLING_MIN_RANKS` ranks is a recursive doubling: log2(P) exchanges of the whole
#: message between partners, P log2 P point-to-point messages in all where the gather-reduce's allgather
#: ring sends P(P-1) in P-1 hops (the engine's flag vector crosses the nodes this way every tick). On the
#: 2-core development machine under load (``python benchmarks/gloo_small.py --ranks 2 4 8 --rounds 3``,
#: 2026-11-25) it ran 12 B to 256 KB at 1.3-5.6x the gather-reduce's speed among 4 ranks and 2.4-5.1x
#: among 8, and from 0.24x to 1.7x of it between 2 (so not there); faster still at 1 MB, but the bound
#: stays at 64 KiB until a quiet machine has measured past it
RECURSIVE_DOUBLING_BYTES = 64 << 10
RECURSIVE_DOUBLING_MIN_RANKS = 4

#: dtypes torch's Gloo backend can move and reduce.
GLOO_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.bool,
)


def group_options(
    timeout_s: float, hostname: Optional[str] = None, interface: Optional[str] = None
) -> "ProcessGroupGloo._Options":
    """Options for this rank's Gloo groups: the timeout, and the network interface (or the address) to use."""
    options = ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    address = None if interface else hostname or node_address()
    try:
        if interface:
            device = ProcessGroupGloo.create_device(interface=interface)
        else:
            device = ProcessGroupGloo.create_device(hostname=address)
    except RuntimeError as exc:
        if interface:
            here = ", ".join(name for _, name in socket.if_nameindex())
            where = (f"the network interface {interface!r} (nics) on node {socket.gethostname()}, "
                     f"whose interfaces are {here}")
        else:
            where = f"the address {address!r} on node {socket.gethostname()}"
        raise NetworkDeviceError(f"Gloo cannot open {where}: {exc}") from exc
    options._devices = [device]
    options._threads = 2
    return options


def abort(group: Union[ProcessGroupGloo, "GlooGroup", None]) -> None:
    """Abort ``group`` so that pending peers fail at once (nothing for None; a failing abort is logged)."""
    if group is None:
        return
    try:
        group.abort()
    except Exception:  # noqa: BLE001 - abort may be unsupported or already done; nothing to recover
        log.debug("gloo abort failed", exc_info=True)


class GlooGroup:
    """A private ``ProcessGroupGloo`` of ``size`` ranks that connects its full mesh through ``store`` when
    an op first needs it: a job whose every collective runs on shared memory or on the ranks' own
    connections (``sockets.py``: log2 P partners per rank) never pays Gloo's connect, P - 1 peers per
    rank and P^2 records through the rendezvous, unless it calls alltoall.

    Every rank connects in the same op: ops run in the order every rank agreed on, and every rank's
    lists pick the same strategy for an op. The whole mesh connects at once, within the group's
    timeout, as an eager group would (torch's own lazy connect, pair by pair, waits far past the
    timeout on a dead peer). ``rank()``, ``size()`` and :meth:`abort` answer without connecting; every
    other ``ProcessGroupGloo`` method connects first, then runs on the group."""

    def __init__(self, store: dist.Store, rank: int, size: int, options: "ProcessGroupGloo._Options") -> None:
        self._store = store
        self._rank = rank
        self._size = size
        self._options = options
        self._group: Optional[ProcessGroupGloo] = None
        self._aborted = False
        self._lock = threading.Lock()  # abort may come from another thread while the engine's connects

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    @property
    def connected(self) -> bool:
        """Whether the full mesh has been connected (for tests and logs)."""
        return self._group is not None

    def connect(self) -> ProcessGroupGloo:
        """The connected group (connecting it now, on the first call)."""
        group = self._group
        if group is not None:
            return group
        if self._aborted:
            raise HorovodInternalError("this Gloo group was closed before it connected")
        log.debug("rank %d connects its Gloo group of %d ranks", self._rank, self._size)
        group = ProcessGroupGloo(FullMeshStore(self._store, self._rank, self._size), self._rank, self._size,
                                 self._options)
        with self._lock:
            if self._aborted:  # closed while connecting: the new group goes too
                abort(group)
                raise HorovodInternalError("this Gloo group was closed while it connected")
            self._group = group
        return group

    def abort(self) -> None:
        """Abort the group if it has connected; never connect it afterwards."""
        with self._lock:
            self._aborted = True
            group = self._group
        abort(group)

    def __getattr__(self, name: str) -> Any:  # any other ProcessGroupGloo method: on the connected group
        if name.startswith("_") and name not in _FORWARDED_PRIVATE_OPS:  # this object's own fields among them
            raise AttributeError(name)
        return getattr(self.connect(), name)


#: the private ``ProcessGroupGloo`` ops the strategies call (no other ``_`` name is forwarded)
_FORWARDED_PRIVATE_OPS = frozenset({"_reduce_scatter_base", "_allgather_base"})


class GlooGatherReduce(AllreduceStrategy):
    """Small messages (every rank's copies total at most :data:`GATHER_REDUCE_BYTES`): an allgather and a
    reduction of the rows in rank order, faster than Gloo's allreduce there."""

    name = "gloo gather-reduce"

    def __init__(self, group: ProcessGroupGloo) -> None:
        self._group = group
        self._size = group.size()

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        return (
            self._size > 1 and tensor.numel() * tensor.element_size() * self._size <= GATHER_REDUCE_BYTES
            and op in REDUCERS
        )

    def reduce(self, tensor: torch.Tensor, op: TransportOp) -> None:
        if tensor.numel():
            reducer = REDUCERS[op]
            on_contiguous(tensor, lambda flat: self._gather_reduce(flat, reducer))

    def _gather_reduce(self, flat: torch.Tensor, reducer: Callable[..., torch.Tensor]) -> None:
        rows = torch.empty((self._size, flat.numel()), dtype=flat.dtype)
        self._group.allgather([list(rows.unbind(0))], [flat]).wait()
        reduce_in_order(reducer, rows[0], list(rows[1:]), flat)


def recursive_doubling(rank: int, size: int) -> Iterator[tuple[str, int, int]]:
    """The steps of ``rank`` in a recursive-doubling allreduce of ``size`` ranks, in order, as ``(kind,
    peer, tag)``: ``send`` (this rank's data to ``peer``), ``reduce`` (receive ``peer``'s and reduce it
    into this rank's), ``exchange`` (both at once), ``receive`` (take ``peer``'s result). ``tag`` numbers
    the phase, the same on both sides of a message.

    With P the largest power of two up to ``size``, the ranks from P on first fold their data into rank
    ``rank - P``; ranks 0..P-1 then exchange with the partner differing in one bit per round, so each
    holds the reduction of all after log2 P rounds; the folded ranks get it back at the end. Each
    reduction combines the same two operands on both partners, so every rank ends with the same bits
    (the elementwise ops are commutative)."""
    power = 1 << (size.bit_length() - 1)
    rounds = power.bit_length() - 1
    if rank >= power:
        yield "send", rank - power, 0
        yield "receive", rank - power, rounds + 1
        return
    if rank + power < size:
        yield "reduce", rank + power, 0
    for round_ in range(rounds):
        yield "exchange", rank ^ (1 << round_), round_ + 1
    if rank + power < size:
        yield "send", rank + power, rounds + 1


def recursive_doubling_messages(size: int) -> int:
    """Point-to-point messages of one recursive-doubling allreduce among ``size`` ranks (its sends)."""
    return sum(step[0] in ("send", "exchange") for rank in range(size) for step in recursive_doubling(rank, size))


class GlooRecursiveDoubling(AllreduceStrategy):
    """Small messages among several ranks: :func:`recursive_doubling` over Gloo's point-to-point sends,
    log2 P hops where the gather-reduce takes P - 1."""

    name = "gloo recursive doubling"

    def __init__(self, group: ProcessGroupGloo) -> None:
        self._group = group
        self._size = group.size()
        self._steps = tuple(recursive_doubling(group.rank(), self._size))

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        return (
            self._size >= RECURSIVE_DOUBLING_MIN_RANKS and op in REDUCERS
            and tensor.numel() * tensor.element_size() <= RECURSIVE_DOUBLING_BYTES
        )

    def reduce(self, tensor: torch.Tensor, op: TransportOp) -> None:
        if tensor.numel():
            reducer = REDUCERS[op]
            on_contiguous(tensor, lambda flat: self._run(flat, reducer))

    def _run(self, flat: torch.Tensor, reducer: Callable[..., torch.Tensor]) -> None:
        group, theirs = self._group, torch.empty_like(flat)
        for kind, peer, tag in self._steps:
            if kind == "send":
                group.send([flat], peer, tag).wait()
            elif kind == "receive":
                group.recv([flat], peer, tag).wait()
            else:
                sent = group.send([flat], peer, tag) if kind == "exchange" else None
                group.recv([theirs], peer, tag).wait()
                if sent is not None:
                    sent.wait()  # ``flat`` is read by the send: reduce into it only once it went out
                reducer(flat, theirs, out=flat)


class GlooRing(AllreduceStrategy):
    """Gloo's own allreduce: serves every elementwise op, so it closes a list."""

    name = "gloo ring"

    def __init__(self, group: ProcessGroupGloo) -> None:
        self._group = group

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        return True

    def reduce(self, tensor: torch.Tensor, op: TransportOp) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self._group.allreduce([tensor], opts).wait()


class GlooAllgather(AllgatherStrategy):
    """Gloo's allgather, straight into the rows of the output."""

    name = "gloo allgather"

    def __init__(self, group: ProcessGroupGloo) -> None:
        self._group = group
        self._size = group.size()

    def serves(self, tensor: torch.Tensor) -> bool:
        return True

    def run(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        self._group.allgather([list(out.unbind(0))], [tensor.contiguous()]).wait()


class GlooBroadcast(BroadcastStrategy):
    """Gloo's broadcast."""

    name = "gloo broadcast"

    def __init__(self, group: ProcessGroupGloo) -> None:
        self._group = group

    def serves(self, tensor: torch.Tensor, root: int) -> bool:
        return True

    def run(self, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        self._group.broadcast([tensor], opts).wait()


class GlooReducescatter(ReducescatterStrategy):
    """Gloo's reduce-scatter: serves every elementwise op, so it closes a list."""

    name = "gloo reducescatter"

    def __init__(self, group: ProcessGroupGloo) -> None:
        self._group = group

    def serves(self, tensor: torch.Tensor, op: TransportOp) -> bool:
        return True

    def run(self, tensor: torch.Tensor, out: torch.Tensor, op: TransportOp) -> None:
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = op
        self._group._reduce_scatter_base(out, tensor, opts).wait()


def node_address() -> str:
    """This node's own address (what its hostname resolves to), else loopback."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
