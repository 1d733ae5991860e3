"""Adasum: the pairwise operator's defining properties, and ``op=hvd.Adasum`` on real workers against a
numpy reference of the binary tree (2 and 3 workers: a power of two and not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hvdray.collective.transport.adasum import adasum_pair, adasum_tree


def _np_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot = float(a @ b)
    ca = 1 - dot / (2 * float(a @ a)) if a.any() else 1.0
    cb = 1 - dot / (2 * float(b @ b)) if b.any() else 1.0
    return ca * a + cb * b


def _np_tree(vectors: list[np.ndarray]) -> np.ndarray:
    level = list(vectors)
    while len(level) > 1:
        nxt = [_np_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = nxt + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def test_orthogonal_gradients_add():
    a, b = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, -2.0, 5.0])
    assert torch.allclose(adasum_pair(a, b), (a + b).double())


def test_identical_gradients_give_the_same_vector():
    a = torch.tensor([1.5, -2.0, 0.25, 4.0])
    assert torch.allclose(adasum_pair(a, a), a.double())
    assert torch.allclose(adasum_tree([a, a, a, a]), a.double())


def test_opposite_gradients_cancel_and_zero_is_neutral():
    a = torch.tensor([1.0, 2.0])
    assert torch.allclose(adasum_pair(a, -a), torch.zeros(2, dtype=torch.float64))
    assert torch.allclose(adasum_pair(torch.zeros(2), a), a.double())


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_tree_matches_numpy_reference(n):
    rng = np.random.default_rng(n)
    vectors = [rng.normal(size=7) for _ in range(n)]
    got = adasum_tree([torch.from_numpy(v) for v in vectors]).numpy()
    np.testing.assert_allclose(got, _np_tree(vectors), rtol=1e-12)


def _adasum_job():
    import numpy as np
    import torch

    import hvdray.torch as hvd

    hvd.init()
    rng = np.random.default_rng(100 + hvd.rank())
    mine = rng.normal(size=6).astype(np.float32)
    reduced = hvd.allreduce(torch.from_numpy(mine), name="ada", op=hvd.Adasum).numpy()
    # several Adasum tensors in flight at once are never fused into one buffer
    handles = [hvd.allreduce_async(torch.full((3,), float(hvd.rank() + 1)) * (i + 1), name=f"ada.{i}", op=hvd.Adasum)
               for i in range(3)]
    parallel = [hvd.synchronize(h).tolist() for h in handles]
    errors = []
    for bad in (lambda: hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum),
                lambda: hvd.reducescatter(torch.ones(4), op=hvd.Adasum)):
        try:
            bad()
        except ValueError as exc:
            errors.append((str(exc), isinstance(exc, RuntimeError)))
    return mine, reduced, parallel, errors


@pytest.mark.parametrize("workers", [2, 3])
def test_adasum_allreduce_on_workers_matches_reference(make_executor, workers):
    ex = make_executor(num_workers=workers)
    results = ex.run(_adasum_job)
    inputs = [r[0].astype(np.float64) for r in results]
    expected = _np_tree(inputs)
    for _, reduced, parallel, errors in results:
        np.testing.assert_allclose(reduced, expected, rtol=1e-5)
        for i, values in enumerate(parallel):
            # parallel vectors of different lengths: the tree keeps them parallel
            ref = _np_tree([np.full(3, float(r + 1)) * (i + 1) for r in range(workers)])
            np.testing.assert_allclose(values, ref, rtol=1e-5)
        assert len(errors) == 2 and "Adasum" in errors[0][0] and "int32" in errors[0][0]
        assert "adasum" in errors[1][0] and errors[1][1]  # reducescatter's is also Horovod's RuntimeError
