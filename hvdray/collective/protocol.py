"""What every layer of the collective stack agrees on about an op: one definition, read everywhere.

The frontends build op descriptions (:class:`OpDesc`), the engine negotiates and fuses them, the
transports run them. A description crosses the wire only while its name is negotiated, as the compact
JSON list :meth:`OpDesc.to_wire` gives; nothing read from a socket is ever unpickled.
"""

from __future__ import annotations

import enum
import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

#: part of every generated op name (``allreduce.noname.3``); such names are never cached themselves (an
#: unnamed collective's family is: :func:`family_variants`)
GENERATED_NAME_MARK = ".noname."
#: a floating-point min's or max's NaN mask's name: its allreduce's, and this
NAN_MASK_SUFFIX = ".nan"


class ReduceOp(str, enum.Enum):
    """How allreduce and reducescatter combine tensors (Horovod's ``hvd.Average`` and friends).

    A ``str`` enum: a member equals (and hashes as) its value, so tables keyed by members answer to
    the plain string too."""

    AVERAGE = "average"  # a sum on the wire; the engine divides by the number of ranks afterwards
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    ADASUM = "adasum"  # see hvdray/collective/transport/adasum.py


class OpKind(enum.Enum):
    """Which collective an op is; its value is the op's name in messages and on the wire."""

    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"
    ALLTOALL = "alltoall"
    REDUCESCATTER = "reducescatter"
    BARRIER = "barrier"

    def __str__(self) -> str:
        return self.value


#: ops whose every dimension must agree across ranks (the others may differ in dim 0)
SAME_SHAPE_KINDS = frozenset((OpKind.ALLREDUCE, OpKind.BROADCAST, OpKind.REDUCESCATTER))
#: the ops whose unnamed calls have families (:func:`family_variants`), by the start of their generated names (the
#: engine's ``auto_name``): kind, and whether it is a grouped op's (its members named ``<name>.<i>``)
_FAMILY_OPS = {
    **{kind.value: (kind, False) for kind in (
        OpKind.ALLREDUCE, OpKind.ALLGATHER, OpKind.BROADCAST, OpKind.REDUCESCATTER, OpKind.ALLTOALL)},
    **{f"grouped_{kind.value}": (kind, True) for kind in (OpKind.ALLREDUCE, OpKind.ALLGATHER, OpKind.REDUCESCATTER)},
}

_DTYPE_OF_NAME: dict[str, torch.dtype] = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


@dataclass(slots=True)
class OpDesc:
    """One op as one rank submitted it: what every rank must agree on before it runs.

    Built for every gradient of every step, so the constructor validates nothing (the frontends'
    argument checks did). ``shape`` may be the tensor's own ``torch.Size`` (a tuple)."""

    name: str
    kind: OpKind
    dtype: Optional[torch.dtype]  # None for a barrier
    shape: Sequence[int]
    reduce_op: Optional[ReduceOp] = None  # allreduce and reducescatter
    prescale: float = 1.0
    postscale: float = 1.0
    root: Optional[int] = None  # broadcast: the root's rank in the process set
    splits: Optional[list[int]] = None  # alltoall: rows sent to each rank (None: even)
    generated: bool = False  # an engine-generated name, which never repeats: never cached (its family may be)

    @property
    def nbytes(self) -> int:
        """Bytes of the op's tensor on this rank."""
        return math.prod(self.shape) * self.dtype.itemsize if self.dtype is not None else 0

    def matches(self, other: "OpDesc") -> bool:
        """The same op apart from its name: the response cache's test that a request fits its slot
        (run for every cached op of every step, so the cheap and telling fields come first)."""
        return (
            self.shape == other.shape and self.kind is other.kind and self.dtype is other.dtype
            and self.reduce_op is other.reduce_op and self.prescale == other.prescale
            and self.postscale == other.postscale and self.root == other.root and self.splits == other.splits
        )

    def to_wire(self) -> list[Any]:
        """The JSON-ready form sent while the name is negotiated."""
        return [
            self.kind.value, self.name, "" if self.dtype is None else str(self.dtype), list(self.shape),
            None if self.reduce_op is None else self.reduce_op.value, self.prescale, self.postscale, self.root,
            self.splits, 1 if self.generated else 0,
        ]

    @classmethod
    def from_wire(cls, wire: Sequence[Any]) -> "OpDesc":
        """A peer's :meth:`to_wire` back; a ValueError if it is not one."""
        try:
            kind, name, dtype, shape, reduce_op, pre, post, root, splits, generated = wire
            return cls(
                str(name), OpKind(kind), _DTYPE_OF_NAME[dtype] if dtype else None, tuple(int(n) for n in shape),
                None if reduce_op is None else ReduceOp(reduce_op), float(pre), float(post),
                None if root is None else int(root), None if splits is None else [int(n) for n in splits],
                bool(generated),
            )
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"not an op description: {wire!r}") from exc

    def describe(self, field_name: str) -> Any:
        """A field's value as messages print it (a shape as a list, an enum as its value)."""
        value = getattr(self, field_name)
        if field_name == "shape":
            return list(value)
        return value.value if isinstance(value, enum.Enum) else value


#: :func:`generated_parts` of a generated name: its call's name, the op's kind, what follows the counter
GeneratedParts = tuple[str, OpKind, str]

#: what follows the mark in a generated name (:func:`generated_parts`): ``[C.]N`` and a NaN mask's suffix, or a
#: grouped op's ``[C.]N.i`` and the suffix (the counters' regex backtracks to leave the member's index)
_COUNTERS = r"(\d+(?:\.\d+)?)"
_AFTER_COUNTER = {
    False: re.compile(_COUNTERS + "(" + re.escape(NAN_MASK_SUFFIX) + ")?"),
    True: re.compile(_COUNTERS + r"(\.\d+(?:" + re.escape(NAN_MASK_SUFFIX) + ")?)"),
}


@functools.lru_cache(maxsize=256)  # the engine reads an unnamed call's name more than once while sorting it
def generated_parts(name: str) -> Optional[GeneratedParts]:
    """An unnamed collective's generated name (``allreduce.noname.N``, ``allreduce.noname.C.N`` in executor
    call C, a grouped op's member ``grouped_allreduce.noname.C.N.i``, a min's or max's NaN mask
    ``allreduce.noname.C.N.nan``) cut in three: its call's name (up to the counter N, which one call's
    requests share), the op's kind, and what follows the counter; None for any other name (a named op's, an
    object's, a barrier's, a sparse allreduce's)."""
    op, mark, rest = name.partition(GENERATED_NAME_MARK)
    known = _FAMILY_OPS.get(op) if mark else None
    if known is None:
        return None
    kind, grouped = known
    found = _AFTER_COUNTER[grouped].fullmatch(rest)
    if found is None:
        return None
    counters, after = found.groups()
    return f"{op}{mark}{counters}", kind, after or ""


#: how many consecutive unnamed calls of one op may be in flight at once and still go by their families' slots:
#: a family has this many variants, one for each remainder of the calls' counter (:func:`family_variants`), each a
#: slot of the response cache
FAMILY_VARIANTS = 8

#: :func:`family_variants` of an unnamed op: its family, the response cache's names of the family's
#: :data:`FAMILY_VARIANTS` variants, and the variant of the op's own counter
FamilyVariants = tuple[str, tuple[str, ...], int]


def family_variants(desc: OpDesc, parts: Optional[GeneratedParts] = None) -> Optional[FamilyVariants]:
    """The family of an unnamed collective (``desc``'s executor call and description, a grouped op's member by its
    place in the group, a NaN mask as such), the response cache's names of its :data:`FAMILY_VARIANTS` variants
    (``"<family> #<v>"``), and the variant of the op's own counter (its remainder by :data:`FAMILY_VARIANTS`);
    None for a named op (or an object's, a barrier's, a sparse allreduce's). ``parts``: :func:`generated_parts`
    of ``desc.name``, where the caller has it already.

    Unnamed ops get a new generated name each call, so they cannot be cached by name; the engine caches their
    family instead, every variant at once, and an unnamed call's ops go by their families' slots when every
    rank's oldest pending one has the same generated names (``hvdray/collective/engine/agreement.py``).
    Consecutive calls of an op have consecutive counters on every rank, so up to :data:`FAMILY_VARIANTS`
    consecutive calls in flight at once, of one family or several, wait on as many slots. Every rank that
    agreed on a generated name makes the same family names from the lowest rank's description.

    The family holds what must agree across ranks: kind, dtype, reduction, scale factors, root, and the
    shape, but for an allgather's or alltoall's first dimension (each rank's own; the cache's description of
    this rank checks it, :meth:`ResponseCache.lookup`), so that uneven ranks share a family too. The names
    are made once for the calls of a loop (:func:`_family`): the engine asks for every unnamed op it sorts."""
    if parts is None:
        parts = generated_parts(desc.name)
    if parts is None or parts[1] is not desc.kind:
        return None
    call_name, kind, after = parts
    prefix, _, counter = call_name.rpartition(".")
    shape = desc.shape if kind in SAME_SHAPE_KINDS else desc.shape[1:]  # allgather, alltoall: rows their own
    family, names = _family(prefix, after, desc.dtype, tuple(shape), desc.reduce_op, desc.prescale, desc.postscale,
                            desc.root)
    return family, names, int(counter) % FAMILY_VARIANTS


@functools.lru_cache(maxsize=256, typed=True)  # typed: a scale factor 1 and 1.0 print apart
def _family(
    prefix: str, after: str, dtype: Optional[torch.dtype], shape: tuple[int, ...],
    reduce_op: Optional[ReduceOp], prescale: float, postscale: float, root: Optional[int],
) -> tuple[str, tuple[str, ...]]:
    """:func:`family_variants`' family and its variants' names, from what the family holds."""
    family = (
        f"{prefix}.*{after} ({dtype} {list(shape)} "
        f"{reduce_op.value if reduce_op else None} {prescale!r} {postscale!r} {root})"
    )
    return family, tuple(f"{family} #{variant}" for variant in range(FAMILY_VARIANTS))


def barrier_desc(name: str) -> OpDesc:
    """A barrier's description: no tensor, and a generated name (barriers are never cached)."""
    return OpDesc(name, OpKind.BARRIER, None, (), generated=True)
