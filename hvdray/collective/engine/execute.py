"""Running planned actions on the communicator: fused and lone allreduces and every other op.

The executor settles each request's handle with its result (the engine opens it once it holds nothing of the op)
and, while a timeline records, writes each op's phases.
It calls the communicator through ``comm`` at every op (a test may replace one of its primitives).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from hvdray.collective.transport import Communicator
from hvdray.collective.transport.reductions import Scale
from hvdray.collective.engine.cache import RankDescs
from hvdray.collective.engine.fusion import Action, FusionPlanner
from hvdray.collective.engine.handle import Request
from hvdray.collective.errors import HvdrayError
from hvdray.collective.output_pool import OutputPool
from hvdray.collective.protocol import OpDesc, OpKind, ReduceOp
from hvdray.collective.timeline import Timeline
from hvdray.collective.topology import reducescatter_rows


@dataclass
class EngineStats:
    """Counters a test or a benchmark can read: rounds, ops, and fused Gloo calls."""

    rounds: int = 0
    full_rounds: int = 0
    ops: int = 0
    allreduce_calls: int = 0
    fused_tensors: int = 0
    wakeups: int = 0  # times the engine thread woke up (notified or timed out) while waiting for work
    caller_ticks: int = 0  # ticks a waiting caller ran on its own thread while the engine thread slept


class Executor:
    """Runs one rank's actions (engine thread only)."""

    def __init__(self, comm: Communicator, planner: FusionPlanner, stats: EngineStats, outputs: OutputPool) -> None:
        self.comm = comm
        self._outputs = outputs
        self._size = comm.size
        self._rank = comm.rank
        self._planner = planner
        self._stats = stats
        self.tick_bytes = 0  # bytes reduced in this tick (autotune's score)
        self._timeline: Optional[Timeline] = None
        self._pid = 0
        self._ready_at = 0.0

    def start_tick(self, timeline: Optional[Timeline], pid: int) -> Optional[float]:
        """The timeline this tick's ops are traced in (if any) under trace process ``pid``; returns the
        time the tick's ops became ready, when tracing."""
        self._timeline, self._pid = timeline, pid
        if timeline is not None:
            self._ready_at = time.perf_counter()
            return self._ready_at
        return None

    # -- allreduce -----------------------------------------------------------------------------
    def allreduce(self, action: Action, requests: list[Optional[Request]]) -> None:
        """One allreduce for the action's tensors: alone in its output, or fused (a joined rank, which has
        no request, contributes zeros)."""
        desc = action.descs[0]
        comm = self.comm
        timeline = self._timeline
        t_start = time.perf_counter() if timeline is not None else 0.0
        if len(requests) == 1:
            req = requests[0]
            src = req.tensor if req is not None else torch.zeros(desc.shape, dtype=desc.dtype)
            buf = req.output if req is not None and req.output.is_contiguous() else torch.empty_like(src)
            if buf is not src and desc.prescale == 1.0:
                # out of place: the transport reads the input and writes the output (no copy between them)
                t_copied = time.perf_counter() if timeline is not None else 0.0
                comm.allreduce_into(src, buf, desc.reduce_op, self._finish(desc))
            else:
                if buf is not src:
                    buf.copy_(src)
                t_copied = time.perf_counter() if timeline is not None else 0.0
                self._reduce(buf, desc)
            t_reduced = time.perf_counter() if timeline is not None else 0.0
            self.tick_bytes += buf.numel() * buf.element_size()
            if req is not None and buf is not req.output:
                req.output.copy_(buf)
        elif action.nbytes <= comm.fused_message_bytes and desc.prescale == 1.0:
            # the transport copies the tensors straight in and the results straight out: no staging. A
            # joined rank takes this way too, with zeros (every rank must: the transport scales each
            # rank's reduced part before the peers copy it)
            t_copied = t_start
            inputs = [req.tensor if req is not None else torch.zeros(d.shape, dtype=d.dtype)
                      for req, d in zip(requests, action.descs)]
            outputs = [req.output if req is not None else torch.empty_like(t) for req, t in zip(requests, inputs)]
            if action.shapes is None:  # the same every time a cached plan runs: its descriptions fixed them
                action.shapes = tuple(t.shape for t in inputs)
            comm.allreduce_tensors(  # the scale runs on the reduced data, before it is copied out
                inputs, outputs, desc.reduce_op, self._finish(desc), shapes=action.shapes,
            )
            t_reduced = time.perf_counter() if timeline is not None else 0.0
            self.tick_bytes += action.nbytes
            self._stats.fused_tensors += len(requests)
        else:
            views = self._planner.staging_views(action)
            # one C++ call copies every tensor in and one copies every result out (a Python loop of
            # copies costs ~10 us a tensor); a joined rank contributes zeros
            if all(req is not None for req in requests):
                torch._foreach_copy_(views, [req.tensor for req in requests])
            else:
                for view, req in zip(views, requests):
                    if req is None:
                        view.zero_()
                    else:
                        view.copy_(req.tensor)
            t_copied = time.perf_counter() if timeline is not None else 0.0
            self._reduce(action.flat, desc)
            t_reduced = time.perf_counter() if timeline is not None else 0.0
            self.tick_bytes += action.flat.numel() * action.flat.element_size()
            self._stats.fused_tensors += len(requests)
            done = [(req.output, view) for req, view in zip(requests, views) if req is not None]
            if done:  # a joined rank has no output to copy into
                torch._foreach_copy_([out for out, _ in done], [view for _, view in done])
        present = [req for req in requests if req is not None]
        if timeline is not None:
            t_done = time.perf_counter()
            fused = {"tensors": len(requests), "bytes": action.nbytes}
            for req in present:
                row = self._trace_op(timeline, req, OpKind.ALLREDUCE, t_start, t_done)
                timeline.phase(self._pid, row, "MEMCPY_IN_FUSION_BUFFER", t_start, t_copied)
                timeline.phase(self._pid, row, "REDUCE", t_copied, t_reduced, fused)
                timeline.phase(self._pid, row, "MEMCPY_OUT_FUSION_BUFFER", t_reduced, t_done)
        self._stats.allreduce_calls += 1
        self._stats.ops += len(requests)
        for req in present:
            req.handle._settle(req.result)

    def _reduce(self, buf: torch.Tensor, desc: OpDesc) -> None:
        if desc.prescale != 1.0:
            buf.mul_(desc.prescale)
        self.comm.allreduce(buf, desc.reduce_op, self._finish(desc))

    def _finish(self, desc: OpDesc) -> Optional[Scale]:
        """Averaging's division and the postscale factor of ``desc``'s op, for the transport to run on an
        allreduce's reduced data (on each rank's part before the peers copy it, where it can); None if none."""
        average = desc.reduce_op is ReduceOp.AVERAGE
        return Scale(self._size, average, desc.postscale) if average or desc.postscale != 1.0 else None

    # -- every other op ------------------------------------------------------------------------
    def run_one(self, action: Action, request: Request) -> None:
        """A broadcast, allgather, alltoall, reducescatter or barrier, whose request every rank has."""
        desc = action.descs[0]
        kind = desc.kind
        t_start = time.perf_counter() if self._timeline is not None else 0.0
        if kind is OpKind.BARRIER:
            result = None
        elif kind is OpKind.BROADCAST:
            result = self._broadcast(request, desc)
        elif kind is OpKind.ALLGATHER:
            result = self._allgather(request, action.rank_descs)
        elif kind is OpKind.ALLTOALL:
            result = self._alltoall(request, action.rank_descs)
        elif kind is OpKind.REDUCESCATTER:
            result = self._reducescatter(request, desc)
        else:
            raise HvdrayError(f"unknown op {kind!r} for {desc.name!r}")
        self._stats.ops += 1
        timeline = self._timeline
        if timeline is not None:
            self._trace_op(timeline, request, kind, t_start, time.perf_counter())
        request.handle._settle(result)

    def _broadcast(self, request: Request, desc: OpDesc) -> torch.Tensor:
        out = request.output
        buf = out if out.is_contiguous() else torch.empty_like(out)
        if buf is not request.tensor:
            buf.copy_(request.tensor)
        self.comm.broadcast(buf, desc.root)
        if buf is not out:
            out.copy_(buf)
        return request.result

    def _allgather(self, request: Request, descs: RankDescs) -> torch.Tensor:
        tensor = request.tensor.contiguous()
        rows = [descs[r].shape[0] for r in range(self._size)]
        longest = max(rows)
        if all(n == longest for n in rows):  # gathered straight into the result
            out = self._outputs.empty((self._size * longest, *tensor.shape[1:]), tensor.dtype)
            self.comm.allgather_into(tensor, out.view(self._size, *tensor.shape))
            return out
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        return torch.cat([p[:n] for p, n in zip(self.comm.allgather(padded), rows)])

    def _alltoall(self, request: Request, descs: RankDescs) -> tuple[torch.Tensor, torch.Tensor]:
        tensor = request.tensor.contiguous()
        size = self._size
        splits_of = [descs[r].splits or [descs[r].shape[0] // size] * size for r in range(size)]
        send = splits_of[self._rank]
        recv = [splits_of[r][self._rank] for r in range(size)]
        output = tensor.new_empty((sum(recv), *tensor.shape[1:]))
        self.comm.alltoall(output, tensor, recv, send)
        return output, torch.tensor(recv, dtype=torch.int32)

    def _reducescatter(self, request: Request, desc: OpDesc) -> torch.Tensor:
        """The transport reduces ``size`` equal chunks: rows that split evenly go as the caller's tensor
        (read, never written), others padded to the first ranks' count of rows (and a prescale applied)
        in a copy; outputs come from the pool (warm pages, as an allgather's)."""
        tensor = request.tensor
        rows = reducescatter_rows(tensor.shape[0], self._size)
        most, rest, outputs = rows[0], tensor.shape[1:], self._outputs
        if rows[-1] == most and desc.prescale == 1.0 and tensor.is_contiguous():
            chunks = tensor
        else:
            chunks = outputs.empty((most * self._size, *rest), tensor.dtype)
            offset = 0
            for r, n in enumerate(rows):
                chunks[r * most : r * most + n] = tensor[offset : offset + n]
                chunks[r * most + n : (r + 1) * most] = 0
                offset += n
            if desc.prescale != 1.0:
                chunks.mul_(desc.prescale)
        out = outputs.empty((most, *rest), tensor.dtype)
        self.comm.reduce_scatter(out, chunks, desc.reduce_op)
        if rows[self._rank] != most:
            out = out[: rows[self._rank]]
        scale = self._finish(desc)
        if scale is not None:
            scale([out])
        return out

    def _trace_op(self, timeline: Timeline, request: Request, kind: OpKind, started: float, done: float) -> str:
        """Horovod's events of one op on its tensor's row: ``NEGOTIATE_<OP>`` (submitted until ready
        everywhere), then ``<OP>`` (ready until done) holding ``QUEUE`` (ready until its work began).
        Returns the row, for the op's other activities."""
        row = Timeline.row_name(kind.value, request.name)
        op = kind.value.upper()
        ready = min(max(self._ready_at, request.submitted) or started, started)
        if request.submitted:
            timeline.phase(self._pid, row, f"NEGOTIATE_{op}", min(request.submitted, ready), ready)
        timeline.phase(self._pid, row, op, ready, done)
        timeline.phase(self._pid, row, "QUEUE", ready, started)
        return row

