"""How a node's data area and a message divide between the local ranks, and the raw copy they share.

The data area holds two halves of one slot per local rank (:func:`slot_bytes_for`); a message reduced
through the slots splits into one part per rank, each starting on a cache line (:func:`part_bounds`).
"""

from __future__ import annotations

import ctypes

#: parts start on 64-byte boundaries (whole cache lines) where the piece is large enough
_ALIGN_BYTES = 64
#: allreduces up to this size take the one-barrier way (each rank reduces the whole message)
SMALL_ALLREDUCE_BYTES = 32 << 10
#: a rank reduces its part in blocks of this size, which stay in its core's cache (1 MiB of L2 per core on the
#: development machine) from the reduction to the copies that publish the sum
REDUCE_BLOCK_BYTES = 512 << 10


def slot_bytes_for(buffer_bytes: int, local_size: int) -> int:
    """Bytes per rank slot when a node's segment may use ``buffer_bytes`` for data (two halves)."""
    return max(4096, (buffer_bytes // (2 * local_size)) // 4096 * 4096)


def data_bytes_for(slot_bytes: int, local_size: int) -> int:
    """The data area of a node's segment whose ``local_size`` ranks have a slot of ``slot_bytes`` in each half."""
    return 2 * local_size * slot_bytes


def part_bounds(numel: int, parts: int, itemsize: int) -> list[int]:
    """``parts + 1`` offsets splitting ``numel`` elements as evenly as whole cache lines allow."""
    unit = max(1, _ALIGN_BYTES // itemsize)
    units = -(-numel // unit)
    base, extra = divmod(units, parts)
    bounds = [0]
    for p in range(parts):
        bounds.append(min(numel, bounds[-1] + (base + (1 if p < extra else 0)) * unit))
    return bounds


def memmove(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` between raw addresses: glibc's large-copy path beats a torch ``copy_``, and ctypes
    releases the GIL for it."""
    if nbytes > 0:
        ctypes.memmove(dst, src, nbytes)
