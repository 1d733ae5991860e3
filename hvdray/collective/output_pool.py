"""Memory for the tensors that collectives return, used again once the caller has dropped them.

An out-of-place allreduce or an allgather returns a fresh tensor. glibc maps every allocation of a few
MiB and more freshly from the kernel (the dynamic mmap threshold stops at 32 MiB, and blocks below it
are trimmed back while a training loop alternates two of them), so the first write into each fresh
output faults in every page: on the development machine a copy into a fresh 64 MB tensor runs at about
1.7 GB/s against 7 GB/s into a warm one, and that first touch, not the reduction, was most of an
out-of-place collective's time.

:class:`OutputPool` hands out outputs of :data:`MIN_BYTES` and more on memory it keeps: each output's
storage holds a lease on a block (a numpy array, which torch's storage keeps alive exactly as long as
any tensor or view of it lives); when the last of them is gone the block returns to the pool and the
next output of the same size gets it back warm. At most :data:`IDLE_BLOCKS_PER_SIZE` blocks of each size
and ``idle_limit_bytes`` in all wait in the pool; beyond that the sizes freed longest ago go back to the
allocator first.

What differs from ``torch.empty``: such an output's storage cannot be resized (``resize_`` to a larger
size raises; ``share_memory_`` and everything else work).

Where the job's ranks on a node share memory (``shared=True``), blocks of :data:`SHARED_MIN_BYTES` and
more live in torch shared memory
(:class:`~hvdray.collective.transport.shm.shared_storage.SharedBlocks`), as long as ``/dev/shm`` has
room: an out-of-place allreduce then writes each rank's reduced part straight into its output, and the
peers copy it from there, one copy fewer than through the node's slots.
"""

from __future__ import annotations

import math
import sys
import threading
import weakref
from typing import Sequence, Union

import numpy as np
import torch

from hvdray.collective.transport.reductions import NUMPY_DTYPES
from hvdray.collective.transport.shm.shared_storage import SHARED_BLOCKS

#: outputs smaller than this come from torch.empty (glibc keeps small blocks warm by itself)
MIN_BYTES = 1 << 20
#: freed blocks of one size kept for the next outputs of that size (a loop alternates two outputs)
IDLE_BLOCKS_PER_SIZE = 2
#: the outputs' alignment (torch's own CPU allocator aligns to 64 bytes)
ALIGNMENT = 64
#: outputs of this size and more go in shared memory in a shared pool: each such block holds a file
#: descriptor, so that a peer can map it, and 4 MiB blocks keep a full pool to ~128 of them
SHARED_MIN_BYTES = 4 << 20


class OutputPool:
    """Collective outputs of :data:`MIN_BYTES` and more, on blocks used again once their tensors die."""

    def __init__(self, idle_limit_bytes: int, shared: bool = False) -> None:
        self.idle_limit_bytes = idle_limit_bytes
        self.shared = shared  # blocks in shared memory where there is room (see the module's notes)
        self._lock = threading.RLock()  # a lease may end (and give its block back) inside empty()
        self._idle: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        #: each live output's lease, by the id of the weak reference that watches it (kept here, so that its
        #: callback runs): the reference and the lease's block
        self._leases: dict[int, tuple[weakref.ref, np.ndarray]] = {}
        self.reused = 0  # outputs handed out on a block used before (for tests and benchmarks)

    def empty(self, shape: Union[torch.Size, Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous CPU tensor, like ``torch.empty(shape, dtype=dtype)``."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_BYTES or self.idle_limit_bytes <= 0:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            blocks = self._idle.get(nbytes)
            block = blocks.pop() if blocks else None
            if block is not None:
                if not blocks:  # only sizes with idle blocks stay listed (the oldest-first dropping takes one)
                    del self._idle[nbytes]
                self._idle_bytes -= nbytes
                self.reused += 1
        if block is None and self.shared and nbytes >= SHARED_MIN_BYTES:
            block = SHARED_BLOCKS.allocate(nbytes)  # page-aligned
        if block is None:
            raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
            start = -raw.ctypes.data % ALIGNMENT
            block = raw[start : start + nbytes]
        # a view of its own, whose life is the output storage's: numpy's, shaped and typed, where numpy has
        # the dtype (a torch view costs tens of microseconds with the cache cold after a large op, and so does
        # each numpy call: a 1-D output's typed view has its shape already)
        as_numpy = NUMPY_DTYPES.get(dtype)
        if as_numpy is None:
            lease = block[:]
        else:
            lease = block.view(as_numpy)
            if len(shape) != 1:
                lease = lease.reshape(shape)
        # a weak reference whose callback gives the block back: lighter than weakref.finalize (about 7 us less
        # an output on the development machine, warm or cold)
        watch = weakref.ref(lease, self._lease_ended)
        self._leases[id(watch)] = (watch, block)
        if as_numpy is None:
            return torch.from_numpy(lease).view(dtype).view(shape)
        return torch.from_numpy(lease)

    def empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous output shaped and typed like ``tensor``."""
        return self.empty(tensor.shape, tensor.dtype)

    def _lease_ended(self, watch: weakref.ref) -> None:
        entry = self._leases.pop(id(watch), None)
        if entry is not None and not sys.is_finalizing():  # an output that outlives the interpreter gives nothing back
            self._give_back(entry[1])

    def _give_back(self, block: np.ndarray) -> None:
        nbytes = block.nbytes
        with self._lock:
            if nbytes > self.idle_limit_bytes:
                SHARED_BLOCKS.release(block)
                return
            blocks = self._idle.pop(nbytes, [])
            self._idle[nbytes] = blocks  # the most recently freed size last
            if len(blocks) >= IDLE_BLOCKS_PER_SIZE:
                SHARED_BLOCKS.release(block)
                return
            blocks.append(block)
            self._idle_bytes += nbytes
            while self._idle_bytes > self.idle_limit_bytes:  # the sizes freed longest ago go first
                oldest = next(iter(self._idle))
                dropped = self._idle[oldest].pop(0)
                SHARED_BLOCKS.release(dropped)
                self._idle_bytes -= dropped.nbytes
                if not self._idle[oldest]:
                    del self._idle[oldest]

    @property
    def idle_bytes(self) -> int:
        """Bytes of freed outputs waiting to be handed out again."""
        return self._idle_bytes

    def close(self) -> None:
        """Give every idle block back to the allocator and keep none from now on (outputs still alive
        are not affected; their blocks go back to the allocator when they die)."""
        with self._lock:
            self.idle_limit_bytes = 0
            for blocks in self._idle.values():
                for block in blocks:
                    SHARED_BLOCKS.release(block)
            self._idle.clear()
            self._idle_bytes = 0
