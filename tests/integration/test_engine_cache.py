"""The response cache on real workers: the steady state runs without full negotiation rounds, fusion
packs tensors into one Gloo call, and renegotiation on a changed shape (stalls of cached tensors: test_stall.py)."""

from __future__ import annotations

from hvdray import RayExecutor


def _steady_state(steps: int):
    import torch

    import hvdray.torch as hvd
    from hvdray.collective import session

    hvd.init()
    stats = session.engine().stats
    grads = [torch.full((256,), float(hvd.rank() + i)) for i in range(12)]
    before = (stats.rounds, stats.full_rounds, stats.allreduce_calls, stats.fused_tensors)
    for _ in range(steps):
        handles = [hvd.allreduce_async(g, name=f"grad.{i}", op=hvd.Sum) for i, g in enumerate(grads)]
        results = [hvd.synchronize(h) for h in handles]
    after = (stats.rounds, stats.full_rounds, stats.allreduce_calls, stats.fused_tensors)
    expected = [sum(r + i for r in range(hvd.size())) for i in range(12)]
    correct = all(torch.all(res == e).item() for res, e in zip(results, expected))
    return correct, [a - b for a, b in zip(after, before)]


def test_steady_state_needs_no_full_rounds_and_fuses(make_executor):
    ex = make_executor(num_workers=2)
    for correct, (rounds, full, calls, fused) in ex.run(_steady_state, args=[20]):
        assert correct
        assert rounds >= 20
        assert full <= 3  # the first step negotiates by name; afterwards only the flag vector travels
        assert calls < 12 * 20 / 2  # 12 tensors per step go out in far fewer Gloo calls
        assert fused >= 12 * 10


def test_without_cache_every_step_negotiates_by_name(make_executor):
    settings = RayExecutor.create_settings(timeout_s=20, cache_capacity=0)
    ex = make_executor(settings=settings, num_workers=2)
    for correct, (rounds, full, _, _) in ex.run(_steady_state, args=[10]):
        assert correct
        assert full >= 10


def _changed_shapes():
    import torch

    import hvdray.torch as hvd

    hvd.init()
    out = []
    for shape in [(3,), (3,), (5,), (5,)]:  # cached, then both ranks change the shape together
        out.append(hvd.allreduce(torch.ones(shape) * (hvd.rank() + 1), name="w", op=hvd.Sum).tolist())
    error = None
    try:  # now only rank 0 changes it: the mismatch is caught although "w" was cached
        hvd.allreduce(torch.ones(7 if hvd.rank() == 0 else 5), name="w")
    except hvd.TensorMismatchError as exc:
        error = str(exc)
    out.append(hvd.allreduce(torch.ones(2), name="w2", op=hvd.Sum).tolist())
    return out, error


def test_cached_name_renegotiates_on_new_shape_and_mismatch_still_caught(make_executor):
    ex = make_executor(num_workers=2)
    for out, error in ex.run(_changed_shapes):
        assert out == [[3.0] * 3, [3.0] * 3, [3.0] * 5, [3.0] * 5, [2.0, 2.0]]
        assert error is not None and "'w'" in error and "[7]" in error and "[5]" in error
