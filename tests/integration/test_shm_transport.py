"""The shared-memory transport on real Ray workers of one node: 1 to 5 local ranks, every dtype and op
against numpy (small and odd sizes, tensors larger than the segment, fused batches), allgather with
different first dims, broadcast from every root, the settings that turn it off, and that nothing is
left in /dev/shm after a shutdown or a killed worker."""

from __future__ import annotations

import os
import sys
import time

import pytest
import ray
import ray.cloudpickle

from hvdray import RayExecutor
from hvdray.collective import shm

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.skipif(shm.unsupported_reason() is not None, reason=str(shm.unsupported_reason()))

DTYPES = ["float32", "float64", "float16", "bfloat16", "uint8", "int8", "int32", "int64", "bool"]
OPS = ["sum", "average", "min", "max", "product"]
#: element counts: tiny, odd, and (with shm_buffer_mb=1) larger than a slot, so several rounds
SIZES = [1, 3, 1001, 70001]


def _settings(**kwargs):
    return RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=60, shm_buffer_mb=1, **kwargs)


def _init():
    import torch

    import hvdray.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    return hvd


def _transport():
    from hvdray.collective import context

    return context.engine().comm.transport


def _job_files():
    from hvdray.collective import context, shm

    tag = shm.job_tag(context.job_secret())
    return tag, [f for f in os.listdir(shm.SHM_DIR) if tag in f]


def _mapped_segments():
    """This process's mappings of hvdray segments, as /proc/self/maps shows them."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split(None, 5)[5].strip() for line in maps if "/dev/shm/hvdray-" in line})


def _data(rank, dtype, n, op):
    """A deterministic input: values small enough that sums and products of 5 ranks stay exact."""
    import numpy as np
    import torch

    rng = np.random.default_rng([rank, n, DTYPES.index(dtype), OPS.index(op)])
    if dtype == "bool":
        values = rng.random(n) < 0.5
    elif op == "product":
        values = rng.choice([-1, 1, 2], n) if dtype not in ("uint8",) else rng.choice([0, 1, 2], n)
    else:
        values = rng.integers(0 if dtype == "uint8" else -20, 21, n)
    return torch.from_numpy(np.asarray(values)).to(getattr(torch, dtype))


def _expected(size, dtype, n, op):
    import numpy as np
    import torch

    stack = np.stack([_data(r, dtype, n, op).double().numpy() for r in range(size)])
    if dtype == "bool":
        return {"sum": np.any, "min": np.all, "max": np.any}[op](stack, axis=0)
    out = {"sum": np.sum, "average": np.sum, "min": np.min, "max": np.max, "product": np.prod}[op](stack, axis=0)
    if op == "average":
        out = out / size if dtype.startswith(("float", "bfloat")) else np.floor_divide(out, size)
    return torch.from_numpy(np.asarray(out)).to(getattr(torch, dtype)).double().numpy()


def _every_dtype_op_and_size():
    import numpy as np

    hvd = _init()
    ops = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}
    failures = []
    handles = []
    for dtype in DTYPES:
        for op in ["sum", "min", "max"] if dtype == "bool" else OPS:
            for n in SIZES:
                name = f"shm.{dtype}.{op}.{n}"
                handles.append((name, dtype, op, n, hvd.allreduce_async(_data(hvd.rank(), dtype, n, op), name=name, op=ops[op])))
    for name, dtype, op, n, handle in handles:  # submitted together: fused batches go through shm too
        got = hvd.synchronize(handle).double().numpy()
        want = _expected(hvd.size(), dtype, n, op)
        rtol = {"float16": 1e-2, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}.get(dtype)
        close = np.array_equal(got, want) if rtol is None else np.allclose(got, want, rtol=rtol, atol=0)
        if not close:
            failures.append(name)
    return _transport(), failures


def _gather_and_broadcast():
    import torch

    hvd = _init()
    failures = []
    size, rank = hvd.size(), hvd.rank()
    for dtype in DTYPES:
        d = getattr(torch, dtype)
        mine = (torch.arange((rank + 1) * 3 * 5) % 7).to(d).reshape(-1, 5)  # first dims 3, 6, 9 ...
        got = hvd.allgather(mine, name=f"ag.{dtype}")
        want = torch.cat([(torch.arange((r + 1) * 3 * 5) % 7).to(d).reshape(-1, 5) for r in range(size)])
        if not torch.equal(got, want):
            failures.append(f"allgather {dtype}")
        for root in range(size):
            x = torch.full((40_001,), rank % 2, dtype=d) if dtype == "bool" else torch.full((40_001,), rank, dtype=d)
            got = hvd.broadcast(x, root_rank=root, name=f"bc.{dtype}.{root}")
            if not torch.equal(got, torch.full_like(x, root % 2 if dtype == "bool" else root)):
                failures.append(f"broadcast {dtype} from {root}")
    obj = hvd.broadcast_object({"rank": rank, "blob": b"x" * 5000}, root_rank=size - 1)
    if obj != {"rank": size - 1, "blob": b"x" * 5000}:
        failures.append("broadcast_object")
    return failures


@pytest.fixture(scope="module", params=[1, 2, 3, 4, 5], ids=lambda n: f"local{n}")
def node_ex(request, ray_local):
    """One executor per number of local ranks (half a CPU each, so 5 fit the 4-CPU test instance)."""
    executor = RayExecutor(_settings(), num_workers=request.param, cpus_per_worker=0.5)
    executor.start()
    try:
        yield executor
    finally:
        executor.shutdown()


def test_allreduce_every_dtype_op_and_size_matches_numpy(node_ex):
    n = node_ex.num_workers
    results = node_ex.run(_every_dtype_op_and_size)
    assert [transport for transport, _ in results] == ["gloo" if n == 1 else "shm"] * n
    assert [failures for _, failures in results] == [[]] * n


def test_allgather_with_different_first_dims_and_broadcast_from_every_root(node_ex):
    assert node_ex.run(_gather_and_broadcast) == [[]] * node_ex.num_workers


def test_segment_is_mapped_but_already_unlinked(node_ex):
    def where():
        _init()
        return _transport(), _mapped_segments(), _job_files()[1]

    for transport, mapped, files in node_ex.run(where):
        if transport == "shm":
            assert len(mapped) == 1 and mapped[0].endswith("(deleted)"), mapped
        assert files == []


def test_shm_transport_off_uses_gloo(make_executor):
    ex = make_executor(settings=_settings(shm_transport=False), num_workers=2, cpus_per_worker=0.5)

    def run():
        import torch

        hvd = _init()
        return _transport(), hvd.allreduce(torch.tensor([1.0 + hvd.rank()]), op=hvd.Sum).item(), _mapped_segments()

    assert ex.run(run) == [("gloo", 3.0, [])] * 2


def test_nothing_left_in_dev_shm_after_shutdown_and_after_a_killed_worker(make_executor):
    ex = make_executor(settings=_settings(), num_workers=3, cpus_per_worker=0.5)

    def start():
        import torch

        hvd = _init()
        hvd.allreduce(torch.ones(10), name="warm")
        return _job_files()[0], os.getpid()

    tag, _ = ex.run(start)[0]

    def reduce_until_rank_two_dies():
        import torch

        hvd = _init()
        started = time.monotonic()
        try:
            while time.monotonic() - started < 120:
                if hvd.rank() == 2 and time.monotonic() - started > 2:
                    os._exit(1)  # the process dies in the middle of the job, as a killed worker would
                hvd.allreduce(torch.ones(100_000), name="loop", op=hvd.Sum)
        except Exception as exc:  # noqa: BLE001 - the error is what this returns
            return type(exc).__name__, str(exc), time.monotonic() - started
        return "no error"

    refs = ex.run_remote(reduce_until_rank_two_dies)
    for ref in refs[:2]:
        kind, message, took = ray.get(ref, timeout=60)  # the survivors fail fast; they do not hang
        assert kind == "HorovodInternalError" and "local rank 2" in message, message
        assert took < 2 + 15  # timeout_s is 30: the death is seen by its pid, long before that
    assert _files_of(tag) == []
    ex.shutdown()
    assert _files_of(tag) == []


def _files_of(tag):
    return [f for f in os.listdir(shm.SHM_DIR) if tag in f]
