"""Where collectives keep memory, on real Ray workers: outputs reused once dropped (never while held),
and private tensors read and written by the peers through the kernel, by default; private tensors
reduced again moved into shared memory with ``share_reduced_tensors``; each off by its setting."""

from __future__ import annotations

import sys

import pytest
import ray.cloudpickle

from hvdray.collective.transport import shm

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

MB = 1 << 20
#: the module's shared executors (tests/conftest.py), one per setting it checks
EXECUTORS = {
    "default": (2, {"timeout_s": 60}),
    "sharing reduced tensors": (2, {"timeout_s": 60, "share_reduced_tensors": True}),
    "pool and cross memory off": (2, {"timeout_s": 60, "output_pool_mb": 0, "cross_memory_attach": False}),
}


def _memory_use(steps: int) -> dict:
    """A training-loop shape: the same buffers reduced in place and out of place, a sharded optimizer's
    gradients reduce-scattered, outputs kept for a while (a list of the last few) and then dropped,
    allgathers of a large shard."""
    import torch

    import hvdray.torch as hvd
    from hvdray.collective import session

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    n = 2 * MB  # floats: 8 MB
    bucket = torch.full((n,), float(rank + 1))
    grads = torch.full((n,), float(rank + 1))
    # one row per rank: rank r's rows hold r + 1 + the row's index, so each rank's shard has its own sum
    sharded = torch.arange(size, dtype=torch.float32).repeat_interleave(n // size).view(size, -1) + rank + 1
    want = float(size * (size + 1) // 2)
    kept, wrong = [], []
    for step in range(steps):
        bucket.fill_(rank + 1)
        hvd.allreduce_(bucket, op=hvd.Sum, name="bucket")
        out = hvd.allreduce(grads, op=hvd.Sum, name="grads")
        gathered = hvd.allgather(torch.full((MB // 4, 4), float(step)), name="shard")
        shard = hvd.reducescatter(sharded, op=hvd.Sum, name="sharded")
        if shard.shape != (1, n // size) or not bool((shard == want + size * rank).all()):
            wrong.append(("shard", step))
        kept.append((step, out, gathered))
        if len(kept) > 3:
            kept.pop(0)
        for s, o, g in kept:  # outputs still held are never handed out again
            if not (bool((o == want).all()) and bool((g == s).all()) and g.shape == (size * MB // 4, 4)):
                wrong.append(step)
        if float(bucket[0]) != want or not bool((bucket == want).all()):
            wrong.append(("bucket", step))
    engine = session._session.engine
    node = engine.comm._node
    return {
        "wrong": wrong,
        "reused": engine.outputs.reused,
        "bucket shared": bucket.is_shared(),
        "grads shared": grads.is_shared(),
        "grads kept": bool((grads == rank + 1).all()),
        "sharded shared": sharded.is_shared(),
        "adopted": node.adoption.adopted if node is not None else None,
        "cross memory": node.cross_memory.usable if node is not None and node.cross_memory is not None else None,
    }


@pytest.mark.shared_executor("default")
def test_outputs_reused_and_tensors_left_private_by_default(shared_executor):
    for result in shared_executor.run(_memory_use, args=[8]):
        assert result["wrong"] == []
        assert result["reused"] >= 8  # from the second step on, both outputs come back warm
        assert not result["bucket shared"] and not result["grads shared"] and result["grads kept"]
        assert not result["sharded shared"]
        assert result["adopted"] in (0, None)
        # Ray's workers run as one user; the kernel here lets them read each other's memory
        assert result["cross memory"] is (True if shm.unsupported_reason() is None else None)


@pytest.mark.skipif(shm.unsupported_reason() is not None, reason=str(shm.unsupported_reason()))
@pytest.mark.shared_executor("sharing reduced tensors")
def test_tensors_reduced_again_move_into_shared_memory_when_asked(shared_executor):
    for result in shared_executor.run(_memory_use, args=[8]):
        assert result["wrong"] == []
        assert result["reused"] >= 8
        assert result["bucket shared"] and result["grads shared"] and result["grads kept"]
        assert result["sharded shared"]
        assert result["adopted"] == 3


@pytest.mark.shared_executor("pool and cross memory off")
def test_the_pool_and_the_cross_memory_way_off_by_their_settings(shared_executor):
    for result in shared_executor.run(_memory_use, args=[4]):
        assert result["wrong"] == []
        assert result["reused"] == 0
        assert not result["bucket shared"] and not result["grads shared"] and not result["sharded shared"]
        assert result["adopted"] in (0, None)
        assert result["cross memory"] is None


def _outputs_outlive_nothing(named: bool) -> dict:
    """Out-of-place outputs dropped by the caller, blocking and through a handle, named or not (an unnamed call
    runs on its family's slot once the family is known): does anything in hvdray still hold them, and does the
    next op of the size get the same block back?"""
    import weakref

    import torch

    import hvdray.torch as hvd

    hvd.init()
    tensor = torch.ones(MB)  # 4 MB: a block of the pool, in shared memory where the ranks share it
    held, addresses = [], set()
    for step in range(8):
        if step % 2:
            out = hvd.allreduce(tensor, op=hvd.Sum, name="dropped" if named else None)
        else:
            out = hvd.synchronize(hvd.allreduce_async(tensor, op=hvd.Sum, name="dropped.async" if named else None))
        addresses.add(out.data_ptr())
        ref = weakref.ref(out)
        del out
        held.append(ref() is not None)  # no gc.collect(): a reference cycle would keep it as well
    return {"held": held, "addresses": len(addresses)}


@pytest.mark.shared_executor("default")
@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_an_output_the_caller_dropped_is_held_by_nothing(shared_executor, named):
    """The engine lets go of an op once it has run: an output kept until the next op would make the pool
    hand out a second block, colder, for every other op of a size (an unnamed call's was kept so until
    2026-12-06: its op cost a third more at 4 MB). Also under a starving load since 2026-12-08: the engine
    thread held an op's requests for a moment after it opened their handles, and with other processes spinning
    beside the ranks an op now and then found its output still referenced as it returned (tests/unit/
    test_single_process.py stalls the opening thread on purpose)."""
    for result in shared_executor.run(_outputs_outlive_nothing, args=[named]):
        assert result["held"] == [False] * 8
        assert result["addresses"] == 1
