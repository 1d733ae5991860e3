"""The response cache and its flag vector, without Ray: slots, LRU eviction, AND-combined flags."""

import random

import numpy as np
import pytest
import torch

from hvdray.collective.engine.cache import FlagVector, ResponseCache
from hvdray.collective.protocol import (
    FAMILY_VARIANTS, OpDesc, OpKind, ReduceOp, barrier_desc, family_variants, generated_parts,
)


def meta(name, shape=(4,), dtype=torch.float32):
    return OpDesc(name, OpKind.ALLREDUCE, dtype, tuple(shape), ReduceOp.SUM)


def test_lookup_needs_the_same_metadata_as_this_rank_negotiated():
    cache = ResponseCache(capacity=4, rank=1)
    cache.put("w", {0: meta("w"), 1: meta("w")}, round_no=1)
    assert cache.lookup(meta("w")) == cache.slot_of("w")
    assert cache.lookup(meta("w", shape=(5,))) is None
    assert cache.lookup(meta("w", dtype=torch.float64)) is None
    assert cache.lookup(meta("w", shape=torch.Size([4]))) == cache.slot_of("w")  # a tensor's own shape matches
    assert cache.lookup(meta("other")) is None


def _unnamed(name, kind, shape, **fields):
    return OpDesc(name, kind, torch.float32, tuple(shape), generated=True, **fields)


def family_name(desc, variant=None):
    """The response cache's name of ``desc``'s family variant (its own counter's, or ``variant``); None for an op
    without a family."""
    found = family_variants(desc)
    if found is None:
        return None
    _, names, own = found
    return names[own if variant is None else variant]


def test_an_unnamed_ops_family_holds_what_every_rank_must_agree_on_but_its_own_rows():
    """The same family for the same op of any later call whose counter leaves the same remainder by
    FAMILY_VARIANTS (its variant), whatever each rank's rows."""
    gather = family_name(_unnamed("allgather.noname.2.7", OpKind.ALLGATHER, (3, 4)))
    later = 7 + FAMILY_VARIANTS
    assert gather == family_name(_unnamed(f"allgather.noname.2.{later}", OpKind.ALLGATHER, (5, 4)))  # each rank's rows
    assert gather != family_name(_unnamed(f"allgather.noname.2.{later}", OpKind.ALLGATHER, (3, 5)))
    assert gather != family_name(_unnamed(f"allgather.noname.3.{later}", OpKind.ALLGATHER, (3, 4)))  # another call
    # the next counters: other variants of the family, so that calls in flight at once wait on other slots
    variants = {family_name(_unnamed(f"allgather.noname.2.{n}", OpKind.ALLGATHER, (3, 4)))
                for n in range(8, 8 + FAMILY_VARIANTS)}
    assert gather in variants and len(variants) == FAMILY_VARIANTS
    assert variants == {family_name(_unnamed("allgather.noname.2.7", OpKind.ALLGATHER, (3, 4)), variant=v)
                        for v in range(FAMILY_VARIANTS)}
    swap = family_name(_unnamed("alltoall.noname.0", OpKind.ALLTOALL, (4,), splits=[1, 3]))
    assert swap == family_name(_unnamed(f"alltoall.noname.{FAMILY_VARIANTS}", OpKind.ALLTOALL, (6,), splits=[2, 4]))
    root0 = family_name(_unnamed("broadcast.noname.0", OpKind.BROADCAST, (4,), root=0))
    assert root0 != family_name(_unnamed(f"broadcast.noname.{FAMILY_VARIANTS}", OpKind.BROADCAST, (4,), root=1))
    assert root0 != family_name(_unnamed(f"broadcast.noname.{FAMILY_VARIANTS}", OpKind.BROADCAST, (5,), root=0))
    scatter = family_name(_unnamed("reducescatter.noname.0", OpKind.REDUCESCATTER, (4,), reduce_op=ReduceOp.SUM))
    assert scatter != family_name(
        _unnamed("reducescatter.noname.0", OpKind.REDUCESCATTER, (4,), reduce_op=ReduceOp.SUM, postscale=0.5))
    reduce = family_name(_unnamed("allreduce.noname.0", OpKind.ALLREDUCE, (4,), reduce_op=ReduceOp.SUM))
    assert reduce != family_name(_unnamed("allreduce.noname.0", OpKind.ALLREDUCE, (5,), reduce_op=ReduceOp.SUM))
    # a grouped op's members by their place in the group, a NaN mask as such
    member = family_name(_unnamed("grouped_allreduce.noname.0.1", OpKind.ALLREDUCE, (4,)))
    assert member == family_name(_unnamed(f"grouped_allreduce.noname.{FAMILY_VARIANTS}.1", OpKind.ALLREDUCE, (4,)))
    assert member != family_name(_unnamed(f"grouped_allreduce.noname.{FAMILY_VARIANTS}.0", OpKind.ALLREDUCE, (4,)))
    assert member != family_name(_unnamed("grouped_allreduce.noname.2.0.1", OpKind.ALLREDUCE, (4,)))  # call 2
    nan = family_name(_unnamed("allreduce.noname.2.5.nan", OpKind.ALLREDUCE, (4,)))
    assert nan == family_name(_unnamed(f"allreduce.noname.2.{5 + FAMILY_VARIANTS}.nan", OpKind.ALLREDUCE, (4,)))
    assert nan != family_name(_unnamed(f"allreduce.noname.2.{5 + FAMILY_VARIANTS}", OpKind.ALLREDUCE, (4,)))
    # no family: a named op, an object's op, a sparse allreduce's, a barrier, a name of another kind
    assert family_name(_unnamed("w", OpKind.ALLREDUCE, (4,))) is None
    assert family_name(_unnamed("sparse_allreduce.noname.0.values", OpKind.ALLGATHER, (4,))) is None
    assert family_name(_unnamed("broadcast_object.noname.0", OpKind.BROADCAST, (4,), root=0)) is None
    assert family_name(barrier_desc("barrier.noname.0")) is None
    assert family_name(_unnamed("allgather.noname.0", OpKind.ALLREDUCE, (4,))) is None


@pytest.mark.parametrize("name,parts", [
    ("allreduce.noname.7", ("allreduce.noname.7", OpKind.ALLREDUCE, "")),
    ("allreduce.noname.2.7", ("allreduce.noname.2.7", OpKind.ALLREDUCE, "")),
    ("allreduce.noname.2.7.nan", ("allreduce.noname.2.7", OpKind.ALLREDUCE, ".nan")),
    ("grouped_allreduce.noname.7.3", ("grouped_allreduce.noname.7", OpKind.ALLREDUCE, ".3")),
    ("grouped_allreduce.noname.2.7.3", ("grouped_allreduce.noname.2.7", OpKind.ALLREDUCE, ".3")),
    ("grouped_allreduce.noname.2.7.3.nan", ("grouped_allreduce.noname.2.7", OpKind.ALLREDUCE, ".3.nan")),
    ("alltoall.noname.10.12", ("alltoall.noname.10.12", OpKind.ALLTOALL, "")),
    # not an unnamed collective's: a member's index on an op that has none, or none on a grouped op's, three
    # counters, an empty counter, a word for a counter, another suffix, an op without a family
    ("allreduce.noname.2.7.3", None), ("grouped_allreduce.noname.7", None), ("allreduce.noname.1.2.3.4", None),
    ("allreduce.noname..3", None), ("allreduce.noname.x", None), ("allreduce.noname.3.values", None),
    ("allreduce.noname.3.", None), ("broadcast_object.noname.0", None), ("w", None),
])
def test_a_generated_name_is_cut_into_its_calls_name_kind_and_what_follows_the_counter(name, parts):
    assert generated_parts(name) == parts


def test_an_unnamed_ops_variants_are_named_once_per_family_and_scale_factors_print_as_given():
    """The variants' names come with the family; a family holds its scale factors as the description has them,
    so an int factor and the float of its value make two families (the frontends pass floats)."""
    family, names, variant = family_variants(_unnamed("allreduce.noname.2.11", OpKind.ALLREDUCE, (4,)))
    assert variant == 11 % FAMILY_VARIANTS and len(names) == len(set(names)) == FAMILY_VARIANTS
    assert names == tuple(family_name(_unnamed(f"allreduce.noname.2.{v}", OpKind.ALLREDUCE, (4,)))
                          for v in range(FAMILY_VARIANTS))
    assert names == tuple(f"{family} #{v}" for v in range(FAMILY_VARIANTS))
    as_int = family_variants(_unnamed("allreduce.noname.2.0", OpKind.ALLREDUCE, (4,), postscale=1))[0]
    as_float = family_variants(_unnamed("allreduce.noname.2.0", OpKind.ALLREDUCE, (4,), postscale=1.0))[0]
    assert as_int != as_float and as_float == family


def test_a_familys_slot_holds_every_ranks_rows_and_splits_as_negotiated():
    """``holds``: whether a family is cached with these descriptions (names aside); when one rank's rows
    change, the engine caches the family anew instead of sending that rank's op by name ever after."""
    cache = ResponseCache(capacity=4, rank=1)
    first = {r: _unnamed("allgather.noname.0", OpKind.ALLGATHER, (r + 1, 2)) for r in range(2)}
    family = family_name(first[0])
    assert cache.holds(family, first)  # not cached: nothing to replace
    cache.put(family, first, round_no=1)
    later = {r: _unnamed("allgather.noname.5", OpKind.ALLGATHER, (r + 1, 2)) for r in range(2)}
    assert cache.holds(family, later)
    assert cache.lookup(later[1], family) == cache.slot_of(family)
    grown = {0: _unnamed("allgather.noname.6", OpKind.ALLGATHER, (3, 2)), 1: later[1]}
    assert not cache.holds(family, grown)
    assert cache.lookup(grown[1], family) is not None  # rank 1's own rows did not change: it waits on the slot


def test_least_recently_used_slot_is_evicted_when_full():
    cache = ResponseCache(capacity=2, rank=0)
    cache.put("a", {0: meta("a")}, round_no=1)
    cache.put("b", {0: meta("b")}, round_no=2)
    cache.touch(cache.slot_of("a"), 3)
    evicted = cache.put("c", {0: meta("c")}, round_no=4)
    assert cache.slot_of("b") is None and evicted not in (cache.slot_of("a"),)
    assert cache.slot_of("c") == evicted and len(cache) == 2


def test_capacity_zero_caches_nothing():
    cache = ResponseCache(capacity=0, rank=0)
    assert cache.put("a", {0: meta("a")}, round_no=1) is None
    assert cache.slot_of("a") is None


def _combine(*vectors):
    out = vectors[0].clone()
    for v in vectors[1:]:
        out &= v
    return out


def test_flags_combine_to_ready_somewhere_and_full():
    ranks = [FlagVector(16) for _ in range(3)]
    filled = [
        ranks[0].fill([1, 3, 5], joined=False, wants_full=False).clone(),
        ranks[1].fill([3, 5], joined=False, wants_full=False).clone(),
        ranks[2].fill([5, 3, 9], joined=False, wants_full=True).clone(),
    ]
    reader = FlagVector(16)
    reader.tensor.copy_(_combine(*filled))
    ready, somewhere, full = reader.read()
    assert ready == [3, 5]
    assert somewhere == [1, 3, 5, 9]
    assert full is True
    assert reader.tensor.numel() == 2 * 16 // 8 + 16 + 1  # two bits a slot, the family digest, the last byte


def test_joined_rank_agrees_to_every_slot():
    active = FlagVector(8).fill([2], joined=False, wants_full=False).clone()
    joined = FlagVector(8).fill([], joined=True, wants_full=False).clone()
    reader = FlagVector(8)
    reader.tensor.copy_(_combine(active, joined))
    assert reader.read() == ([2], [2], False)


def test_default_capacity_vector_is_tiny():
    assert FlagVector(1024).fill(list(range(0, 1024, 7)), False, False).numel() == 273
    empty = FlagVector(0).fill([], False, True).numpy()
    assert empty[-1] == 0 and len(empty) == 17  # wants a full round; the family digest 0, its complement all ones


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_flags_tell_whether_every_rank_has_the_same_unnamed_call_on_its_families_slots(ranks):
    """family_agreed: None unless every rank has one; then True exactly when all have the same slots and
    generated names (one op, or a call's several: a grouped op's, an op's and its NaN mask)."""
    def agreed(families):
        vectors = [FlagVector(16).fill([s for s, _ in f] if f else [], False, False, True, f).clone() for f in families]
        reader = FlagVector(16)
        reader.tensor.copy_(_combine(*vectors))
        reader.read()
        return reader.family_agreed

    same = [((3, "allreduce.noname.1.7"),)] * ranks
    assert agreed(same) is True
    assert agreed(same[:-1] + [None]) is None  # one rank has none yet: wait
    assert agreed(same[:-1] + [((3, "allreduce.noname.1.8"),)]) is False  # another op of the family
    assert agreed(same[:-1] + [((4, "allreduce.noname.1.7"),)]) is False  # another family under the same name
    assert agreed([((3, f"allreduce.noname.{r}"),) for r in range(ranks)]) is False
    def call(n, *slots):
        return tuple((slot, f"grouped_allreduce.noname.1.{n}.{i}") for i, slot in enumerate(slots))

    group = [call(7, 3, 5)] * ranks
    assert agreed(group) is True
    assert agreed(group[:-1] + [call(8, 3, 5)]) is False  # another call of the same families
    assert agreed(group[:-1] + [call(7, 3)]) is False  # one op fewer
    assert agreed(group[:-1] + [call(7, 3, 6)]) is False  # another family
    assert agreed(group[:-1] + [call(7, 5, 3)]) is False  # the families in another order


@pytest.mark.parametrize("capacity", [0, 1, 7, 8, 13, 64, 1024])
def test_flags_agree_with_sets_of_slots_for_any_capacity_and_ranks(capacity):
    """ready = pending on every rank (a joined rank agrees to all), somewhere = pending on some rank, both
    ascending; full round if any rank wants one; everyone blocked if every rank is (a joined one counts)."""
    rng = random.Random(capacity)
    for _ in range(200):
        ranks = rng.randint(1, 4)
        states = []
        for _ in range(ranks):
            joined = rng.random() < 0.15
            count = rng.choice([0, 1, 5, capacity // 2, capacity]) if capacity else 0
            pending = [] if joined else rng.sample(range(capacity), min(count, capacity))
            states.append((pending, joined, rng.random() < 0.2, rng.random() < 0.5))
        vectors = [FlagVector(capacity).fill(p, j, w, b).clone() for p, j, w, b in states]
        reader = FlagVector(capacity)
        reader.tensor.copy_(_combine(*vectors))
        ready, somewhere, full = reader.read()
        active = [set(p) for p, joined, _, _ in states if not joined]
        expected_ready = set.intersection(*active) if active else set(range(capacity))
        assert ready == sorted(expected_ready)
        assert somewhere == sorted(set().union(*active))
        assert full == any(w for _, _, w, _ in states)
        assert reader.everyone_blocked == all(b or j for _, j, _, b in states)
