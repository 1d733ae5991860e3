"""``hvd.init()`` outside any executor is a working size-1 job (no Ray involved)."""

import _thread
import time
import types
import weakref

import pytest
import torch

import hvdray.torch as hvd


@pytest.fixture
def single():
    hvd.init()
    yield
    hvd.shutdown()


def test_size_one_job(single):
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()) == (
        0, 1, 0, 1, 0, 1,
    )
    assert hvd.is_initialized()
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(hvd.allreduce(x), x)
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum), x)
    assert torch.equal(hvd.allgather(x), x)
    assert torch.equal(hvd.broadcast(x, 0), x)
    out, splits = hvd.alltoall(x, splits=[2])
    assert torch.equal(out, x) and splits.tolist() == [2]
    assert torch.equal(hvd.reducescatter(x), x)
    assert hvd.broadcast_object({"a": 1}) == {"a": 1}
    assert hvd.allgather_object("x") == ["x"]
    hvd.barrier()
    assert hvd.join() == 0


def test_init_twice_is_a_no_op(single):
    hvd.init()
    assert hvd.size() == 1


def test_ops_before_init_say_to_call_init():
    hvd.shutdown()
    started = time.monotonic()
    for call in (lambda: hvd.rank(), lambda: hvd.allreduce(torch.ones(2)), lambda: hvd.barrier()):
        with pytest.raises(ValueError, match=r"call hvd\.init\(\)"):
            call()
    assert time.monotonic() - started < 1.0


def test_init_rejects_horovod_only_arguments():
    with pytest.raises(ValueError, match="comm"):
        hvd.init(comm=[0])


def test_reinit_after_shutdown_works():
    hvd.init()
    hvd.shutdown()
    hvd.init()
    assert hvd.allreduce(torch.ones(1)).item() == 1.0
    hvd.shutdown()


def test_a_name_still_in_flight_is_refused_and_the_first_op_survives(single):
    from hvdray.collective import session

    engine = session.engine()
    x = torch.ones(3)
    with engine._lock:  # the engine thread cannot take the first op to run it while the test holds this
        first = hvd.allreduce_async(x, name="twice", op=hvd.Sum)
        with pytest.raises(ValueError, match=r"op named 'twice' \(allreduce\) is still in flight on rank 0"):
            hvd.allreduce_async(torch.zeros(3), name="twice", op=hvd.Sum)
        with pytest.raises(ValueError, match=r"'twice' \(allreduce\) is still in flight"):
            hvd.broadcast_async(torch.zeros(3), 0, name="twice")
        group = hvd.grouped_allreduce_async([torch.ones(2), torch.ones(2)], name="pair")
        with pytest.raises(ValueError, match=r"'pair.0' \(allreduce\) is still in flight"):
            hvd.grouped_allreduce_async([torch.ones(2), torch.ones(2)], name="pair")
    assert torch.equal(hvd.synchronize(first), x)
    assert [t.tolist() for t in hvd.synchronize(group)] == [[1.0, 1.0], [1.0, 1.0]]
    assert torch.equal(hvd.allreduce(torch.zeros(3), name="twice"), torch.zeros(3))  # finished: free again


class _StallingLatch:
    """A handle's latch whose opener is descheduled right after it opens it, as on a starving machine."""

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()

    def acquire(self, *args, **kwargs) -> bool:
        return self._lock.acquire(*args, **kwargs)

    def release(self) -> None:
        self._lock.release()
        time.sleep(0.02)


def test_an_output_is_held_by_nothing_once_its_op_is_done_even_if_the_opening_thread_stalls(single, monkeypatch):
    """The caller may drop an out-of-place output the moment it sees its op done, and the pool must then have
    its block back for the next op of the size: whichever thread opened the handle (the engine's or a
    caller's tick) must hold nothing of the op by then, however long it stays descheduled after. Until
    2026-12-08 the engine thread still held the op's requests while it opened their handles."""
    from hvdray.collective.engine import handle

    monkeypatch.setattr(handle, "_thread", types.SimpleNamespace(allocate_lock=_StallingLatch))
    tensor = torch.ones(1 << 20)  # 4 MB: its outputs come from the pool

    def polled(handle: int) -> torch.Tensor:
        while not hvd.poll(handle):  # a poll never ticks on the caller's thread: the engine thread runs the op
            time.sleep(0.001)
        return hvd.synchronize(handle)

    calls = {
        "named": lambda: hvd.allreduce(tensor, op=hvd.Sum, name="dropped"),
        "named, polled": lambda: polled(hvd.allreduce_async(tensor, op=hvd.Sum, name="dropped.polled")),
        "unnamed": lambda: hvd.allreduce(tensor),
        "unnamed, polled": lambda: polled(hvd.allreduce_async(tensor)),
    }
    held = []
    for _ in range(4):
        for way, call in calls.items():
            out = call()
            ref = weakref.ref(out)
            del out
            if ref() is not None:  # no gc.collect(): a reference cycle would keep it as well
                held.append(way)
    assert held == []
