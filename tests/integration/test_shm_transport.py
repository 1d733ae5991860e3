"""The shared-memory transport on real Ray workers of one node: 1 to 5 local ranks, every dtype and op
against numpy (small and odd sizes, tensors larger than the segment, fused batches), allgather with
different first dims, broadcast from every root, the settings that turn it off, and that nothing is
left in /dev/shm after a shutdown or a killed worker."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

import pytest
import ray
import ray.cloudpickle

from hvdray import RayExecutor
from hvdray.collective.transport import shm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import collective_checks as checks  # noqa: E402 - shared with the multi-node test

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(checks)

pytestmark = pytest.mark.skipif(shm.unsupported_reason() is not None, reason=str(shm.unsupported_reason()))

def _settings(**kwargs):
    return RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=60, shm_buffer_mb=1, **kwargs)


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
    results = node_ex.run(checks.every_dtype_op_and_size)
    assert [transport for transport, _ in results] == ["gloo" if n == 1 else "shm"] * n
    assert [failures for _, failures in results] == [[]] * n


def test_allgather_with_different_first_dims_and_broadcast_from_every_root(node_ex):
    assert node_ex.run(checks.gather_and_broadcast) == [[]] * node_ex.num_workers


def test_segment_is_mapped_but_already_unlinked(node_ex):
    def where():
        checks.init()
        return checks.transport(), checks.mapped_segments(), checks.job_files()[1]

    for transport, mapped, files in node_ex.run(where):
        if transport == "shm":
            assert len(mapped) == 1 and mapped[0].endswith("(deleted)"), mapped
        assert files == []


def test_reinit_maps_a_fresh_segment_and_drops_the_old_one(node_ex):
    def cycle():
        import torch

        hvd = checks.init()
        first = checks.mapped_segments()
        hvd.shutdown()
        after_shutdown = checks.mapped_segments()
        hvd = checks.init()
        total = hvd.allreduce(torch.ones(3), name="after-reinit", op=hvd.Sum).tolist()
        return first, after_shutdown, checks.mapped_segments(), checks.job_files()[1], total

    n = node_ex.num_workers
    for first, after_shutdown, second, files, total in node_ex.run(cycle):
        assert after_shutdown == [] and files == [] and total == [float(n)] * 3
        if n > 1:
            assert len(first) == len(second) == 1 and first != second


def test_out_of_place_results_live_in_shared_memory_and_are_reduced_there(node_ex):
    """An out-of-place allreduce's or an allgather's result comes from the output pool, which on a node of
    several ranks places it in shared memory: every rank writes its reduced part (its tensor) straight
    into every rank's result (sums and averages, larger than the 1 MiB segment, again on the pool's warm
    blocks); a job of one rank keeps private memory."""

    def run():
        import torch

        from hvdray.collective.transport.shm.shared_storage import SHARED_BLOCKS, shared_place

        hvd = checks.init()
        n, r = hvd.size(), hvd.rank()
        values = (torch.arange(3 << 20) % 4096).float()  # 12 MiB; every sum exact in float32
        x, want = values * (r + 1), values * (n * (n + 1) // 2)
        ok = []
        for _ in range(2):  # the second on the block the first one's result gave back
            total = hvd.allreduce(x, name="sum", op=hvd.Sum)
            average = hvd.allreduce(x, name="average")
            gathered = hvd.allgather(x[: 1 << 20].view(-1, 1024), name="gather")  # 4 MiB from each rank
            ok.append(torch.equal(total, want) and torch.equal(average, want / n) and torch.equal(x, values * (r + 1))
                      and torch.equal(gathered.view(n, -1), torch.stack([values[: 1 << 20] * (k + 1) for k in range(n)])))
            shared = [shared_place(t) is not None for t in (total, average, gathered)]
            del total, average, gathered
        return checks.transport(), ok, shared, len(SHARED_BLOCKS)

    n = node_ex.num_workers
    for transport, ok, shared, blocks in node_ex.run(run):
        assert ok == [True, True]
        assert shared == [n > 1] * 3 and (blocks > 0) == (n > 1)


def test_a_tensor_reduced_again_in_place_is_reduced_in_its_own_pages(node_ex):
    """With the defaults, a private tensor that hvd.allreduce_ reduces again (12 MiB, larger than the 1 MiB
    segment) has its whole pages moved into shared memory where they lie: the same address, a numpy array
    on its memory sees every result, sums and averages stay exact, and every rank gets the same bits;
    freed, its file closes on every rank. A job of one rank keeps private memory."""

    def run():
        import gc
        import time

        import numpy as np
        import torch

        from hvdray.collective.transport.shm.shared_pages import MOVED_PAGES

        def files(inodes):  # descriptors of these files: this rank's own, and the peers' it maps
            found = 0
            for fd in os.listdir("/proc/self/fd"):
                try:
                    found += os.stat(f"/proc/self/fd/{fd}").st_ino in inodes and "memfd:hvdray-tensor-pages" in (
                        os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:
                    pass
            return found

        hvd = checks.init()
        n, r = hvd.size(), hvd.rank()
        values = (torch.arange(3 << 20) % 4096).float()
        x = values * (r + 1)
        address = x.data_ptr()
        ok = []
        for i in range(4):
            x.copy_(values * (r + 1))
            hvd.allreduce_(x, name="in place", op=hvd.Sum if i % 2 else hvd.Average)
            want = values * (n * (n + 1) // 2) / (1 if i % 2 else n)
            seen = torch.from_numpy(np.ctypeslib.as_array((ctypes.c_float * x.numel()).from_address(address)))
            ok.append(torch.equal(x, want) and x.data_ptr() == address and torch.equal(seen, want))
        y = torch.from_numpy(np.random.default_rng(r).standard_normal(3 << 20)).float()
        for _ in range(3):
            hvd.allreduce_(y, name="floats", op=hvd.Sum)
        place = MOVED_PAGES.place(x)
        inodes = set(hvd.allgather_object(place.inode if place is not None else None, name="inodes")) - {None}
        mapped = files(inodes)  # x's file on every rank
        del x, seen
        gc.collect()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # every rank alike: until x's file is gone from every rank
            gone = torch.tensor([float(files(inodes) == 0)])
            if hvd.allreduce(gone, name="gone", op=hvd.Min).item():
                break
            time.sleep(0.2)
        return checks.transport(), ok, len(inodes), mapped, files(inodes), y.numpy().tobytes()

    n = node_ex.num_workers
    results = node_ex.run(run)
    for transport, ok, moved, mapped, after, _ in results:
        assert ok == [True] * 4
        # every rank's x moved: each rank holds its own file and maps its peers'; once x is freed, its file and
        # every peer's mapping of it are closed within a second or two
        assert (moved, mapped, after) == ((n, n, 0) if transport == "shm" else (0, 0, 0))
    assert len({y for *_, y in results}) == 1


def test_one_op_in_place_on_rank_0_and_out_of_place_on_the_others(node_ex):
    """hvd.allreduce_ on rank 0 and hvd.allreduce on the others, the same op again and again (Horovod leaves
    in place or not to each rank) with 12 MiB tensors whose pages move after their second reduction: every
    rank gets the sums each time, and no rank writes into the others' inputs."""

    def run():
        import torch

        hvd = checks.init()
        n, r = hvd.size(), hvd.rank()
        values = (torch.arange(3 << 20) % 4096).float()
        x = torch.empty(3 << 20)
        ok = []
        for i in range(4):
            x.copy_(values * (r + 1 + i))
            got = hvd.allreduce_(x, name="mixed", op=hvd.Sum) if r == 0 else hvd.allreduce(x, name="mixed", op=hvd.Sum)
            want = values * sum(k + 1 + i for k in range(n))
            ok.append(torch.equal(got, want) and (r == 0 or torch.equal(x, values * (r + 1 + i))))
        return ok

    assert node_ex.run(run) == [[True] * 4] * node_ex.num_workers


def test_shm_transport_off_uses_gloo(make_executor):
    ex = make_executor(settings=_settings(shm_transport=False), num_workers=2, cpus_per_worker=0.5)

    def run():
        import torch

        hvd = checks.init()
        total = hvd.allreduce(torch.tensor([1.0 + hvd.rank()]), op=hvd.Sum).item()
        return checks.transport(), total, checks.mapped_segments()

    assert ex.run(run) == [("gloo", 3.0, [])] * 2


def test_a_job_off_shared_memory_connects_gloo_only_for_its_first_alltoall(make_executor):
    """Off shared memory (as across nodes) every collective but alltoall runs over the ranks' own
    connections, the transport setup too: the Gloo group (a full mesh) connects at the first alltoall, on
    every rank in the same op, and serves the alltoalls after it."""
    ex = make_executor(settings=_settings(shm_transport=False), num_workers=3, cpus_per_worker=0.5)

    def run():
        import torch

        from hvdray.collective import session

        hvd = checks.init()
        rank, size = hvd.rank(), hvd.size()
        group = session.engine().comm._pg
        sums = [hvd.allreduce(torch.full((n,), float(rank)), op=hvd.Sum, name=f"sum{n}")[0].item()
                for n in (3, 1 << 20)]
        gathered = hvd.allgather(torch.tensor([rank]), name="gather").tolist()
        root = hvd.broadcast(torch.tensor([rank]), root_rank=2, name="bcast").item()
        scattered = hvd.reducescatter(torch.ones(size, 2), op=hvd.Sum, name="scatter").tolist()
        before = group.connected
        # rank r sends r + 1 rows to each peer q, marked r * 10 + q
        rows = torch.cat([torch.full((rank + 1,), float(rank * 10 + q)) for q in range(size)])
        received = [hvd.alltoall(rows, splits=torch.tensor([rank + 1] * size), name=f"a2a{i}")[0].tolist()
                    for i in range(2)]
        return before, group.connected, sums, gathered, root, scattered, received

    for rank, (before, after, sums, gathered, root, scattered, received) in enumerate(ex.run(run)):
        assert (before, after) == (False, True), rank
        assert sums == [3.0, 3.0] and gathered == [0, 1, 2] and root == 2 and scattered == [[3.0, 3.0]]
        want = [float(q * 10 + rank) for q in range(3) for _ in range(q + 1)]
        assert received == [want, want], rank


GLOO_DTYPES = ["float32", "float64", "float16", "bfloat16", "uint8", "int8", "int32", "int64", "bool"]


def _gloo_inputs(rank: int, dtype: str, numel: int):
    import torch

    values = (torch.arange(numel) % 3 + rank) % (2 if dtype == "bool" else 1 << 30)
    return values.to(getattr(torch, dtype))


def test_gloo_transport_reduces_every_op_and_dtype_small_and_large(make_executor):
    """Off shared memory (as across nodes, shm_transport=False) over the ranks' own connections, among 4
    ranks: every size here is at most SOCKET_ALLREDUCE_BYTES, a recursive doubling (the sizes sit on
    each side of the thresholds of Gloo's own strategies, RECURSIVE_DOUBLING_BYTES and
    GATHER_REDUCE_BYTES, which apply with peer_sockets off); every dtype and op, against torch on the
    driver (the engine's own flag vector takes the recursive doubling on every tick)."""
    import torch

    from hvdray.collective.transport.gloo import GATHER_REDUCE_BYTES, RECURSIVE_DOUBLING_BYTES

    n = 4
    # a quarter CPU each: the module's 5-rank executor (2.5 CPUs of the 4) may still be up
    ex = make_executor(settings=_settings(shm_transport=False), num_workers=n, cpus_per_worker=0.25)
    ops = ["sum", "min", "max", "product"]
    cases = []
    for dtype in GLOO_DTYPES:
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        for numel in (5, RECURSIVE_DOUBLING_BYTES // itemsize + 1, GATHER_REDUCE_BYTES // (n * itemsize) + 1):
            for op in ops if dtype != "bool" else ["sum", "min", "max"]:
                cases.append((dtype, numel, op))

    def run(cases):
        hvd = checks.init()
        out = []
        for dtype, numel, op in cases:
            x = _gloo_inputs(hvd.rank(), dtype, numel)
            name = f"gloo.{dtype}.{numel}.{op}"
            out.append(hvd.allreduce(x, name=name, op={"sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max,
                                                        "product": hvd.Product}[op]))
        return checks.transport(), out

    reducers = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum, "product": torch.mul}
    for transport, results in ex.run(run, args=[cases]):
        assert transport == "gloo"
        for (dtype, numel, op), got in zip(cases, results):
            want = _gloo_inputs(0, dtype, numel)
            for rank in range(1, n):
                want = reducers[op](want, _gloo_inputs(rank, dtype, numel))
            assert got.dtype == want.dtype and torch.equal(got, want), (dtype, numel, op, got[:5], want[:5])

    # reducescatters over the ranks' own connections (peer_sockets): rows that do not split evenly
    # among the 4 (padded in a copy), one row of 1.2 MB per rank (the caller's tensor itself, in several
    # of the halving's pieces), every dtype and op it takes; the caller's tensor stays as it was
    from hvdray.collective.topology import reducescatter_rows

    scatters = [(dtype, shape, op) for dtype in GLOO_DTYPES if dtype != "bool"
                for shape in ((7, 3), (4, 300_001)) for op in ("sum", "min", "max")]

    def scatter(scatters):
        import torch

        hvd = checks.init()
        ops = {"sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max}
        results = []
        for dtype, shape, op in scatters:
            x = _gloo_inputs(hvd.rank(), dtype, shape[0] * shape[1]).view(shape)
            results.append(hvd.reducescatter(x, name=f"rs.{dtype}.{shape}.{op}", op=ops[op]))
            assert torch.equal(x, _gloo_inputs(hvd.rank(), dtype, shape[0] * shape[1]).view(shape))
        return results

    for rank, results in enumerate(ex.run(scatter, args=[scatters])):
        for (dtype, shape, op), got in zip(scatters, results):
            want = _gloo_inputs(0, dtype, shape[0] * shape[1])
            for other in range(1, n):
                want = reducers[op](want, _gloo_inputs(other, dtype, shape[0] * shape[1]))
            rows = reducescatter_rows(shape[0], n)
            want = want.view(shape)[sum(rows[:rank]):sum(rows[:rank + 1])]
            assert got.dtype == want.dtype and torch.equal(got, want), (rank, dtype, shape, op)


def test_nothing_left_in_dev_shm_after_shutdown_and_after_a_killed_worker(make_executor):
    ex = make_executor(settings=_settings(), num_workers=3, cpus_per_worker=0.5)

    def start():
        import torch

        hvd = checks.init()
        hvd.allreduce(torch.ones(10), name="warm")
        return checks.job_files()[0], os.getpid()

    tag, _ = ex.run(start)[0]

    def reduce_until_rank_two_dies():
        import torch

        hvd = checks.init()
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
