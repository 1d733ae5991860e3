"""The collectives' output pool: large outputs reuse the memory of dropped ones, never of live ones."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import pytest
import torch

from hvdray.collective.output_pool import IDLE_BLOCKS_PER_SIZE, MIN_BYTES, SHARED_MIN_BYTES, OutputPool

MB = 1 << 20


def test_small_outputs_are_plain_tensors():
    pool = OutputPool(64 * MB)
    t = pool.empty((10, 3), torch.float32)
    assert t.shape == (10, 3) and t.dtype == torch.float32 and t.untyped_storage().resizable()
    t.resize_(100)  # a plain torch.empty tensor
    assert pool.idle_bytes == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.complex64, torch.uint8])
def test_a_dropped_output_is_handed_out_again_with_its_shape_and_dtype(dtype):
    pool = OutputPool(64 * MB)
    shape = (MIN_BYTES // dtype.itemsize // 4, 4)
    first = pool.empty(shape, dtype)
    assert first.shape == shape and first.dtype == dtype and first.is_contiguous()
    assert first.data_ptr() % 64 == 0
    address = first.data_ptr()
    del first
    second = pool.empty(shape, dtype)
    assert second.data_ptr() == address and pool.reused == 1
    other_shape = pool.empty((shape[0] * shape[1],), dtype)  # same bytes, another shape: a fresh block
    assert other_shape.shape == (shape[0] * shape[1],) and other_shape.data_ptr() != address


@pytest.mark.parametrize("dtype,shape", [
    (torch.uint8, (MIN_BYTES,)),
    (torch.float32, (MIN_BYTES // 16, 4)),  # shaped and typed by numpy
    (torch.bfloat16, (MIN_BYTES // 8, 4)),  # numpy has no bfloat16: shaped and typed by torch
])
def test_memory_still_seen_through_a_view_is_never_handed_out(dtype, shape):
    pool = OutputPool(64 * MB)
    out = pool.empty(shape, dtype)
    out.fill_(7)
    view = out[10:20]
    address = out.data_ptr()
    del out
    gc.collect()
    again = pool.empty(shape, dtype)
    assert again.data_ptr() != address and pool.reused == 0
    again.fill_(1)
    assert bool((view == 7).all())
    del view
    third = pool.empty(shape, dtype)  # the view was the last holder: now its block is back
    assert third.data_ptr() == address and pool.reused == 1


def test_idle_blocks_are_bounded_per_size_and_in_all_oldest_size_first():
    pool = OutputPool(5 * MB)
    outs = [pool.empty((MB,), torch.uint8) for _ in range(IDLE_BLOCKS_PER_SIZE + 2)]
    del outs
    assert pool.idle_bytes == IDLE_BLOCKS_PER_SIZE * MB == 2 * MB
    big = [pool.empty((2 * MB,), torch.uint8) for _ in range(2)]
    del big  # 2 x 1 MiB + 2 x 2 MiB > 5 MiB: a 1 MiB block, of the size freed longest ago, goes
    assert pool.idle_bytes == 5 * MB
    again = [pool.empty((2 * MB,), torch.uint8), pool.empty((2 * MB,), torch.uint8), pool.empty((MB,), torch.uint8)]
    assert pool.reused == 3 and pool.idle_bytes == 0
    del again
    huge = pool.empty((8 * MB,), torch.uint8)  # larger than the whole limit: never kept
    del huge
    assert pool.idle_bytes == 5 * MB


def test_a_zero_limit_or_a_closed_pool_keeps_nothing():
    off = OutputPool(0)
    t = off.empty((2 * MB,), torch.uint8)
    assert t.untyped_storage().resizable()  # plain torch.empty
    pool = OutputPool(64 * MB)
    out = pool.empty((2 * MB,), torch.uint8)
    pool.close()
    del out
    assert pool.idle_bytes == 0
    assert pool.empty((2 * MB,), torch.uint8).untyped_storage().resizable()


def test_outputs_dropped_on_other_threads_come_back_safely():
    pool = OutputPool(64 * MB)
    outs = [pool.empty((MB,), torch.float32) for _ in range(8)]
    barrier = threading.Barrier(4)

    def drop(chunk):
        barrier.wait()
        chunk.clear()

    threads = [threading.Thread(target=drop, args=(outs[i::4],)) for i in range(4)]
    del outs
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.idle_bytes == IDLE_BLOCKS_PER_SIZE * 4 * MB
    live = [pool.empty((MB,), torch.float32) for _ in range(3)]
    assert len({t.data_ptr() for t in live}) == 3 and pool.reused == IDLE_BLOCKS_PER_SIZE


def test_pooled_outputs_behave_like_tensors_except_growing():
    pool = OutputPool(64 * MB)
    out = pool.empty((MB // 4,), torch.float32).fill_(2.0)
    assert float(out.sum()) == 2.0 * (MB // 4)
    out.share_memory_()  # moves to shared memory like any tensor
    assert out.is_shared() and float(out.sum()) == 2.0 * (MB // 4)
    grown = pool.empty((MB // 4,), torch.float32)
    with pytest.raises(RuntimeError, match="not resizable"):
        grown.resize_(MB)


def test_a_size_whose_blocks_are_all_out_does_not_stop_the_oldest_first_dropping():
    pool = OutputPool(3 * MB)
    small = [pool.empty((MB,), torch.uint8) for _ in range(2)]
    del small
    taken = [pool.empty((MB,), torch.uint8) for _ in range(2)]  # every idle 1 MiB block is out again
    big = [pool.empty((2 * MB,), torch.uint8) for _ in range(2)]
    del big  # 2 x 2 MiB > 3 MiB: one is dropped, past the 1 MiB size that has nothing idle
    assert pool.idle_bytes == 2 * MB
    del taken
    assert pool.idle_bytes <= 3 * MB


def test_a_shared_pool_hands_out_shared_memory_registered_while_it_lives(monkeypatch):
    """With ``shared=True`` (the node's ranks share memory) an output of SHARED_MIN_BYTES or more lies in
    torch shared memory that the transport finds (``shared_place``) and the node's peers can map; its
    block stays registered while the output or the pool holds it and is forgotten when dropped for good
    or when the pool closes. Smaller outputs, outputs while /dev/shm has no room, and a pool with
    ``shared=False`` are private."""
    from hvdray.collective.transport.shm import shared_storage
    from hvdray.collective.transport.shm.shared_storage import SHARED_BLOCKS, shared_place

    size = SHARED_MIN_BYTES
    pool = OutputPool(4 * size, shared=True)
    assert shared_place(pool.empty((size // 8,), torch.float32)) is None  # below SHARED_MIN_BYTES
    out = pool.empty((size // 4,), torch.float32)
    place = shared_place(out)
    assert place is not None and place.nbytes == size and len(SHARED_BLOCKS) == 1
    assert shared_place(out[1:]) is None  # only a tensor that starts the block
    assert os.path.exists(f"/proc/{place.pid}/fd/{place.fd}")  # a descriptor a peer can open
    address = out.data_ptr()
    del out
    gc.collect()
    again = pool.empty((size // 8,), torch.float64)  # the same block, warm, still registered
    assert again.data_ptr() == address and shared_place(again) is not None
    others = [pool.empty((size,), torch.uint8) for _ in range(IDLE_BLOCKS_PER_SIZE + 1)]
    assert len(SHARED_BLOCKS) == IDLE_BLOCKS_PER_SIZE + 2
    del others, again
    gc.collect()
    assert len(SHARED_BLOCKS) == IDLE_BLOCKS_PER_SIZE  # the block not kept went back, unregistered
    pool.close()
    assert len(SHARED_BLOCKS) == 0

    monkeypatch.setattr(shared_storage, "SHM_HEADROOM_BYTES", 1 << 60)  # no room left in /dev/shm
    full = OutputPool(4 * size, shared=True).empty((size,), torch.uint8)
    private = OutputPool(4 * size).empty((size,), torch.uint8)
    assert shared_place(full) is None and shared_place(private) is None and len(SHARED_BLOCKS) == 0


def test_bfloat16_outputs_while_numpy_knows_a_bfloat16_of_its_own():
    # TensorFlow's ml_dtypes gives numpy a bfloat16 (any module that imports TensorFlow does it), which
    # torch.from_numpy does not take: the pool keeps shaping bfloat16 outputs through torch. In a fresh
    # interpreter, so that ml_dtypes is in before the pool's first bfloat16 output.
    pytest.importorskip("ml_dtypes")
    code = (
        "import ml_dtypes, numpy, torch\n"
        "from hvdray.collective.output_pool import MIN_BYTES, OutputPool\n"
        "assert numpy.dtype('bfloat16') == ml_dtypes.bfloat16\n"
        "out = OutputPool(64 << 20).empty((MIN_BYTES // 8, 4), torch.bfloat16)\n"
        "assert out.dtype == torch.bfloat16 and out.shape == (MIN_BYTES // 8, 4)\n"
        "out.fill_(1.5)\n"
        "assert float(out.sum()) == 1.5 * out.numel()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_outputs_alive_at_exit_end_the_interpreter_quietly():
    # a lease that outlives the interpreter gives nothing back (its pool may be half torn down by then): no
    # "Exception ignored" on stderr, exit code 0, for 1-D and shaped outputs, private and in shared memory
    code = (
        "import torch\n"
        "from hvdray.collective.output_pool import MIN_BYTES, SHARED_MIN_BYTES, OutputPool\n"
        "pool, shared = OutputPool(256 << 20), OutputPool(256 << 20, shared=True)\n"
        "flat = pool.empty((MIN_BYTES // 4,), torch.float32)\n"
        "rows = pool.empty((MIN_BYTES // 64, 16), torch.float32)\n"
        "big = shared.empty((SHARED_MIN_BYTES // 4,), torch.float32)\n"
        "assert flat.shape == (MIN_BYTES // 4,) and rows.shape == (MIN_BYTES // 64, 16) and rows.is_contiguous()\n"
        "dropped = pool.empty((MIN_BYTES // 4,), torch.float32)\n"
        "del dropped\n"
        "assert pool.idle_bytes == MIN_BYTES\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr[-2000:]
