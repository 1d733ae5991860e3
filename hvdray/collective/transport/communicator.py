"""The engine's communicator: builds this rank's node segment, its own connections to its partners and its
private Gloo group(s), then runs every collective with the first strategy of its ordered list that
serves it (``order.py``).

The Gloo groups connect at the first op that needs them (``gloo.GlooGroup``): across nodes the
partner connections (``sockets.py``) carry the setup and every collective but alltoall, so a job
that calls no alltoall connects log2 P partners per rank instead of Gloo's full mesh.

Given the ranks' places (``rank_info``) and ``TransportOptions``, ranks that share a node move data
through a shared-memory segment instead of loopback TCP: every primitive on a single-node job, and
allreduce across nodes hierarchically. ``plan.plan_transport`` decides; every rank reaches the same
decision, so every rank builds the same lists.
"""

from __future__ import annotations

import contextlib
import logging
from typing import ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo, ReduceOp

from hvdray.collective.protocol import ReduceOp as Reduction
from hvdray.collective.topology import RankInfo
from hvdray.collective.transport import gloo, shm
from hvdray.collective.transport.gloo import GlooGroup
from hvdray.collective.transport.hierarchical import cross_node_group
from hvdray.collective.transport.mesh_store import prefixed
from hvdray.collective.transport.order import Strategies, ordered_strategies
from hvdray.collective.transport.plan import NodeLayout, TransportOptions, TransportPlan, plan_transport
from hvdray.collective.transport.reductions import GLOO_OPS, TRANSPORT_OPS
from hvdray.collective.transport.socket_strategies import SOCKET_ALLREDUCE_BYTES, and_bytes
from hvdray.collective.transport.sockets import PeerSockets, interface_address
from hvdray.collective.transport.strategy import Finish, first_serving

log = logging.getLogger(__name__)


class Communicator:
    """Blocking collectives over the node's segment (where the plan maps one), the ranks' own connections
    (``peer_sockets``) and a private Gloo group connected when first needed; used only by the engine thread."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout_s: float,
        hostname: Optional[str] = None,
        interface: Optional[str] = None,
        rank_info: Optional[RankInfo] = None,
        transport: Optional[TransportOptions] = None,
        peer_sockets: bool = True,
    ) -> None:
        self.rank = rank
        self.size = size
        options = gloo.group_options(timeout_s, hostname, interface)
        # connected at the first op that needs it (gloo.GlooGroup): with the ranks' own connections and
        # the node's segment serving every collective but alltoall, a job may never need it
        self._pg: Optional[GlooGroup] = GlooGroup(store, rank, size, options)
        self._node: Optional[shm.NodeCollectives] = None
        self._cross: Optional[GlooGroup] = None  # ranks with this local rank, one per node
        # the ranks' own connections (sockets.py) among all ranks, and among the cross-node group's
        self._peers: Optional[PeerSockets] = None
        self._cross_peers: Optional[PeerSockets] = None
        want_peers = peer_sockets and size > 1

        def connect_peers(prefix: str, rank: int, size: int) -> PeerSockets:
            address = interface_address(interface) if interface else hostname or gloo.node_address()
            return PeerSockets.connect(prefixed(store, prefix), rank, size, address, timeout_s)

        try:
            self.plan = TransportPlan(False, False, "no rank placement given")
            # every rank on one node with shm_transport on: the node's segment will likely serve everything
            # (the setup below runs over Gloo); otherwise the ranks' own connections carry the setup too
            one_segment = (rank_info is not None and transport is not None and transport.shm
                           and rank_info.local_size == size)
            if want_peers and not one_segment:
                self._peers = connect_peers("hvdray-tcp/", rank, size)
            self._use(ordered_strategies(self._pg, peers=self._peers))  # what the setup below runs on
            cross_place = None
            if rank_info is not None and transport is not None and size > 1:
                cross_place = self._setup_shared_memory(store, rank_info, transport, timeout_s, options)
            if want_peers and self._peers is None and self.transport != "shm":  # one node's segment serves all
                self._peers = connect_peers("hvdray-tcp/", rank, size)
            if want_peers and cross_place is not None:
                local_rank, node, nodes = cross_place
                self._cross_peers = connect_peers(f"hvdray-tcp-cross/{local_rank}/", node, nodes)
            self._use(ordered_strategies(self._pg, self._node, self._cross, self._peers, self._cross_peers))
        except BaseException:
            self.close()
            raise
        log.debug("rank %d transport %s (%s); strategies %s", rank, self.transport, self.plan.reason,
                  self.strategies.names())

    def _use(self, strategies: Strategies) -> None:
        """Run every op with ``strategies`` from now on."""
        self.strategies = strategies
        self._allreduces = strategies.allreduce
        self._allgathers = strategies.allgather
        self._broadcasts = strategies.broadcast
        self._reducescatters = strategies.reducescatter
        self._fused = strategies.fused

    @property
    def transport(self) -> str:
        """``"shm"`` (one node), ``"hierarchical"`` (shared memory + Gloo across nodes) or ``"gloo"``."""
        if self._node is None:
            return "gloo"
        return "hierarchical" if self._cross is not None else "shm"

    def close(self) -> None:
        """Drop the process groups and leave the node's segment; pending peers fail at once."""
        self._use(Strategies((), (), (), ()))
        node, self._node = self._node, None
        if node is not None:
            node.close()
        for peers in (self._peers, self._cross_peers):
            if peers is not None:
                peers.close()
        gloo.abort(self._cross)
        gloo.abort(self._pg)
        self._pg = self._cross = None

    # -- shared memory setup ------------------------------------------------------------------
    def _setup_shared_memory(
        self, store: dist.Store, info: RankInfo, transport: TransportOptions, timeout_s: float,
        options: "ProcessGroupGloo._Options",
    ) -> Optional[tuple[int, int, int]]:
        """Agree on a plan with every rank, then map the node's segment (and the cross-node group); when
        allreduce is hierarchical, this rank's place in its cross-node group: (local rank, node, nodes)."""
        unsupported = shm.unsupported_reason()
        mine = torch.tensor([info.local_rank, info.local_size, 0 if unsupported else 1], dtype=torch.int64)
        table = torch.stack(self.allgather(mine)).tolist()
        try:
            layout = NodeLayout.from_local_ranks([(lr, ls) for lr, ls, _ in table])
        except ValueError as exc:
            log.warning("shared-memory transport off: %s", exc)
            self.plan = TransportPlan(False, False, str(exc))
            return None
        if any(not ok for _, _, ok in table) and not unsupported:
            unsupported = "another rank cannot map shared memory"
        plan = plan_transport(layout, transport, [unsupported] if unsupported else [])
        cross_place = None
        if plan.node_shm:
            node = self._attach_node_segment(store, info, layout, transport, timeout_s)
            try:
                agreed = torch.tensor([1 if node is not None else 0], dtype=torch.uint8)
                self.and_flags(agreed)
                if node is not None:
                    node.segment.unlink()  # every local rank has tried to map it: the name can go
                if agreed.item():
                    if plan.hierarchical:
                        cross_place = (info.local_rank, layout.node_of(self.rank), layout.num_nodes)
                        self._cross = cross_node_group(store, *cross_place, options)
                    self._node, node = node, None
                else:
                    plan = TransportPlan(False, False, "a rank could not map its node's shared-memory segment")
            finally:
                if node is not None:  # not used (or setup failed): unmap, and unlink if this rank created it
                    node.close()
        self.plan = plan
        return cross_place

    def _attach_node_segment(
        self, store: dist.Store, info: RankInfo, layout: NodeLayout, transport: TransportOptions, timeout_s: float,
    ) -> Optional[shm.NodeCollectives]:
        """Local rank 0 creates the segment and publishes its name through the job's store; the others
        map it. Returns None on this rank's failure (the caller agrees with every rank before use)."""
        slot_bytes = shm.slot_bytes_for(transport.buffer_bytes, info.local_size)
        data_bytes = shm.data_bytes_for(slot_bytes, info.local_size)
        key = f"hvdray-shm/{layout.first_rank(layout.node_of(self.rank))}"
        segment = None
        try:
            if info.local_rank == 0:
                try:
                    segment = shm.Segment.create(transport.job_tag, info.local_size, data_bytes)
                finally:
                    store.set(key, segment.name.encode() if segment is not None else b"")
            else:
                name = store.get(key).decode()
                if not name:
                    raise shm.SharedMemoryError("local rank 0 could not create the node's segment")
                segment = shm.Segment.attach(name, info.local_size, data_bytes)
            return shm.NodeCollectives(
                segment, info.local_rank, timeout_s, slot_bytes, transport.adopt_tensors, transport.cross_memory,
                transport.share_pages)
        except Exception as exc:  # noqa: BLE001 - any failure here means plain Gloo for everyone
            log.warning(
                "rank %d cannot use the shared-memory transport (%s); the job falls back to Gloo. "
                "A smaller shm_buffer_mb may fit /dev/shm.", self.rank, exc,
            )
            if segment is not None:
                segment.close()
            return None

    # -- primitives ------------------------------------------------------------------------
    def allgather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order: through one node's segment in one round when it serves
        the whole job and every payload fits a slot; otherwise two allgathers (lengths, then padded bytes)."""
        if self.transport == "shm":  # one node: its local ranks are the ranks, in order
            gathered = self._node.allgather_bytes(payload)
            if gathered is not None:
                return gathered
        sizes = [int(t.item()) for t in self.allgather(torch.tensor([len(payload)], dtype=torch.int64))]
        longest = max(sizes)
        if longest == 0:
            return [b""] * self.size
        mine = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return [bytes(o[:n].numpy().tobytes()) for o, n in zip(self.allgather(mine), sizes)]

    def patient(self) -> ContextManager[None]:
        """A context for a round that a caller blocks on: the node's barrier waits give the core away longer
        before they sleep (``NodeBarrier.patient``); nothing changes without a segment."""
        node = self._node
        return node.barrier.patient() if node is not None else contextlib.nullcontext()

    def and_flags(self, flags: torch.Tensor) -> None:
        """Bitwise-AND a contiguous uint8 flag vector across ranks, in place: the engine's control traffic.
        As bytes combined as Python ints, no torch op: through one node's segment when it serves the whole
        job; over the ranks' own connections when they carry it all (no segment); hierarchically, through
        each node's segment and then over the connections among the ranks of one local rank across nodes
        (every local rank holds its node's AND, so each of those groups ends with everyone's). Otherwise
        (connections off) as an allreduce."""
        node, nbytes = self._node, flags.numel()
        if node is not None and nbytes <= node.slot_bytes and (self._cross is None or self._cross_peers is not None):
            node.and_bytes(flags.data_ptr(), nbytes)
            if self._cross is not None:
                and_bytes(self._cross_peers, memoryview(flags.numpy()).cast("B"))
            return
        if node is None and self._peers is not None and nbytes <= SOCKET_ALLREDUCE_BYTES:
            and_bytes(self._peers, memoryview(flags.numpy()).cast("B"))
            return
        first_serving(self._allreduces, flags, ReduceOp.BAND).run(flags, ReduceOp.BAND)

    def allreduce(self, tensor: torch.Tensor, op: Reduction, finish: Optional[Finish] = None) -> None:
        """Reduce ``tensor`` in place across all ranks with ``op`` (averaging is a sum here; Adasum is its
        own strategy). ``finish`` (elementwise, in place, on a list of tensors: averaging's division) runs
        on the result: the shared-memory strategies run it on each rank's reduced part before the peers
        copy it (one pass over 1/n of the data, in cache), the others on the whole tensor afterwards
        (:meth:`AllreduceStrategy.run`)."""
        transport_op = TRANSPORT_OPS[op]
        first_serving(self._allreduces, tensor, transport_op).run(tensor, transport_op, finish)

    def allreduce_into(
        self, source: torch.Tensor, output: torch.Tensor, op: Reduction, finish: Optional[Finish] = None,
    ) -> None:
        """Reduce ``source`` across all ranks into ``output`` (same shape and dtype, not overlapping it),
        as :meth:`allreduce`; strategies that can read ``source`` directly skip copying it into ``output``."""
        transport_op = TRANSPORT_OPS[op]
        first_serving(self._allreduces, output, transport_op).run_into(source, output, transport_op, finish)

    @property
    def fused_message_bytes(self) -> int:
        """The largest message :meth:`allreduce_tensors` takes (one slot of the node's shared-memory
        segment); 0 where no strategy takes fused lists (the caller then stages tensors in one flat buffer)."""
        return self._fused.fused_message_bytes if self._fused is not None else 0

    def allreduce_tensors(
        self, inputs: list[torch.Tensor], outputs: list[torch.Tensor], op: Reduction,
        finish: Optional[Finish] = None, shapes: Optional[tuple[torch.Size, ...]] = None,
    ) -> None:
        """Reduce same-dtype ``inputs`` as one message into ``outputs`` (may be the inputs), copied straight
        between them and the node's shared memory; the message must fit :attr:`fused_message_bytes`.
        ``finish`` (elementwise, in place, on a list of tensors) runs on the reduced data before it
        reaches the outputs;
        ``shapes``: see :meth:`NodeCollectives.allreduce_tensors`."""
        if self._fused is None:
            raise RuntimeError("allreduce_tensors needs a strategy that takes fused lists (fused_message_bytes is 0)")
        self._fused.run_tensors(inputs, outputs, TRANSPORT_OPS[op], finish, shapes)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Equal-shaped allgather; returns one tensor per rank (any dtype: see :func:`as_bytes`)."""
        out = torch.empty((self.size, *tensor.shape), dtype=tensor.dtype)
        self.allgather_into(tensor, out)
        return list(out.unbind(0))

    def allgather_into(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        """Equal-shaped allgather into the contiguous ``out`` of shape ``(size, *tensor.shape)``, rank
        ``r``'s tensor at ``out[r]``, with no copy after the gather (any dtype: see :func:`as_bytes`)."""
        if tensor.dtype not in _GLOO_DTYPE_SET:
            tensor, out = as_bytes(tensor.contiguous()), as_bytes(out)
        first_serving(self._allgathers, tensor).run(tensor, out)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """Every rank's contiguous ``tensor`` becomes rank ``root``'s, in place (any dtype)."""
        if tensor.dtype not in _GLOO_DTYPE_SET:
            tensor = as_bytes(tensor)
        first_serving(self._broadcasts, tensor, root).run(tensor, root)

    def alltoall(
        self, output: torch.Tensor, tensor: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int]
    ) -> None:
        """Rank r sends ``input_splits[q]`` rows of ``tensor`` to each rank q, into ``output`` (Gloo; any dtype)."""
        if tensor.dtype not in _GLOO_DTYPE_SET:
            output, tensor = as_bytes(output), as_bytes(tensor)
        self._pg.connect().alltoall_base(
            output, tensor, list(output_splits), list(input_splits), dist.AllToAllOptions()
        ).wait()

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, op: Reduction) -> None:
        """The contiguous ``tensor`` holds ``size`` equal chunks along dim 0 (read only); rank r receives the
        reduced chunk r into the contiguous ``output``."""
        transport_op = GLOO_OPS[op]
        first_serving(self._reducescatters, tensor, transport_op).run(tensor, output, transport_op)


_GLOO_DTYPE_SET = frozenset(gloo.GLOO_DTYPES)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of a dtype Gloo cannot move (int16, uint16, complex ...) as uint8, one more
    dimension holding each element's bytes: dim 0 (rows) stays, so allgather, broadcast and alltoall move
    it as they would the tensor itself. A view: writing it writes the tensor."""
    return tensor.unsqueeze(-1).view(torch.uint8)


def from_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`as_bytes`."""
    return data.view(dtype).squeeze(-1)
