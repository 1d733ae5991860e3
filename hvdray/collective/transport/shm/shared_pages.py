"""Private tensors whose memory pages move into shared memory where they lie (``share_reduced_pages``).

An in-place allreduce of a private tensor must copy the parts its peers reduce somewhere they can read
(the slots, a scratch block) or go through the kernel a page at a time; a tensor in shared memory needs
neither (``shared_tensors.py``), but moving it there with torch's ``share_memory_()`` gives it new
memory: an alias taken before (``tensor.numpy()``) keeps the old, and torch crashes when such a tensor
grows. :class:`SharedPages` moves the pages instead, and leaves every address as it was: the second
time an in-place allreduce reduces the same storage, the whole pages inside the tensor are copied into a
``memfd`` and that file is mapped over them at the same addresses (``mmap`` with ``MAP_FIXED``). The
tensor, its views and every alias see the same bytes at the same place; torch still owns and frees the
memory as before (a resize or a free unmaps the pages with the rest). The local peers map the file
through ``/proc/<pid>/fd`` as they map torch's shared storages (:class:`PeerTensors`).

Only whole pages move: the bytes before the tensor's first page boundary and after its last one (the
head and the tail, less than a page each) share their pages with whatever the allocator put beside the
tensor, which other threads may write at any time. They stay private; the op that reduces such tensors
(:func:`~hvdray.collective.transport.shm.shared_tensors.allreduce_shared_pages`) carries them through
the slots.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
from collections import OrderedDict
from typing import Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hvdray.collective.transport.shm.parts import memmove
from hvdray.collective.transport.shm.segment import PAGE_BYTES, PagesPlace
from hvdray.collective.transport.shm.shared_storage import ADOPT_MIN_BYTES, RELEASE_CHECK_S, RecentStorages

log = logging.getLogger(__name__)

#: how many storages keep their moved pages' files open (least recently reduced first out): a loop over more
#: large tensors than this moves each again at every second reduction (a copy), and the peers map it anew
SHARED_PAGES_KEPT = 64

_MAP_FIXED = 0x10  # Linux; Python's mmap module does not export it
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Libc:
    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    def map(self, fd: int, length: int, at: Optional[int] = None) -> int:
        """Map ``fd`` shared and read-write, populated, anywhere or over the pages at ``at``."""
        flags = mmap.MAP_SHARED | _MAP_POPULATE | (0 if at is None else _MAP_FIXED)
        address = self.mmap(at, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if address is None or address == _MAP_FAILED or (at is not None and address != at):
            error = ctypes.get_errno()
            raise OSError(error, f"mmap of {length} bytes failed: {os.strerror(error)}")
        return address


class SharedPages:
    """This process's tensors whose whole pages it moved into shared memory, by address (module
    docstring), used by the node's ops (one thread). A tensor qualifies when it is its whole storage,
    allocated by torch, not in shared memory already, of :data:`ADOPT_MIN_BYTES` or more, and reduced a
    second time while its storage lives; :meth:`place` moves it then. Before every later use it must be
    the same storage at the same address, its first whole page still a file's (a storage that was resized,
    or freed and its address reused, is not); a file is closed when its storage is gone or when more than :data:`SHARED_PAGES_KEPT` are kept.
    Any failure leaves the tensor private."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.moved = 0  # tensors whose pages moved (for tests and benchmarks)
        self._libc = _Libc() if enabled else None
        self._kept: OrderedDict[int, tuple[StorageWeakRef, PagesPlace]] = OrderedDict()  # by the tensor's address
        self._recent = RecentStorages()
        self._next_check = 0.0
        self._pagemap: Optional[int] = None  # /proc/self/pagemap, opened at the first check (-1: unreadable)

    def place(self, flat: torch.Tensor) -> Optional[PagesPlace]:
        """Where ``flat``'s whole pages live in shared memory, after moving them there if this is its storage's
        second reduction; None while it stays private."""
        if not self.enabled or not self._qualifies(flat):
            return None
        address = flat.data_ptr()
        storage = StorageWeakRef(flat.untyped_storage())
        kept = self._kept.get(address)
        if kept is not None:
            held, place = kept
            if held == storage and not held.expired() and self._file_page_at(address + place.head):
                self._kept.move_to_end(address)
                return place
            self._close(address)
        self._close_gone()
        if not self._recent.seen_before(flat):
            return None
        try:
            place = self._move(flat)
        except OSError as exc:
            log.debug("the pages of a %d-byte tensor stay private: %s", flat.numel() * flat.element_size(), exc)
            return None
        self._kept[address] = (storage, place)
        self.moved += 1
        while len(self._kept) > SHARED_PAGES_KEPT:
            self._close(next(iter(self._kept)))
        return place

    @staticmethod
    def _qualifies(flat: torch.Tensor) -> bool:
        nbytes = flat.numel() * flat.element_size()
        storage = flat.untyped_storage()
        return (
            nbytes >= ADOPT_MIN_BYTES and storage.nbytes() == nbytes and storage.data_ptr() == flat.data_ptr()
            and storage.resizable()  # torch allocated it (not numpy's, DLPack's or a buffer's memory)
            and not storage.is_shared()
        )

    def _move(self, flat: torch.Tensor) -> PagesPlace:
        """Copy ``flat``'s whole pages into a new file and map it over them; the file's place."""
        assert self._libc is not None
        address, nbytes = flat.data_ptr(), flat.numel() * flat.element_size()
        head = -address % PAGE_BYTES
        length = PagesPlace(0, 0, 0, head, nbytes).interior
        fd = os.memfd_create("hvdray-tensor-pages", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, length)
            staging = self._libc.map(fd, length)
            try:
                memmove(staging, address + head, length)
            finally:
                self._libc.munmap(staging, length)
            self._libc.map(fd, length, at=address + head)
            return PagesPlace(os.getpid(), fd, os.fstat(fd).st_ino, head, nbytes)
        except BaseException:
            os.close(fd)
            raise

    def close_gone_now_and_then(self) -> None:
        """After an op, while files are kept: close those whose storage is gone, at most once per
        :data:`RELEASE_CHECK_S`, so that a freed tensor's memory goes back soon (its peers drop their
        mappings within as long) even when no other tensor is reduced."""
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + RELEASE_CHECK_S
            self._close_gone()

    def _close_gone(self) -> None:
        for gone in [address for address, (held, _) in self._kept.items() if held.expired()]:
            self._close(gone)

    def _close(self, address: int) -> None:
        _, place = self._kept.pop(address)
        os.close(place.fd)

    def _file_page_at(self, at: int) -> bool:
        """Whether the page at ``at`` is a present page of a file (Linux's ``/proc/self/pagemap``: bits 63 and
        61), as the moved pages are and fresh private memory is not: what tells a tensor whose storage got new
        memory at the same address (resized twice, say) from the moved one, without touching the memory a
        caller may be reading. Where pagemap cannot be read, the storage and its address alone tell."""
        if self._pagemap is None:
            try:
                self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._pagemap = -1
        if self._pagemap < 0:
            return True
        entry = int.from_bytes(os.pread(self._pagemap, 8, at // PAGE_BYTES * 8), "little")
        return bool(entry >> 63 & 1 and entry >> 61 & 1)

    def clear(self) -> None:
        """Close every file (moved pages stay where they are, in the tensors that hold them)."""
        for address in list(self._kept):
            self._close(address)
        if self._pagemap is not None and self._pagemap >= 0:
            os.close(self._pagemap)
        self._pagemap = None

    def __len__(self) -> int:
        return len(self._kept)
