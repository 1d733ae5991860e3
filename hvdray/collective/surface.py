"""The op surface every frontend offers, declared once: each collective op and the forms it comes in.

An op's forms are Horovod's naming scheme: ``allreduce`` returns the result, ``allreduce_async`` a
handle to ``synchronize``, ``allreduce_`` writes the result into its input, ``allreduce_async_`` does
that behind a handle. A frontend offers the forms its framework can (``hvdray.torch`` all of them,
``hvdray.tensorflow`` the blocking one) and names its functions with :func:`names`; :func:`forms`
makes an op's forms from one function body, so their signature is written once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from hvdray.collective.protocol import ReduceOp


class Form(enum.Enum):
    """How a call of an op hands back its result; the value is the suffix of the op's name."""

    BLOCKING = ""
    ASYNC = "_async"
    INPLACE = "_"
    INPLACE_ASYNC = "_async_"

    @property
    def inplace(self) -> bool:
        """The result is written into the input tensor(s)."""
        return self in (Form.INPLACE, Form.INPLACE_ASYNC)

    @property
    def blocking(self) -> bool:
        """The call returns the result, not a handle."""
        return self in (Form.BLOCKING, Form.INPLACE)


_FORM_DOCS = {
    Form.BLOCKING: "",
    Form.ASYNC: "Returns a handle; ``synchronize(handle)`` returns the result.",
    Form.INPLACE: "The result is written into the input, which is returned.",
    Form.INPLACE_ASYNC: "Returns a handle; ``synchronize(handle)`` returns the input, holding the result.",
}

ALL_FORMS = tuple(Form)
BLOCKING_AND_ASYNC = (Form.BLOCKING, Form.ASYNC)
BLOCKING_ONLY = (Form.BLOCKING,)


@dataclass(frozen=True)
class OpSpec:
    """One collective op of the surface and the forms it has."""

    name: str
    forms: tuple[Form, ...]

    def function_name(self, form: Form) -> str:
        """The op's name in ``form``: ``allreduce_async_`` for allreduce, in place and asynchronous."""
        return self.name + form.value


OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec("allreduce", ALL_FORMS),
        OpSpec("grouped_allreduce", ALL_FORMS),
        OpSpec("broadcast", ALL_FORMS),
        OpSpec("allgather", BLOCKING_AND_ASYNC),
        OpSpec("alltoall", BLOCKING_AND_ASYNC),
        OpSpec("reducescatter", BLOCKING_AND_ASYNC),
        OpSpec("grouped_allgather", BLOCKING_AND_ASYNC),
        OpSpec("grouped_reducescatter", BLOCKING_AND_ASYNC),
        OpSpec("barrier", BLOCKING_ONLY),
        OpSpec("join", BLOCKING_ONLY),
        OpSpec("broadcast_object", BLOCKING_ONLY),
        OpSpec("allgather_object", BLOCKING_ONLY),
    )
}

#: Horovod's names of the reduce ops (``hvd.Average`` ...), as every frontend exports them.
REDUCE_OPS: tuple[str, ...] = tuple(op.name.title() for op in ReduceOp)


def names(offered: Iterable[Form], ops: Iterable[str] = OPS) -> list[str]:
    """The function names of ``ops`` in each of the ``offered`` forms that op has, in declaration order."""
    offered = tuple(offered)
    return [OPS[op].function_name(form) for op in ops for form in OPS[op].forms if form in offered]


def forms(op: str, build: Callable[[Form], Callable[..., Any]], *wanted: Form) -> tuple[Callable[..., Any], ...]:
    """``build(form)`` for each ``wanted`` form of ``op``, named and documented as that form.

    ``build`` returns the op's function for one form: one body, written once, that reads
    ``form.inplace`` and ``form.blocking`` when it is built, so each form calls the collective layer as
    directly as a function written by hand. Its docstring describes the op; the form's sentence is added.
    """
    spec = OPS[op]
    made = []
    for form in wanted:
        if form not in spec.forms:
            raise ValueError(f"{op} has no {form.name.lower()} form (it has {[f.name.lower() for f in spec.forms]})")
        function = build(form)
        function.__name__ = function.__qualname__ = spec.function_name(form)
        function.__doc__ = " ".join(part for part in (function.__doc__, _FORM_DOCS[form]) if part)
        made.append(function)
    return tuple(made)
