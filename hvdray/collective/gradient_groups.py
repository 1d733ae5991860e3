"""Horovod's ``groups=`` and ``num_groups=`` for the gradient reducers: which gradients travel together.

``groups=k`` (an int) splits the gradients, in the order of their variables or parameters, into ``k``
runs of consecutive ones; ``groups=[[a, b], [c]]`` groups those variables; ``num_groups=k`` is
Horovod's older spelling of ``groups=k``. Each group is reduced as one ``grouped_allreduce``. The
frameworks (``hvdray.torch``, ``hvdray.tensorflow``) check that listed variables are theirs.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

GroupSpec = Union[int, list[list[Any]]]


def resolve_groups(groups: Any, num_groups: Any) -> GroupSpec:
    """``groups`` and ``num_groups`` checked and merged: an int ``k >= 0`` (0: no explicit groups) or a
    list of non-empty lists (of variables, checked by the caller)."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be an int >= 0, got {num_groups!r}")
    if groups is None:
        return num_groups
    if num_groups:
        raise ValueError("pass either groups= or the older num_groups=, not both")
    if isinstance(groups, bool) or not isinstance(groups, (int, list, tuple)):
        raise TypeError(f"groups must be an int or a list of lists of variables, got {type(groups).__name__}")
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups must be >= 0, got {groups}")
        return groups
    for i, group in enumerate(groups):
        if not isinstance(group, (list, tuple)) or not group:
            raise ValueError(f"groups[{i}] must be a non-empty list of variables, got {group!r}")
    return [list(group) for group in groups]


def group_of_positions(groups: list[list[Any]], items: Sequence[Any], what: str) -> dict[int, int]:
    """For lists of ``groups``: position in ``items`` -> index of the group holding that item (matched by
    identity). A listed object that is not among ``items`` (``what`` says what those are), or one listed
    twice, is a ValueError naming ``groups[i][j]``."""
    position = {id(item): i for i, item in enumerate(items)}
    group_of: dict[int, int] = {}
    for g, group in enumerate(groups):
        for j, item in enumerate(group):
            at = position.get(id(item))
            if at is None:
                raise ValueError(f"groups[{g}][{j}] is not {what}")
            if at in group_of:
                raise ValueError(f"groups[{g}][{j}] is already in an earlier group; each belongs to one group")
            group_of[at] = g
    return group_of


def consecutive_runs(count: int, k: int) -> list[tuple[int, int]]:
    """``[start, stop)`` bounds splitting ``count`` items into ``min(k, count)`` consecutive runs whose
    lengths differ by at most one (the first ones longer)."""
    runs = min(k, count)
    if runs <= 0:
        return []
    size, extra = divmod(count, runs)
    bounds = [0]
    for i in range(runs):
        bounds.append(bounds[-1] + size + (1 if i < extra else 0))
    return list(zip(bounds, bounds[1:]))
