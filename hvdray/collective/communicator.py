"""A private Gloo process group and the blocking primitives the engine builds on.

The group is built on a store handed in by the caller (the coordinator's rendezvous in a job, an
in-memory store for a single process). ``torch.distributed.init_process_group`` is never called, so
a user's own ``torch.distributed`` code keeps working beside hvdray.

Given the ranks' places (``rank_info``) and ``TransportOptions``, ranks that share a node move data
through a shared-memory segment instead of loopback TCP: every primitive on a single-node job, and
allreduce across nodes hierarchically (shared memory inside each node, Gloo between the ranks that
hold the same local rank on every node, each for its own part of the data). ``transport.plan_transport``
decides; every rank reaches the same decision.
"""

from __future__ import annotations

import datetime
import logging
import socket
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo, ReduceOp

from hvdray.collective import shm
from hvdray.collective.adasum import adasum_tree
from hvdray.collective.protocol import ReduceOp as Reduction
from hvdray.collective.shm_collectives import REDUCERS, Finish, NodeCollectives, slot_bytes_for
from hvdray.collective.topology import RankInfo
from hvdray.collective.transport import NodeLayout, TransportOptions, TransportPlan, plan_transport

log = logging.getLogger(__name__)

#: over Gloo, an allreduce whose every-rank copies total at most this many bytes is an allgather plus a
#: reduction of the rows in rank order (identical on every rank): on the 2-core development machine
#: that is 1.4-2.4x the speed of Gloo's own allreduce for 12 B to 256 KB between 2 processes and
#: 1.3-1.6x for 256 B to 256 KB between 4, while from 1 MB Gloo's allreduce is as fast or faster
#: (``python benchmarks/gloo_small.py``)
GATHER_REDUCE_BYTES = 512 << 10

#: the Gloo reduction of each of hvdray's (averaging is a sum here: the engine divides afterwards);
#: Adasum is not a Gloo op (see :meth:`Communicator.allreduce`). Plain strings look up as well.
GLOO_OPS = {
    Reduction.SUM: ReduceOp.SUM,
    Reduction.AVERAGE: ReduceOp.SUM,
    Reduction.MIN: ReduceOp.MIN,
    Reduction.MAX: ReduceOp.MAX,
    Reduction.PRODUCT: ReduceOp.PRODUCT,
}

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


class Communicator:
    """Blocking collectives over one private ``ProcessGroupGloo``; used only by the engine thread."""

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
    ) -> None:
        self.rank = rank
        self.size = size
        options = ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        if interface:
            device = ProcessGroupGloo.create_device(interface=interface)
        else:
            device = ProcessGroupGloo.create_device(hostname=hostname or _loopback_or_host())
        options._devices = [device]
        options._threads = 2
        self._pg = ProcessGroupGloo(store, rank, size, options)
        self._node: Optional[NodeCollectives] = None
        self._cross: Optional[ProcessGroupGloo] = None  # ranks with this local rank, one per node
        self.plan = TransportPlan(False, False, "no rank placement given")
        if rank_info is not None and transport is not None and size > 1:
            self._setup_shared_memory(store, rank_info, transport, timeout_s, options)

    @property
    def transport(self) -> str:
        """``"shm"`` (one node), ``"hierarchical"`` (shared memory + Gloo across nodes) or ``"gloo"``."""
        if self._node is None:
            return "gloo"
        return "hierarchical" if self._cross is not None else "shm"

    def close(self) -> None:
        """Drop the process groups and leave the node's segment; pending peers fail at once."""
        node, self._node = self._node, None
        if node is not None:
            node.close()
        for pg in (self._cross, self._pg):
            if pg is None:
                continue
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - abort may be unsupported or already done; nothing to recover
                log.debug("gloo abort failed", exc_info=True)
        self._pg = self._cross = None

    # -- shared memory setup ------------------------------------------------------------------
    def _setup_shared_memory(
        self, store: dist.Store, info: RankInfo, transport: TransportOptions, timeout_s: float,
        options: "ProcessGroupGloo._Options",
    ) -> None:
        """Agree on a plan with every rank, then map the node's segment (and the cross-node group)."""
        unsupported = shm.unsupported_reason()
        mine = torch.tensor([info.local_rank, info.local_size, 0 if unsupported else 1], dtype=torch.int64)
        table = torch.stack(self._allgather(mine)).tolist()
        try:
            layout = NodeLayout.from_local_ranks([(lr, ls) for lr, ls, _ in table])
        except ValueError as exc:
            log.warning("shared-memory transport off: %s", exc)
            self.plan = TransportPlan(False, False, str(exc))
            return
        if any(not ok for _, _, ok in table) and not unsupported:
            unsupported = "another rank cannot map shared memory"
        plan = plan_transport(layout, transport, [unsupported] if unsupported else [])
        if plan.node_shm:
            node = self._attach_node_segment(store, info, layout, transport, timeout_s)
            try:
                agreed = torch.tensor([1 if node is not None else 0], dtype=torch.uint8)
                self.and_flags(agreed)
                if node is not None:
                    node.segment.unlink()  # every local rank has tried to map it: the name can go
                if agreed.item():
                    if plan.hierarchical:
                        self._cross = ProcessGroupGloo(
                            dist.PrefixStore(f"hvdray-cross/{info.local_rank}/", store),
                            layout.node_of(self.rank), layout.num_nodes, options,
                        )
                    self._node, node = node, None
                else:
                    plan = TransportPlan(False, False, "a rank could not map its node's shared-memory segment")
            finally:
                if node is not None:  # not used (or setup failed): unmap, and unlink if this rank created it
                    node.close()
        self.plan = plan
        log.debug("rank %d transport %s (%s)", self.rank, self.transport, plan.reason)

    def _attach_node_segment(
        self, store: dist.Store, info: RankInfo, layout: NodeLayout, transport: TransportOptions, timeout_s: float,
    ) -> Optional[NodeCollectives]:
        """Local rank 0 creates the segment and publishes its name through the job's store; the others
        map it. Returns None on this rank's failure (the caller agrees with every rank before use)."""
        slot_bytes = slot_bytes_for(transport.buffer_bytes, info.local_size)
        data_bytes = 2 * info.local_size * slot_bytes
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
            return NodeCollectives(segment, info.local_rank, timeout_s, slot_bytes)
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
        """Every rank's ``payload``, in rank order (two allgathers: lengths, then padded bytes)."""
        sizes = [int(t.item()) for t in self._allgather(torch.tensor([len(payload)], dtype=torch.int64))]
        longest = max(sizes)
        if longest == 0:
            return [b""] * self.size
        mine = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return [bytes(o[:n].numpy().tobytes()) for o, n in zip(self._allgather(mine), sizes)]

    def and_flags(self, flags: torch.Tensor) -> None:
        """Bitwise-AND a uint8 flag vector across ranks, in place: the engine's control traffic."""
        self._allreduce(flags, ReduceOp.BAND)

    # The engine's control traffic (and_flags, allgather_bytes) and its data ops share the private
    # _allreduce/_allgather below, so that the public data primitives stay separate methods.
    def allreduce(self, tensor: torch.Tensor, op: Reduction) -> None:
        """Reduce ``tensor`` in place across all ranks with ``op`` (Adasum: gathered, then combined
        pairwise in the same tree on every rank)."""
        if op == Reduction.ADASUM:
            tensor.copy_(adasum_tree(self._allgather(tensor)))
            return
        self._allreduce(tensor, GLOO_OPS[op])

    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp.RedOpType) -> None:
        if self._node is not None and tensor.numel():
            cross = self._cross_allreduce(op) if self._cross is not None else None
            _on_contiguous(tensor, lambda flat: self._node.allreduce(flat, op, cross))
            return
        _gloo_allreduce(self._pg, tensor, op)

    @property
    def fused_message_bytes(self) -> int:
        """The largest message :meth:`allreduce_tensors` takes: one slot of the node's shared-memory
        segment; 0 without shared memory (the caller then stages tensors in one flat buffer)."""
        return self._node.slot_bytes if self._node is not None else 0

    def allreduce_tensors(
        self, inputs: list[torch.Tensor], outputs: list[torch.Tensor], op: Reduction,
        finish: Optional[Finish] = None, shapes: Optional[tuple[torch.Size, ...]] = None,
    ) -> None:
        """Reduce same-dtype ``inputs`` as one message into ``outputs`` (may be the inputs), copied straight
        between them and the node's shared memory; the message must fit :attr:`fused_message_bytes`.
        ``finish`` (elementwise, in place, on a list of tensors) runs on the reduced data before it
        reaches the outputs;
        ``shapes``: see :meth:`NodeCollectives.allreduce_tensors`."""
        gloo_op = GLOO_OPS[op]
        cross = self._cross_allreduce(gloo_op) if self._cross is not None else None
        self._node.allreduce_tensors(inputs, outputs, gloo_op, cross, finish, shapes)

    def _cross_allreduce(self, op: ReduceOp.RedOpType) -> Callable[[torch.Tensor], None]:
        cross = self._cross
        return lambda part: _gloo_allreduce(cross, part, op)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Equal-shaped allgather; returns one tensor per rank."""
        return self._allgather(tensor)

    def _allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self._node is not None and self._cross is None:
            out = torch.empty((self.size, *tensor.shape), dtype=tensor.dtype)
            if tensor.numel():
                self._node.allgather(tensor.contiguous().view(-1), out.view(-1))
            return list(out.unbind(0))
        outs = [torch.empty_like(tensor) for _ in range(self.size)]
        self._pg.allgather([outs], [tensor]).wait()
        return outs

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """Every rank's ``tensor`` becomes rank ``root``'s, in place."""
        if self._node is not None and self._cross is None:
            if tensor.numel():
                _on_contiguous(tensor, lambda flat: self._node.broadcast(flat, root))
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        self._pg.broadcast([tensor], opts).wait()

    def alltoall(
        self, output: torch.Tensor, tensor: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int]
    ) -> None:
        self._pg.alltoall_base(output, tensor, list(output_splits), list(input_splits), dist.AllToAllOptions()).wait()

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, op: Reduction) -> None:
        """``tensor`` holds ``size`` equal chunks along dim 0; rank r receives the reduced chunk r."""
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = GLOO_OPS[op]
        self._pg._reduce_scatter_base(output, tensor, opts).wait()


def _gloo_allreduce(pg: ProcessGroupGloo, tensor: torch.Tensor, op: ReduceOp.RedOpType) -> None:
    """Allreduce ``tensor`` in place over ``pg``: small messages as an allgather and a reduction in rank
    order (see :data:`GATHER_REDUCE_BYTES`), others with Gloo's allreduce."""
    reducer, size = REDUCERS.get(op), pg.size()
    if reducer is not None and size > 1 and tensor.numel() * tensor.element_size() * size <= GATHER_REDUCE_BYTES:
        if tensor.numel():
            _on_contiguous(tensor, lambda flat: _gather_reduce(pg, size, flat, reducer))
        return
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    pg.allreduce([tensor], opts).wait()


def _gather_reduce(pg: ProcessGroupGloo, size: int, flat: torch.Tensor, reducer: Callable[..., torch.Tensor]) -> None:
    rows = torch.empty((size, flat.numel()), dtype=flat.dtype)
    pg.allgather([list(rows.unbind(0))], [flat]).wait()
    reducer(rows[0], rows[1], out=flat)
    for row in rows[2:]:
        reducer(flat, row, out=flat)


def _on_contiguous(tensor: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> None:
    """Run ``fn`` on a flat view of ``tensor`` (or of a contiguous copy, written back afterwards)."""
    if tensor.is_contiguous():
        fn(tensor.view(-1))
    else:
        flat = tensor.contiguous().view(-1)
        fn(flat)
        tensor.copy_(flat.view(tensor.shape))


def _loopback_or_host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
