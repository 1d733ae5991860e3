"""Allreduces of private tensors that read and write the local peers' memory through the kernel.

Linux copies between two processes' memory in one system call (cross-memory attach:
``process_vm_readv`` and ``process_vm_writev``), for a process allowed to trace the other: the same
user, and Yama's ``ptrace_scope`` 0 (or a process with ``CAP_SYS_PTRACE``). Through the segment, a
rank must first copy the parts of its tensor that its peers reduce into shared memory and copy the
peers' sums back out of it: two passes over memory that the allreduce's own work (add the peers'
parts into its own, copy the peers' sums into its tensor) does not need. Through the kernel a rank
reads its part of each peer's tensor straight into a small buffer that stays in its core's cache, adds
it into its own tensor (or its output), and writes each block of the sum straight into every peer's
tensor: what the memory ideal counts, and no more.

The ranks find out whether the kernel lets them at the first allreduce that may go this way
(:meth:`NodeCollectives._cross_memory_ready`, one round among the local ranks): each reads a few
bytes of every peer's mapping of the segment, and they keep to shared memory unless every rank could.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch

from hvdray.collective.transport.reductions import block_operands, finish_block
from hvdray.collective.transport.shm.barrier import NodeBarrier
from hvdray.collective.transport.shm.parts import REDUCE_BLOCK_BYTES, part_bounds
from hvdray.collective.transport.shm.segment import PeerAddresses, SharedMemoryError, check_published_sizes

if TYPE_CHECKING:
    from hvdray.collective.transport.shm.node import NodeCollectives
    from hvdray.collective.transport.strategy import Finish


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


class CrossMemory:
    """One rank's access to its local peers' memory: ``process_vm_readv``/``process_vm_writev`` on raw
    addresses, the peers' process ids, a block-sized buffer for the reads, and whether every local rank
    may use it (``usable``: None until the ranks have checked together)."""

    def __init__(self, barrier: NodeBarrier) -> None:
        self._barrier = barrier  # names a dead or departed peer when a read or write fails
        libc = ctypes.CDLL(None, use_errno=True)
        # None where the C library lacks them (glibc has them since 2.15): the check then says no
        self._readv = getattr(libc, "process_vm_readv", None)
        self._writev = getattr(libc, "process_vm_writev", None)
        for call in (self._readv, self._writev):
            if call is not None:
                call.restype = ctypes.c_ssize_t
                call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                                 ctypes.c_ulong]
        self._local, self._remote = _IoVec(), _IoVec()
        self._local_at, self._remote_at = ctypes.addressof(self._local), ctypes.addressof(self._remote)
        self.usable: Optional[bool] = None
        #: local rank -> process id (this rank's own included), known from the ranks' check on
        self.pids: list[int] = []
        self._buffers: dict[torch.dtype, torch.Tensor] = {}  # one block, viewed as each dtype asked for

    def refusal(self, rank: int, address: int, expected: bytes) -> Optional[str]:
        """Why this rank cannot read ``expected`` (bytes it sees in shared memory too) at ``address`` of local
        rank ``rank`` through the kernel; None when it can."""
        if self._readv is None or self._writev is None:
            return "the C library has no process_vm_readv/process_vm_writev"
        probe = ctypes.create_string_buffer(len(expected))
        try:
            self.read(rank, ctypes.addressof(probe), address, len(expected))
        except SharedMemoryError as exc:
            return str(exc)
        return None if probe.raw == expected else "the bytes read differ from the shared memory they were read from"

    def read(self, rank: int, into: int, at: int, nbytes: int) -> None:
        """Copy ``nbytes`` from address ``at`` of local rank ``rank`` to ``into`` in this process."""
        self._move(self._readv, rank, into, at, nbytes, "read from")

    def write(self, rank: int, at: int, source: int, nbytes: int) -> None:
        """Copy ``nbytes`` from ``source`` in this process to address ``at`` of local rank ``rank``."""
        self._move(self._writev, rank, source, at, nbytes, "write to")

    def _move(self, call: Callable[..., int], rank: int, local: int, remote: int, nbytes: int, what: str) -> None:
        pid = self.pids[rank]
        self._local.base, self._local.length = local, nbytes
        self._remote.base, self._remote.length = remote, nbytes
        moved = call(pid, self._local_at, 1, self._remote_at, 1, 0)
        if moved != nbytes:
            error = ctypes.get_errno() if moved < 0 else 0
            self._barrier.check_peer(rank, exited=error == errno.ESRCH)  # no such process, or its memory is gone
            reason = os.strerror(error) if error else f"{moved} of {nbytes} bytes moved"
            raise SharedMemoryError(f"the kernel refused a cross-memory {what} local rank {rank} (pid {pid}): {reason}")

    def buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """A block of :data:`REDUCE_BLOCK_BYTES` as a 1-D tensor of ``dtype``, what the peers' parts are read into."""
        buffer = self._buffers.get(dtype)
        if buffer is None:
            block = next(iter(self._buffers.values()), None)
            if block is None:
                block = torch.empty(REDUCE_BLOCK_BYTES, dtype=torch.uint8)
            buffer = self._buffers[dtype] = block.view(dtype)
        return buffer


def allreduce_cross_memory(
    node: "NodeCollectives", out: torch.Tensor, source: torch.Tensor, addresses: list[PeerAddresses],
    pieces: list[tuple[int, int]], reducer: Callable[..., torch.Tensor], finish: Optional["Finish"],
) -> None:
    """After every local rank published where its ``source`` and ``out`` are (``addresses``, in local-rank
    order) and passed the op's first barrier: each rank reduces its part of every piece block by block,
    its own data first and then each peer's (read into the cache-sized buffer) in rank order, into ``out``
    (``finish`` on each block while in the core's cache), then writes the block into every peer's output.
    A rank touches only its own part of the peers' tensors, reading each block there before writing it,
    so a rank in place and its peers in place or out of place do not interfere. The parts and the order of
    the sum are the slots' (pieces of a slot, this rank's data first, then the peers' in rank order), so the
    results are the same bit for bit. The last barrier: every output is whole, and no peer still reads or
    writes this rank's tensors."""
    memory = node.cross_memory
    assert memory is not None
    me, size, isz = node.local_rank, node.local_size, out.element_size()
    check_published_sizes(addresses, me, out.numel() * isz)
    peers = [(rank, published) for rank, published in enumerate(addresses) if rank != me]
    buffer = memory.buffer(out.dtype)
    into, out_at, step = buffer.data_ptr(), out.data_ptr(), buffer.numel()
    reduce, (out, source, buffer) = block_operands(reducer, [out, source, buffer])
    with np.errstate(all="ignore"):
        for start, stop in pieces:
            bounds = part_bounds(stop - start, size, isz)
            for a in range(start + bounds[me], start + bounds[me + 1], step):
                b = min(a + step, start + bounds[me + 1])
                length, offset = (b - a) * isz, a * isz
                acc, first = out[a:b], source[a:b]
                for rank, published in peers:
                    memory.read(rank, into, published.source + offset, length)
                    reduce(first, buffer[: b - a], out=acc)
                    first = acc
                if finish is not None:
                    finish_block(finish, acc)
                for rank, published in peers:
                    memory.write(rank, published.output + offset, out_at + offset, length)
    node.barrier.wait()
