"""Horovod's groups=/num_groups= as the gradient reducers read them (no Ray)."""

from __future__ import annotations

import pytest

from hvdray.collective.gradient_groups import consecutive_runs, group_of_positions, resolve_groups


@pytest.mark.parametrize("count,k", [(1, 1), (4, 3), (6, 2), (7, 3), (3, 5), (10, 10), (0, 2), (5, 0)])
def test_consecutive_runs_cover_every_item_once_in_order_with_lengths_one_apart(count, k):
    runs = consecutive_runs(count, k)
    assert len(runs) == min(k, count)
    assert [i for a, b in runs for i in range(a, b)] == list(range(count if runs else 0))
    lengths = [b - a for a, b in runs]
    assert lengths == sorted(lengths, reverse=True) and (not lengths or max(lengths) - min(lengths) <= 1)


def test_resolve_groups_merges_the_two_spellings_and_names_what_is_wrong():
    assert resolve_groups(None, 0) == 0
    assert resolve_groups(None, 3) == 3
    assert resolve_groups(2, 0) == 2
    a, b = object(), object()
    assert resolve_groups(([a], (b,)), 0) == [[a], [b]]
    for groups, num_groups, kind, text in [
        (None, -1, ValueError, "num_groups"),
        (None, True, ValueError, "num_groups"),
        (2, 2, ValueError, "not both"),
        (-1, 0, ValueError, "groups must be >= 0"),
        ("2", 0, TypeError, "groups must be an int or a list"),
        (True, 0, TypeError, "groups must be an int or a list"),
        ([[a], []], 0, ValueError, "groups[1]"),
        ([a], 0, ValueError, "groups[0]"),
    ]:
        with pytest.raises(kind, match=text.replace("[", r"\[").replace("]", r"\]")):
            resolve_groups(groups, num_groups)


def test_group_of_positions_maps_listed_items_and_names_strangers_and_repeats():
    a, b, c = object(), object(), object()
    assert group_of_positions([[c], [a]], [a, b, c], "ours") == {2: 0, 0: 1}
    with pytest.raises(ValueError, match=r"groups\[1\]\[0\] is not ours"):
        group_of_positions([[a], [object()]], [a, b], "ours")
    with pytest.raises(ValueError, match=r"groups\[1\]\[1\] is already in an earlier group"):
        group_of_positions([[a, b], [c, a]], [a, b, c], "ours")
