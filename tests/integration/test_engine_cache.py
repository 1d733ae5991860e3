"""The response cache on real workers: the steady state runs without full negotiation rounds, fusion
packs tensors into one Gloo call, and renegotiation on a changed shape (stalls of cached tensors: test_stall.py);
unnamed allreduces by their family's slot, and off it whenever the ranks' ops differ."""

from __future__ import annotations

import pytest

#: the executor of the check without a response cache (the others share tests/conftest.py's pair and trio)
EXECUTORS = {"pair without cache": (2, {"cache_capacity": 0})}


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


def test_steady_state_needs_no_full_rounds_and_fuses(shared_executor):
    for correct, (rounds, full, calls, fused) in shared_executor.run(_steady_state, args=[20]):
        assert correct
        assert rounds >= 20
        assert full <= 3  # the first step negotiates by name; afterwards only the flag vector travels
        assert calls < 12 * 20 / 2  # 12 tensors per step go out in far fewer Gloo calls
        assert fused >= 12 * 10


@pytest.mark.shared_executor("pair without cache")
def test_without_cache_every_step_negotiates_by_name(shared_executor):
    for correct, (rounds, full, _, _) in shared_executor.run(_steady_state, args=[10]):
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


def test_cached_name_renegotiates_on_new_shape_and_mismatch_still_caught(shared_executor):
    for out, error in shared_executor.run(_changed_shapes):
        assert out == [[3.0] * 3, [3.0] * 3, [3.0] * 5, [3.0] * 5, [2.0, 2.0]]
        assert error is not None and "'w'" in error and "[7]" in error and "[5]" in error


def _unnamed_loop(steps: int):
    """Unnamed allreduces (generated names, new every call) in a loop, of two families, with values that
    change every step and differ per rank: a mispairing (another step's tensor, another family's) shows."""
    import torch

    import hvdray.torch as hvd
    from hvdray.collective import session

    hvd.init()
    stats = session.engine().stats
    size, rank = hvd.size(), hvd.rank()
    wrong = []
    before = (stats.rounds, stats.full_rounds)
    for step in range(steps):
        mine = torch.full((3,), float(rank + step))
        average = hvd.allreduce(mine)  # out of place, averaged: Horovod's default
        total = hvd.allreduce_(torch.full((5,), float(rank * step)), op=hvd.Sum)
        expected_average = sum(r + step for r in range(size)) / size
        expected_total = sum(r * step for r in range(size))
        if not (torch.all(average == expected_average) and torch.all(total == expected_total)):
            wrong.append((step, average.tolist(), total.tolist()))
    rounds, full = stats.rounds - before[0], stats.full_rounds - before[1]
    return wrong, rounds, full


@pytest.mark.shared_executor("pair", "trio")
def test_unnamed_allreduces_go_by_their_familys_slot_after_the_first(shared_executor):
    """Each unnamed allreduce has a new generated name, which the response cache cannot hold; its family (the
    call, dtype, shape, reduction and scale factors) is cached instead, so that from the second one on it
    goes by one flag bit like a named op, not by a full negotiation round."""
    steps = 30
    for wrong, rounds, full in shared_executor.run(_unnamed_loop, args=[steps]):
        assert wrong == []
        assert rounds >= 2 * steps
        assert full <= 4  # the first op of each family goes by name (before: one full round per op)


def _unnamed_other_kinds_loop(steps: int):
    """Unnamed allgathers (uneven rows, rank 0's growing halfway), broadcasts from two roots, reducescatters
    and alltoalls (uneven splits) in a loop, with values that change every step: each kind's family goes by
    its slot from its second op on, and a rank whose rows change sends its op by name once (its family's
    slot is made anew) without a wrong result."""
    import torch

    import hvdray.torch as hvd
    from hvdray.collective import session

    hvd.init()
    stats = session.engine().stats
    size, rank = hvd.size(), hvd.rank()

    def rows(r: int, step: int) -> int:
        return r + 1 + (2 if r == 0 and step >= steps // 2 else 0)

    wrong = []
    before = stats.full_rounds
    for step in range(steps):
        gathered = hvd.allgather(torch.full((rows(rank, step), 2), float(rank + step)))
        expected = torch.cat([torch.full((rows(r, step), 2), float(r + step)) for r in range(size)])
        root = step % 2 * (size - 1)
        sent = hvd.broadcast(torch.full((3,), float(rank * 10 + step)), root_rank=root)
        scattered = hvd.reducescatter(torch.full((2 * size,), float(rank + step)), op=hvd.Sum)
        splits = [d + 1 for d in range(size)]
        received, received_splits = hvd.alltoall(torch.full((sum(splits),), float(rank * 100 + step)), splits=splits)
        ok = (
            torch.equal(gathered, expected)
            and torch.all(sent == root * 10 + step)
            and scattered.tolist() == [float(sum(r + step for r in range(size)))] * 2
            and received_splits.tolist() == [rank + 1] * size
            and received.tolist() == [float(r * 100 + step) for r in range(size) for _ in range(rank + 1)]
        )
        if not ok:
            wrong.append((step, gathered.tolist(), sent.tolist(), scattered.tolist(), received.tolist()))
    return wrong, stats.full_rounds - before


def _unnamed_calls_of_several_ops_loop(steps: int):
    """Unnamed calls that submit several ops at once: grouped allreduces and allgathers, and a float max,
    which reduces a NaN mask beside its tensor (a NaN on one rank every third step): each call's ops go by
    their families' slots together from the call's second time on."""
    import torch

    import hvdray.torch as hvd
    from hvdray.collective import session

    hvd.init()
    stats = session.engine().stats
    size, rank = hvd.size(), hvd.rank()
    wrong = []
    before = stats.full_rounds
    for step in range(steps):
        a, b = hvd.grouped_allreduce([torch.full((3,), float(rank + step)), torch.full((5,), float(rank * step))],
                                     op=hvd.Sum)
        gathered = hvd.grouped_allgather([torch.full((rank + 1,), float(rank)), torch.full((2, 2), float(step))])
        mine = torch.full((4,), float(rank + step))
        if step % 3 == 0 and rank == size - 1:
            mine[1] = float("nan")
        largest = hvd.allreduce(mine, op=hvd.Max)
        expected_largest = torch.full((4,), float(size - 1 + step))
        if step % 3 == 0:
            expected_largest[1] = float("nan")
        ok = (
            a.tolist() == [float(sum(r + step for r in range(size)))] * 3
            and b.tolist() == [float(sum(r * step for r in range(size)))] * 5
            and gathered[0].tolist() == [float(r) for r in range(size) for _ in range(r + 1)]
            and torch.equal(gathered[1], torch.full((2 * size, 2), float(step)))
            and torch.equal(largest.isnan(), expected_largest.isnan())
            and torch.equal(largest.nan_to_num(), expected_largest.nan_to_num())
        )
        if not ok:
            wrong.append((step, a.tolist(), b.tolist(), [g.tolist() for g in gathered], largest.tolist()))
    return wrong, stats.full_rounds - before


#: each loop of unnamed calls (12 steps) and the most full rounds it may take: the first op of each of five
#: families by name, and rank 0's allgather with new rows once (before: one per op, 4 * 12); each of the three
#: calls' first time (before: one per call, 3 * 12)
_UNNAMED_LOOPS = {
    "other kinds": (_unnamed_other_kinds_loop, 8),
    "calls of several ops": (_unnamed_calls_of_several_ops_loop, 5),
}


@pytest.mark.shared_executor("pair", "trio")
@pytest.mark.parametrize("loop", list(_UNNAMED_LOOPS))
def test_unnamed_allgathers_broadcasts_reducescatters_alltoalls_groups_and_maxima_go_by_their_families_slots(
    shared_executor, loop
):
    run, most_full_rounds = _UNNAMED_LOOPS[loop]
    for wrong, full in shared_executor.run(run, args=[12]):
        assert wrong == []
        assert full <= most_full_rounds, full


def _unnamed_groups_that_disagree_after_caching():
    """Groups whose second tensor has 2 or 3 elements both cached, then rank 0 submits the one where the others
    submit the other, under the same generated name: every rank's call on its families' slots, but not the same
    call."""
    import time

    import torch

    import hvdray.torch as hvd

    hvd.init()
    for _ in range(2):
        for n in (2, 3):
            hvd.grouped_allreduce([torch.ones(2), torch.ones(n)])
    started = time.monotonic()
    try:
        hvd.grouped_allreduce([torch.ones(2), torch.ones(2 if hvd.rank() == 0 else 3)])
        error = "no error"
    except hvd.TensorMismatchError as exc:
        error = str(exc)
    elapsed = time.monotonic() - started
    after = hvd.grouped_allreduce([torch.full((2,), float(hvd.rank()))] * 2, op=hvd.Sum)
    return error, elapsed, [t.tolist() for t in after]


def test_unnamed_groups_that_disagree_fail_fast_on_every_rank_though_their_families_are_cached(shared_executor):
    for error, elapsed, after in shared_executor.run(_unnamed_groups_that_disagree_after_caching):
        assert "mismatched shapes" in error and "grouped_allreduce.noname." in error, error
        assert "[2]" in error and "[3]" in error
        assert elapsed < 5
        assert after == [[1.0, 1.0], [1.0, 1.0]]  # the ranks go on together


def _unnamed_broadcasts_that_disagree_on_the_root():
    """Both roots' broadcast families cached, then rank 0 broadcasts from root 0 where the others do from
    root 1, under the same generated name: each rank's op is on a cached family's slot, but not the same one."""
    import time

    import torch

    import hvdray.torch as hvd

    hvd.init()
    for _ in range(2):
        for root in (0, 1):
            hvd.broadcast(torch.ones(2), root_rank=root)
    started = time.monotonic()
    try:
        hvd.broadcast(torch.ones(2), root_rank=0 if hvd.rank() == 0 else 1)
        error = "no error"
    except hvd.TensorMismatchError as exc:
        error = str(exc)
    elapsed = time.monotonic() - started
    after = hvd.broadcast(torch.full((2,), float(hvd.rank())), root_rank=1).tolist()
    return error, elapsed, after


def test_unnamed_broadcasts_that_disagree_fail_fast_on_every_rank_though_their_families_are_cached(shared_executor):
    for error, elapsed, after in shared_executor.run(_unnamed_broadcasts_that_disagree_on_the_root):
        assert "broadcast.noname." in error and "root" in error, error
        assert elapsed < 5
        assert after == [1.0, 1.0]  # the ranks go on together


def _unnamed_mismatch_after_caching():
    """Both families cached, then the ranks disagree: rank 0 reduces 2 elements where the others reduce 3,
    under the same generated name. Both ways of meeting: every rank's op on a family slot (both cached),
    and rank 0's family never seen (it goes by name while the others wait on their slot)."""
    import time

    import torch

    import hvdray.torch as hvd

    hvd.init()
    for _ in range(2):
        hvd.allreduce(torch.ones(2))
        hvd.allreduce(torch.ones(3))
    errors = []
    for rank0_numel in (2, 4):
        started = time.monotonic()
        try:
            hvd.allreduce(torch.ones(rank0_numel if hvd.rank() == 0 else 3))
            errors.append(("no error", time.monotonic() - started))
        except hvd.TensorMismatchError as exc:
            errors.append((str(exc), time.monotonic() - started))
    after = hvd.allreduce(torch.full((3,), float(hvd.rank())), op=hvd.Sum).tolist()
    return errors, after


def test_unnamed_allreduces_that_disagree_fail_fast_on_every_rank_though_their_families_are_cached(shared_executor):
    for errors, after in shared_executor.run(_unnamed_mismatch_after_caching):
        for message, elapsed in errors:
            assert "mismatched shapes" in message and "allreduce.noname." in message, message
            assert elapsed < 5
        assert "[2]" in errors[0][0] and "[3]" in errors[0][0]
        assert "[4]" in errors[1][0] and "[3]" in errors[1][0]
        assert after == [1.0, 1.0, 1.0]  # the ranks go on together


def _unnamed_calls_in_flight_loop(steps: int, in_flight: int):
    """Per step, ``in_flight`` unnamed allreduces submitted before any is waited on: one family (the same shape)
    and, every other call, a second one (another shape), plus an unnamed grouped allreduce among them; the
    values change every step and differ per rank, so a mispairing shows. Returns the wrong results and the full
    rounds after the first step."""
    import torch

    import hvdray.torch as hvd
    from hvdray.collective import session

    hvd.init()
    stats = session.engine().stats
    size, rank = hvd.size(), hvd.rank()
    wrong, full_after_first = [], 0
    for step in range(steps):
        before = stats.full_rounds
        handles, expected = [], []
        for i in range(in_flight):
            numel = 4 if i % 2 == 0 else 6
            handles.append(hvd.allreduce_async(torch.full((numel,), float(rank * 100 + step * 10 + i)), op=hvd.Sum))
            expected.append([float(sum(r * 100 + step * 10 + i for r in range(size)))] * numel)
        group = hvd.grouped_allreduce_async([torch.full((2,), float(rank + step)), torch.full((3,), float(step))])
        results = [hvd.synchronize(h).tolist() for h in handles]
        grouped = [t.tolist() for t in hvd.synchronize(group)]
        if results != expected or grouped != [[sum(r + step for r in range(size)) / size] * 2, [float(step)] * 3]:
            wrong.append((step, results, grouped))
        if step:
            full_after_first += stats.full_rounds - before
    return wrong, full_after_first


@pytest.mark.shared_executor("pair", "trio")
def test_unnamed_calls_in_flight_at_once_go_by_their_families_slots(shared_executor):
    """Up to FAMILY_VARIANTS consecutive unnamed calls in flight at once wait on as many slots (their families'
    variants, cached together with the first call of each family), so that a loop of them needs no full rounds
    after its first step (before: every call after the first went by name, two full rounds a step); more in
    flight at once go by name, with the same results."""
    from hvdray.collective.protocol import FAMILY_VARIANTS

    for wrong, full in shared_executor.run(_unnamed_calls_in_flight_loop, args=[8, FAMILY_VARIANTS]):
        assert wrong == []
        assert full == 0, full
    for wrong, full in shared_executor.run(_unnamed_calls_in_flight_loop, args=[4, FAMILY_VARIANTS + 3]):
        assert wrong == []  # a variant's slot taken: by name, paired by the generated names


def _unnamed_calls_in_flight_that_disagree():
    """Both families cached, then unnamed calls in flight at once where the third differs on rank 0 (2 elements
    where the others reduce 3): it fails on every rank, naming its generated name, and the others go through."""
    import time

    import torch

    import hvdray.torch as hvd

    hvd.init()
    rank = hvd.rank()
    for _ in range(3):
        [hvd.synchronize(hvd.allreduce_async(torch.ones(n), op=hvd.Sum)) for n in (2, 3, 3, 3)]
    started = time.monotonic()
    handles = [hvd.allreduce_async(torch.ones(2 if rank == 0 and i == 2 else 3), op=hvd.Sum) for i in range(4)]
    outcomes = []
    for handle in handles:
        try:
            outcomes.append(hvd.synchronize(handle).tolist())
        except hvd.TensorMismatchError as exc:
            outcomes.append(str(exc))
    elapsed = time.monotonic() - started
    after = hvd.allreduce(torch.full((3,), float(rank)), op=hvd.Sum).tolist()
    return outcomes, elapsed, after


def test_unnamed_calls_in_flight_that_disagree_fail_fast_on_every_rank(shared_executor):
    for outcomes, elapsed, after in shared_executor.run(_unnamed_calls_in_flight_that_disagree):
        assert outcomes[0] == outcomes[1] == outcomes[3] == [2.0, 2.0, 2.0], outcomes
        assert "mismatched shapes" in outcomes[2] and "allreduce.noname." in outcomes[2], outcomes[2]
        assert "[2]" in outcomes[2] and "[3]" in outcomes[2]
        assert elapsed < 5
        assert after == [1.0, 1.0, 1.0]  # the ranks go on together


def _unnamed_async_and_join(named: bool):
    """Several unnamed allreduces of one family in flight at once (the first may go by the family's slot, the
    rest by name), then a rank joins while the others go on with that family: the same results as with
    names."""
    import torch

    import hvdray.torch as hvd

    hvd.init()
    rank = hvd.rank()
    name = (lambda i: f"op.{i}") if named else (lambda i: None)
    out = []
    for step in range(3):
        hvd.allreduce(torch.full((4,), float(rank)), name=name(f"warm.{step}") if named else None)
    handles = [hvd.allreduce_async(torch.full((4,), float(rank * 10 + i)), name=name(f"async.{i}"), op=hvd.Sum)
               for i in range(4)]
    out += [hvd.synchronize(h).tolist() for h in handles]
    if rank == hvd.size() - 1:
        last = hvd.join()
    else:
        for step in range(3):
            out.append(hvd.allreduce(torch.full((4,), float(rank + step)), name=name(f"late.{step}"),
                                     op=hvd.Sum).tolist())
        last = hvd.join()
    return out, last


def test_unnamed_allreduces_in_flight_together_and_across_a_join_give_the_named_results(shared_executor):
    unnamed, named = (shared_executor.run(_unnamed_async_and_join, args=[named]) for named in (False, True))
    assert unnamed == named


def _unnamed_until_one_rank_returns():
    import time

    import torch

    import hvdray.torch as hvd
    from hvdray.collective.errors import PeerFinishedError

    hvd.init()
    for _ in range(3):
        hvd.allreduce(torch.ones(2))  # the family is cached: the next op waits on its slot
    if hvd.rank() == 1:
        return "returned", 0.0
    started = time.monotonic()
    try:
        hvd.allreduce(torch.ones(2))
    except PeerFinishedError as exc:
        return str(exc), time.monotonic() - started
    return "no error", 0.0


def test_an_unnamed_allreduce_on_its_familys_slot_fails_fast_when_a_rank_returns(shared_executor):
    (message, elapsed), _ = shared_executor.run(_unnamed_until_one_rank_returns)
    assert "rank 1 returned from its function" in message, message
    assert elapsed < 10
