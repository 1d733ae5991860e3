"""Worker-side checks of the collectives against numpy, shared by the shared-memory and hierarchical
tests. They run inside Ray workers (sent by value) and return what failed, so that one ``ex.run``
covers every dtype, op and size; and a rank's place in its job, shared by the executor's tests."""

from __future__ import annotations

import os

DTYPES = ["float32", "float64", "float16", "bfloat16", "uint8", "int8", "int32", "int64", "bool"]
OPS = ["sum", "average", "min", "max", "product"]
#: element counts: tiny, odd, and (with shm_buffer_mb=1) larger than a slot, so several rounds
SIZES = [1, 3, 1001, 70001]


def init():
    import torch

    import hvdray.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    return hvd


def rank_and_size():
    """This rank's (rank, size, local rank, local size, cross rank, cross size), after ``hvd.init()``."""
    import hvdray.torch as hvd

    hvd.init()
    return hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()


def transport():
    from hvdray.collective import session

    return session.engine().comm.transport


def job_files():
    from hvdray.collective import session
    from hvdray.collective.transport import shm

    tag = shm.job_tag(session.job_secret())
    return tag, [f for f in os.listdir(shm.SHM_DIR) if tag in f]


def mapped_segments():
    """This process's mappings of hvdray segments, as /proc/self/maps shows them."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split(None, 5)[5].strip() for line in maps if "/dev/shm/hvdray-" in line})


def data(rank, dtype, n, op):
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


def expected(size, dtype, n, op):
    import numpy as np
    import torch

    stack = np.stack([data(r, dtype, n, op).double().numpy() for r in range(size)])
    if dtype == "bool":
        return {"sum": np.any, "min": np.all, "max": np.any}[op](stack, axis=0)
    out = {"sum": np.sum, "average": np.sum, "min": np.min, "max": np.max, "product": np.prod}[op](stack, axis=0)
    if op == "average":
        out = out / size if dtype.startswith(("float", "bfloat")) else np.trunc(out / size)  # toward zero, as Horovod
    return torch.from_numpy(np.asarray(out)).to(getattr(torch, dtype)).double().numpy()


def every_dtype_op_and_size():
    import numpy as np

    hvd = init()
    ops = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}
    failures = []
    handles = []
    for dtype in DTYPES:
        for op in ["sum", "min", "max"] if dtype == "bool" else OPS:
            for n in SIZES:
                name = f"shm.{dtype}.{op}.{n}"
                handles.append((name, dtype, op, n, hvd.allreduce_async(data(hvd.rank(), dtype, n, op), name=name, op=ops[op])))
    for name, dtype, op, n, handle in handles:  # submitted together: fused batches go through shm too
        got = hvd.synchronize(handle).double().numpy()
        want = expected(hvd.size(), dtype, n, op)
        rtol = {"float16": 1e-2, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}.get(dtype)
        close = np.array_equal(got, want) if rtol is None else np.allclose(got, want, rtol=rtol, atol=0)
        if not close:
            failures.append(name)
    # tensors in torch shared memory, at an offset in their storage, reduced in place one at a time
    # (alone, so that they are not fused): over shared memory the local ranks read each other's tensors
    for dtype, op in [("float32", "average"), ("int64", "sum"), ("int32", "max"), ("float64", "min")]:
        n = 100_003
        storage = data(hvd.rank(), dtype, n + 5, op).share_memory_()
        tensor = storage[5:]
        tensor.copy_(data(hvd.rank(), dtype, n, op))
        hvd.allreduce_(tensor, name=f"shared.{dtype}.{op}", op=ops[op])
        if not np.allclose(tensor.double().numpy(), expected(hvd.size(), dtype, n, op), rtol=1e-6, atol=0):
            failures.append(f"shared.{dtype}.{op}.{n}")
    return transport(), failures


def gather_and_broadcast():
    import torch

    hvd = init()
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


