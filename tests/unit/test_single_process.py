"""``hvd.init()`` outside any executor is a working size-1 job (no Ray involved)."""

import time

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
