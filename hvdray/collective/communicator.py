"""A private Gloo process group and the blocking primitives the engine builds on.

The group is built on a store handed in by the caller (the coordinator's rendezvous in a job, an
in-memory store for a single process). ``torch.distributed.init_process_group`` is never called, so
a user's own ``torch.distributed`` code keeps working beside hvdray.
"""

from __future__ import annotations

import datetime
import logging
import socket
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo, ReduceOp

log = logging.getLogger(__name__)

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

    def close(self) -> None:
        """Drop the process group; pending peers see a closed connection. Safe to call twice."""
        if self._pg is None:
            return
        try:
            self._pg.abort()
        except Exception:  # noqa: BLE001 - abort may be unsupported or already done; nothing to recover
            log.debug("gloo abort failed", exc_info=True)
        self._pg = None

    # -- primitives ------------------------------------------------------------------------
    def allgather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order (two Gloo calls: lengths, then padded bytes)."""
        length = torch.tensor([len(payload)], dtype=torch.int64)
        lengths = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
        self._pg.allgather([lengths], [length]).wait()
        sizes = [int(t.item()) for t in lengths]
        longest = max(sizes)
        if longest == 0:
            return [b""] * self.size
        mine = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        outs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self._pg.allgather([outs], [mine]).wait()
        return [bytes(o[:n].numpy().tobytes()) for o, n in zip(outs, sizes)]

    def and_flags(self, flags: torch.Tensor) -> None:
        """Bitwise-AND a uint8 flag vector across ranks, in place: the engine's control traffic."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = ReduceOp.BAND
        self._pg.allreduce([flags], opts).wait()

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp.RedOpType) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self._pg.allreduce([tensor], opts).wait()

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Equal-shaped allgather; returns one tensor per rank."""
        outs = [torch.empty_like(tensor) for _ in range(self.size)]
        self._pg.allgather([outs], [tensor]).wait()
        return outs

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        self._pg.broadcast([tensor], opts).wait()

    def alltoall(
        self, output: torch.Tensor, tensor: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int]
    ) -> None:
        self._pg.alltoall_base(output, tensor, list(output_splits), list(input_splits), dist.AllToAllOptions()).wait()

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp.RedOpType) -> None:
        """``tensor`` holds ``size`` equal chunks along dim 0; rank r receives the reduced chunk r."""
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = op
        self._pg._reduce_scatter_base(output, tensor, opts).wait()


def _loopback_or_host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
