"""The engine's parts without an engine: op descriptions on the wire, the negotiation table and its
mismatch errors, round messages, fusion planning and the learned step."""

from __future__ import annotations

import pytest
import torch

from hvdray.collective.autotune import TunedParams
from hvdray.collective.engine.fusion import DIRECT_BYTES, FusionPlanner, ReadyOp
from hvdray.collective.engine.negotiation import Drop, Finished, NegotiationTable, RoundMessage, leavers, mismatch
from hvdray.collective.engine.steps import LearnedStep
from hvdray.collective.protocol import OpDesc, OpKind, ReduceOp, barrier_desc


def allreduce(name, shape=(4,), dtype=torch.float32, op=ReduceOp.SUM, pre=1.0, post=1.0):
    return OpDesc(name, OpKind.ALLREDUCE, dtype, torch.Size(shape), op, pre, post)


# -- protocol ------------------------------------------------------------------------------------
@pytest.mark.parametrize("desc", [
    allreduce("g", (3, 2), torch.float64, ReduceOp.AVERAGE, 0.5, 2.0),
    OpDesc("b", OpKind.BROADCAST, torch.int32, (5,), root=1),
    OpDesc("a.noname.0", OpKind.ALLTOALL, torch.uint8, (4, 2), splits=[1, 3], generated=True),
    barrier_desc("barrier.noname.0"),
])
def test_descriptions_survive_the_wire(desc):
    import json

    back = OpDesc.from_wire(json.loads(json.dumps(desc.to_wire())))
    assert back == OpDesc(desc.name, desc.kind, desc.dtype, tuple(desc.shape), desc.reduce_op, desc.prescale,
                          desc.postscale, desc.root, desc.splits, desc.generated)
    assert back.matches(desc)


@pytest.mark.parametrize("wire", [
    ["allreduce", "g"], ["frobnicate", "g", "torch.float32", [4], None, 1.0, 1.0, None, None, 0],
    ["allreduce", "g", "torch.nn", [4], "sum", 1.0, 1.0, None, None, 0],
    ["allreduce", "g", "torch.float32", [4], "median", 1.0, 1.0, None, None, 0], "not a list",
])
def test_from_wire_refuses_what_is_not_a_description(wire):
    with pytest.raises(ValueError, match="not an op description"):
        OpDesc.from_wire(wire)


def test_matches_ignores_the_name_only():
    ref = allreduce("g")
    assert ref.matches(allreduce("other"))
    for other in (allreduce("g", (5,)), allreduce("g", dtype=torch.float64), allreduce("g", op=ReduceOp.MAX),
                  allreduce("g", pre=2.0), allreduce("g", post=2.0)):
        assert not ref.matches(other)
    assert ref.nbytes == 16 and barrier_desc("x").nbytes == 0


def test_round_messages_survive_the_wire_and_an_empty_one_is_empty():
    assert RoundMessage().encode() == b"" and RoundMessage.decode(b"") == RoundMessage()
    message = RoundMessage(announce=[allreduce("g")], census=[3, 7], join=True, stop=True,
                           drops=[Drop("lonely", [1]), Drop("stuck", [0, 2], True)],
                           tune=TunedParams(4.0, 1.5, False), call=4,
                           finished=Finished(3, "raised"))
    back = RoundMessage.decode(message.encode())
    assert back.census == [3, 7] and back.join and back.stop
    assert back.drops == [Drop("lonely", [1], False), Drop("stuck", [0, 2], True)]
    assert back.call == 4 and back.finished == Finished(3, "raised")
    assert back.tune == TunedParams(4.0, 1.5, False) and back.announce[0].matches(allreduce("g"))


# -- negotiation --------------------------------------------------------------------------------
def test_names_become_ready_in_announcement_order_once_every_rank_has_them():
    table = NegotiationTable(size=2)
    busy, names = table.absorb([RoundMessage(announce=[allreduce("b"), allreduce("a")]),
                                RoundMessage(announce=[allreduce("a")])], now=0.0)
    assert busy and names == ["b", "a", "a"]
    assert [name for name, _ in table.take_ready()] == ["a"]
    table.absorb([RoundMessage(), RoundMessage(join=True)], now=1.0)  # rank 1 joined: "b" is ready
    assert [name for name, _ in table.take_ready()] == ["b"] and not table.announced
    assert table.joined == {1} and not table.everyone_joined


def test_a_rank_leaving_its_call_voids_that_calls_names_and_joins_on_every_rank_alike():
    table = NegotiationTable(size=3)
    table.absorb([RoundMessage(announce=[allreduce("old")], call=1), RoundMessage(join=True), RoundMessage()], 0.0)
    assert not table.closed(1) and "old" in table.announced and table.joined == {1}
    # rank 2 leaves call 1 in the same round in which rank 0 announces another op of call 1
    table.absorb([RoundMessage(announce=[allreduce("new")], call=1), RoundMessage(),
                  RoundMessage(finished=Finished(1, "returned"))], 1.0)
    assert table.closed(1) and not table.closed(2) and not table.closed(0)
    assert not table.announced and not table.joined  # neither can ever complete: forgotten alike
    assert leavers(table.finished, 1) == [(2, Finished(1, "returned"))] and leavers(table.finished, 2) == []
    # call 2: the same names run again normally
    table.absorb([RoundMessage(announce=[allreduce("old")], call=2)] * 3, 2.0)
    assert [name for name, _ in table.take_ready()] == ["old"]


@pytest.mark.parametrize("other,words", [
    (OpDesc("w", OpKind.BROADCAST, torch.float32, (4,), root=0), "mismatched operations for 'w': rank 0 called "
     "allreduce, rank 1 called broadcast"),
    (allreduce("w", dtype=torch.float64), "mismatched dtypes for allreduce 'w': rank 0 has torch.float32, "
     "rank 1 has torch.float64"),
    (allreduce("w", (7,)), "mismatched shapes for allreduce 'w': rank 0 has [4], rank 1 has [7]"),
    (allreduce("w", op=ReduceOp.MIN), "mismatched reduction op for allreduce 'w': rank 0 has sum, rank 1 has min"),
    (allreduce("w", post=3.0), "mismatched postscale_factor for allreduce 'w': rank 0 has 1.0, rank 1 has 3.0"),
])
def test_mismatches_are_named_field_by_field(other, words):
    assert mismatch("w", {0: allreduce("w"), 1: other}) == words
    assert mismatch("w", {0: allreduce("w"), 1: allreduce("w")}) is None


def test_allgather_may_differ_in_dim_0_only():
    gather = lambda shape: OpDesc("g", OpKind.ALLGATHER, torch.float32, shape)  # noqa: E731
    assert mismatch("g", {0: gather((2, 3)), 1: gather((5, 3))}) is None
    assert "shapes beyond dim 0" in mismatch("g", {0: gather((2, 3)), 1: gather((2, 4))})


def test_only_allreduce_runs_with_joined_ranks():
    table = NegotiationTable(size=2)
    table.absorb([RoundMessage(), RoundMessage(join=True)], now=0.0)
    broadcast = OpDesc("b", OpKind.BROADCAST, torch.float32, (4,), root=0)
    assert "cannot run after rank(s) [1] called join()" in table.problem("b", {0: broadcast}, cached=False)
    assert table.problem("g", {0: allreduce("g")}, cached=False) is None


# -- fusion -------------------------------------------------------------------------------------
def ready(*descs, problem=None):
    return [ReadyOp(d.name, {0: d, 1: d}, cached=False, problem=problem) for d in descs]


def test_compatible_allreduces_fuse_up_to_the_threshold_and_others_split_batches():
    planner = FusionPlanner(fusion_threshold_bytes=40)
    plan = planner.plan(
        ready(allreduce("a"), allreduce("b"), allreduce("c", (8,)), allreduce("d", op=ReduceOp.MAX),
              OpDesc("e", OpKind.BROADCAST, torch.float32, (4,), root=0), allreduce("f")),
        fused_message_bytes=0,
    )
    assert [(a.names, a.fused) for a in plan] == [
        (["a", "b"], True), (["c"], True), (["d"], True), (["e"], False), (["f"], True)
    ]
    assert plan[0].nbytes == 32 and plan[3].rank_descs[1].root == 0


def test_adasum_and_large_tensors_run_alone_without_closing_the_batch():
    planner = FusionPlanner(fusion_threshold_bytes=1 << 30)
    big = allreduce("big", (DIRECT_BYTES // 4,))
    plan = planner.plan(ready(allreduce("a"), big, allreduce("ada", op=ReduceOp.ADASUM), allreduce("b")), 0)
    assert [a.names for a in plan] == [["big"], ["ada"], ["a", "b"]]
    # with a transport limit, batches end at it and only larger tensors run alone
    plan = planner.plan(ready(allreduce("a"), allreduce("b"), allreduce("c")), fused_message_bytes=32)
    assert [a.names for a in plan] == [["a", "b"], ["c"]]


def test_a_problem_becomes_its_own_action_between_batches():
    planner = FusionPlanner(fusion_threshold_bytes=1 << 20)
    ops = ready(allreduce("a")) + ready(allreduce("bad"), problem="mismatch") + ready(allreduce("b"))
    assert [(a.names, a.problem) for a in planner.plan(ops, 0)] == [(["a"], ""), (["bad"], "mismatch"), (["b"], "")]


def test_cached_plans_and_staging_views_are_kept_until_the_buffer_grows():
    planner = FusionPlanner(fusion_threshold_bytes=1 << 20)
    built = []

    def make():
        built.append(1)
        return ready(allreduce("a", (2, 2)), allreduce("b"))

    plan = planner.cached_plan((0, 1), make, 0)
    assert planner.cached_plan((0, 1), make, 0) is plan and len(built) == 1
    views = planner.staging_views(plan[0])
    assert [tuple(v.shape) for v in views] == [(2, 2), (4,)] and planner.staging_views(plan[0]) is views
    bigger = planner.plan(ready(allreduce("c", (100,))), 0)[0]
    bigger.fused = True
    planner.staging_views(bigger)  # a larger buffer replaces the old one: plans are made again
    planner.cached_plan((0, 1), make, 0)
    assert len(built) == 2


# -- the learned step ---------------------------------------------------------------------------
def test_a_closed_step_is_learned_and_forgotten():
    step = LearnedStep()
    step.add([1, 2], 200)
    step.learn_if_over()
    assert step.expected == frozenset()  # not closed yet
    step.close()
    step.learn_if_over()
    assert step.expected == {1, 2} and not step.current and not step.closing
    step.close()  # a wait after the step was learned: the next step's first gradient must not end it
    step.add([1], 50)
    step.learn_if_over()
    assert step.expected == {1, 2} and step.current == {1}
    step.add([2], 0)
    step.close()
    step.learn_if_over()
    step.add([1], 50)
    assert not step.submitted_whole() and step.missing() == 1
    step.add([2], 50)
    assert step.submitted_whole()
    step.forget()
    assert step.expected == frozenset() and step.missing() == 1



def test_a_step_counts_unnamed_calls_by_family_not_by_their_variants_slots():
    step = LearnedStep()
    sums, maxima = "allreduce.noname.* #0 (float32 [5] sum)", "allreduce.noname.* #0 (float32 [2] max)"
    step.add([1], 40, (sums, sums))  # a named op's slot 1, two unnamed calls of one family
    step.add([], 20, (maxima,))
    step.close()
    step.learn_if_over()
    assert step.learned and step.expected == {1} and step.expected_families == {sums: 2, maxima: 1}
    assert not step.is_open
    step.add([1], 40, (sums,))
    assert step.is_open and not step.submitted_whole() and step.missing() == 2  # one more sum, one maximum
    step.add([], 20, (sums, maxima))
    assert step.submitted_whole()
    step.forget()
    assert not step.learned and not step.is_open and step.missing() == 1


def _float_sums(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Sums an average divides: ordinary ones, ones whose quotients fall below the normal range, signed
    zeros, the extremes and an infinity."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    return torch.cat([
        torch.randn(4096, generator=g, dtype=torch.float64) * 1e3,
        torch.rand(4096, generator=g, dtype=torch.float64) * info.tiny * 8,  # quotients below the normal range
        torch.tensor([0.0, -0.0, info.max, -info.max, info.tiny, info.smallest_normal / 3, float("inf")],
                     dtype=torch.float64),
    ]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("size", [2, 3, 4, 6, 8, 1024])
def test_a_float_average_is_the_sums_quotient_for_every_size(dtype, size):
    """``Scale`` multiplies by 1/size where the size is a power of two (exact, and faster) and divides
    otherwise: either way every element is exactly what dividing the sum by the size gives, subnormal
    quotients, signed zeros and infinities included, on a list of tensors and on a transport's numpy block
    alike."""
    from hvdray.collective.transport.reductions import Scale, block_operands

    sums = _float_sums(dtype, size)
    bufs = [sums[:5000].clone(), sums[5000:].clone()]
    Scale(size, average=True)(bufs)
    averaged = torch.cat(bufs)
    assert torch.equal(averaged, sums / size)
    assert torch.equal(torch.signbit(averaged), torch.signbit(sums / size))
    if size & (size - 1) == 0:  # the exact quotient, rounded once
        assert torch.equal(averaged, (sums.double() / size).to(dtype))
    block = sums.clone()
    _, (view,) = block_operands(torch.add, [block])  # a numpy view where numpy has the dtype, as a transport's
    Scale(size, average=True).on_block(view)
    assert torch.equal(block, averaged) and torch.equal(torch.signbit(block), torch.signbit(averaged))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.int32, torch.int64])
@pytest.mark.parametrize("scale", [(2, True, 0.3), (3, True, 2.0), (1, False, 0.1), (4, False, 1 / 3), (5, True, 5.0),
                                   (1, True, 1.0), (3, False, 1.0)])
def test_a_scale_on_a_numpy_block_gives_torchs_bits(dtype, scale):
    """A transport hands ``Scale`` its reduced blocks as numpy views (``block_operands``): every dtype and
    every kind of scale (an average with a postscale factor, a factor alone, a factor that cancels the
    average, nothing to do) gives the bits torch's ops give on the tensor; integers are averaged toward
    zero and left alone by a factor of one."""
    from hvdray.collective.transport.reductions import Scale, block_operands

    size, average, factor = scale
    if dtype.is_floating_point:
        sums = _float_sums(dtype, size)
    else:
        sums = torch.randint(-1000, 1000, (9000,), generator=torch.Generator().manual_seed(size), dtype=dtype)
        if factor != 1.0 and not (average and size > 1):  # torch refuses to scale integers in place by a float
            with pytest.raises(RuntimeError):
                Scale(size, average, factor)([sums.clone()])
            block = sums.clone()  # held: a numpy view does not keep its tensor's memory alive
            _, (view,) = block_operands(torch.add, [block])
            with pytest.raises(RuntimeError):
                Scale(size, average, factor).on_block(view)
            return
    expected = sums.clone()
    Scale(size, average, factor)([expected])
    block = sums.clone()
    _, (view,) = block_operands(torch.add, [block])
    Scale(size, average, factor).on_block(view)
    assert torch.equal(block, expected) and torch.equal(torch.signbit(block), torch.signbit(expected))
    if not average and factor == 1.0 or average and size == 1 and factor == 1.0:
        assert torch.equal(block, sums)  # nothing to do
