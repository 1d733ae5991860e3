"""Private tensors whose memory pages move into shared memory where they lie (``share_reduced_pages``).

An allreduce of a private tensor must copy the parts its peers reduce somewhere they can read (the
slots, a scratch block) or go through the kernel a page at a time; a tensor in shared memory needs
neither (``shared_tensors.py``), but moving it there with torch's ``share_memory_()`` gives it new
memory: an alias taken before keeps the old, and torch crashes when such a tensor grows. Here the pages
move instead, and every address stays as it was: the second time an allreduce (or a reducescatter)
reduces the same storage, the whole pages inside the tensor are copied into a ``memfd`` and that file
is mapped over them at the same addresses (``mmap`` with ``MAP_FIXED``). The tensor, its views and
every raw alias see the same bytes at the same place. The local peers map the file through
``/proc/<pid>/fd`` as they map torch's shared storages (:class:`PeerTensors`).

Only whole pages move: the bytes before the tensor's first page boundary and after its last one (the
head and the tail, less than a page each) share their pages with whatever the allocator put beside the
tensor, which other threads may write at any time. They stay private; the ops that reduce such tensors
(:func:`~hvdray.collective.transport.shm.pages_collectives.allreduce_shared_pages`) carry them through
the slots.

Moved pages must never go back to the allocator shared: a chunk of glibc's heap that stayed a file's
would be shared with every process forked later, which would then corrupt this one's heap. So this
process keeps a reference to every moved storage (:data:`MOVED_PAGES`) and marks it unresizable (as
``tensor.numpy()`` does: growing it would free the moved pages); once that reference is the last, it
maps private memory back over the pages and only then lets torch free the storage.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from typing import Optional

import torch

from hvdray.collective.transport.shm.parts import memmove
from hvdray.collective.transport.shm.segment import PAGE_BYTES, PagesPlace
from hvdray.collective.transport.shm.shared_storage import ADOPT_MIN_BYTES, RELEASE_CHECK_S, RecentStorages

log = logging.getLogger(__name__)

#: how many storages this process keeps moved at most: more are left private (a moved storage is
#: given back only once its tensor is gone, so none is dropped to make room)
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
        """Map ``fd`` shared and read-write (private anonymous memory where ``fd`` is -1), populated, anywhere
        or over the pages at ``at``."""
        flags = (mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if fd < 0 else (mmap.MAP_SHARED | _MAP_POPULATE)
        flags |= 0 if at is None else _MAP_FIXED
        address = self.mmap(at, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if address is None or address == _MAP_FAILED or (at is not None and address != at):
            error = ctypes.get_errno()
            raise OSError(error, f"mmap of {length} bytes failed: {os.strerror(error)}")
        return address


class MovedPages:
    """Every storage whose whole pages this process moved into a file, by the tensor's address, with the
    file's place; thread-safe. Each stays held (and unresizable) until the reference kept here is its
    last: then a daemon thread, looking every :data:`RELEASE_CHECK_S` while any is kept, maps private
    memory back over its pages, closes its file and lets torch free it (module docstring)."""

    def __init__(self) -> None:
        self._libc = _Libc()
        self._lock = threading.Lock()
        self._moved: dict[int, tuple[torch.UntypedStorage, PagesPlace]] = {}
        self._sweeper: Optional[threading.Thread] = None
        self._pagemap: Optional[int] = None  # /proc/self/pagemap, opened at the first check (-1: unreadable)

    def place(self, flat: torch.Tensor) -> Optional[PagesPlace]:
        """Where ``flat``'s whole pages lie, if this process moved them and they still do; else None."""
        address = flat.data_ptr()
        with self._lock:
            entry = self._moved.get(address)
            if entry is None:
                return None
            held, place = entry
            nbytes = flat.numel() * flat.element_size()
            if held._cdata != flat.untyped_storage()._cdata or place.nbytes != nbytes:
                return None  # another tensor over part of the moved one's memory (a view): not this way
            if held.data_ptr() != address or not self._file_page_at(address + place.head):
                self._forget(address, "its storage got other memory")
                return None
            return place

    def move(self, flat: torch.Tensor) -> Optional[PagesPlace]:
        """Move the whole pages of ``flat`` (its storage's whole memory, allocated by torch) into a new file;
        its place, or None while :data:`SHARED_PAGES_KEPT` are kept or the kernel refuses."""
        address, nbytes = flat.data_ptr(), flat.numel() * flat.element_size()
        head = -address % PAGE_BYTES
        length = PagesPlace(0, 0, 0, 0, head, nbytes).interior
        with self._lock:
            if len(self._moved) >= SHARED_PAGES_KEPT:
                return None
            try:
                fd = os.memfd_create("hvdray-tensor-pages", os.MFD_CLOEXEC)
            except OSError as exc:
                log.debug("the pages of a %d-byte tensor stay private: %s", nbytes, exc)
                return None
            try:
                os.ftruncate(fd, length)
                staging = self._libc.map(fd, length)
                try:
                    memmove(staging, address + head, length)
                finally:
                    self._libc.munmap(staging, length)
                self._libc.map(fd, length, at=address + head)
                info = os.fstat(fd)
                place = PagesPlace(os.getpid(), fd, info.st_dev, info.st_ino, head, nbytes)
            except OSError as exc:
                os.close(fd)
                log.debug("the pages of a %d-byte tensor stay private: %s", nbytes, exc)
                return None
            flat.detach().view(torch.uint8).numpy()  # the storage cannot grow now (growing would free these pages)
            self._moved[address] = (flat.untyped_storage(), place)
            if self._sweeper is None:
                self._sweeper = threading.Thread(target=self._sweep, name="hvdray-moved-pages", daemon=True)
                self._sweeper.start()
            return place

    def __len__(self) -> int:
        return len(self._moved)

    def release_unheld(self) -> None:
        """Give back every storage whose only holder is this registry (module docstring)."""
        with self._lock:
            for address, (held, place) in list(self._moved.items()):
                if torch._C._storage_Use_Count(held._cdata) > 1:
                    continue
                if held.data_ptr() == address:
                    try:
                        self._libc.map(-1, place.interior, at=address + place.head)
                    except OSError:  # the pages stay the file's: keep the storage, so they never reach the heap
                        log.warning("cannot give a %d-byte tensor's moved pages back; its memory stays held",
                                    place.nbytes)
                        continue
                self._forget(address)

    def _sweep(self) -> None:
        while True:
            time.sleep(RELEASE_CHECK_S)
            self.release_unheld()
            with self._lock:
                if not self._moved:
                    self._sweeper = None
                    return

    def _forget(self, address: int, why: Optional[str] = None) -> None:
        """Drop the entry at ``address`` and close its file (the lock held)."""
        held, place = self._moved.pop(address)
        if why is not None:
            log.warning("a %d-byte tensor whose pages hvdray moved into shared memory: %s (torch's share_memory_(), "
                        "say); its old pages went back to the allocator shared", place.nbytes, why)
        os.close(place.fd)
        del held

    def _file_page_at(self, at: int) -> bool:
        """Whether the page at ``at`` is a present page of a file (Linux's ``/proc/self/pagemap``: bits 63 and
        61), as the moved pages are and fresh private memory is not, read without touching the memory a
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


    def _after_fork_in_child(self) -> None:
        """A forked child holds its copies of the storages (their pages shared with the parent) until it exits:
        no sweeper runs there, and the lock starts free."""
        self._lock = threading.Lock()
        self._sweeper = None


#: this process's moved storages (one address space, one registry)
MOVED_PAGES = MovedPages()
os.register_at_fork(after_in_child=MOVED_PAGES._after_fork_in_child)


class SharedPages:
    """One node group's use of :data:`MOVED_PAGES` (module docstring), by its ops' thread: a tensor qualifies
    when it is its whole storage, allocated by torch, not in shared memory already, of
    :data:`ADOPT_MIN_BYTES` or more, and reduced a second time while its storage lives; :meth:`place`
    moves it then."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.moved = 0  # tensors whose pages this group moved (for tests and benchmarks)
        self._recent = RecentStorages()

    def place(self, flat: torch.Tensor) -> Optional[PagesPlace]:
        """Where ``flat``'s whole pages live in shared memory, after moving them there if this is its storage's
        second reduction; None while it stays private."""
        if not self.enabled or flat.numel() * flat.element_size() < ADOPT_MIN_BYTES:
            return None
        place = MOVED_PAGES.place(flat)
        if place is not None or not self._qualifies(flat) or not self._recent.seen_before(flat):
            return place
        place = MOVED_PAGES.move(flat)
        self.moved += place is not None
        return place

    @staticmethod
    def _qualifies(flat: torch.Tensor) -> bool:
        nbytes = flat.numel() * flat.element_size()
        storage = flat.untyped_storage()
        return (
            storage.nbytes() == nbytes and storage.data_ptr() == flat.data_ptr() and not storage.is_shared()
            and storage.resizable()  # torch allocated it (not numpy's, DLPack's or a buffer's memory), nobody pinned it
            and not flat.is_conj() and not flat.is_neg()
        )
