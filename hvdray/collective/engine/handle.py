"""What one submitted op is to its caller (:class:`Handle`) and to the engine (:class:`Request`)."""

from __future__ import annotations

import _thread
from typing import Any, Callable, Optional

import torch

from hvdray.collective.protocol import OpDesc


class Handle:
    """The future of one submitted op: ``done()`` polls, ``wait()`` blocks and returns or raises.

    A bare lock serves as the one-shot latch (held until the op finishes): far cheaper to create than
    a ``threading.Event``, which matters with hundreds of gradients per step.
    """

    __slots__ = ("_latch", "_done", "_result", "_error", "name", "_on_wait")

    def __init__(self, name: str) -> None:
        self.name = name
        # the engine's nudge: someone now waits on this op (True: blocks until it finishes; False: polls)
        self._on_wait: Optional[Callable[["Handle", bool], None]] = None
        self._latch = _thread.allocate_lock()
        self._latch.acquire()
        self._done = False
        self._result: Any = None
        self._error: Optional[BaseException] = None

    def done(self) -> bool:
        """True once the op finished; a poll also tells the engine that someone wants it now."""
        if not self._done and self._on_wait is not None:
            self._on_wait(self, False)  # someone polls: they want this op now, not at the end of a batching window
        return self._done

    def wait(self, timeout: Optional[float] = None) -> Any:
        """The op's result (or its error raised), once it has finished."""
        if self._on_wait is not None:
            # the caller waits: the engine hurries the op if it is still pending, and its step ends here
            # (also when the op already finished: an engine faster than its caller must learn steps too)
            self._on_wait(self, timeout is None)
        if not self._done:
            if not self._latch.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError(f"op {self.name!r} did not finish within {timeout} s")
            self._latch.release()
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result, self._error = result, error
        self._done = True
        self._latch.release()

    def _settle(self, result: Any = None) -> None:
        """Keep the op's result for the caller, who does not see it before :func:`open_settled` opens the handle."""
        self._result = result

    def _done_latch(self) -> Any:
        """Mark the settled op done and give its latch to open (see :func:`open_settled`)."""
        self._done = True
        return self._latch


def open_settled(handles: list[Handle]) -> None:
    """Open each settled handle of ``handles``, emptying the list. The caller may drop the op's result the
    moment it sees the op done, and expects its memory free then (the output pool gives the next op of the size
    the same warm block): the opening thread must hold nothing that leads to the result by then. Each handle
    leaves the list and this frame before its latch opens, and the latch alone stays here."""
    while handles:
        latch = handles.pop()._done_latch()
        latch.release()


class Request:
    """One op submitted on this rank: its description, which every rank sees, plus the local tensors.

    ``output`` (what the op writes) is what the caller gave, except that a tensor made in inference mode
    is written through an ordinary tensor over the same memory: torch refuses in-place writes to an
    inference tensor outside inference mode, and the engine writes from its own thread (or from a tick
    that leaves the caller's mode aside). ``result`` is the output as given, what the handle returns."""

    __slots__ = ("desc", "name", "tensor", "output", "result", "handle", "submitted")

    def __init__(
        self, desc: OpDesc, tensor: Optional[torch.Tensor], output: Optional[torch.Tensor], handle: Handle
    ) -> None:
        self.desc = desc
        self.name = desc.name
        self.tensor = tensor
        self.output = self.result = output
        if output is not None and _is_inference(output):
            self.output = writable_alias(output)
            if tensor is output:  # in place: the engine must still see one tensor
                self.tensor = self.output
        self.handle = handle
        self.submitted = 0.0  # time.perf_counter() at submission, taken only while a timeline records


def _is_inference(tensor: torch.Tensor) -> bool:
    """``tensor.is_inference()``, asked without a call that releases the GIL (as that one does: between
    the hundreds of gradients a step submits, that lets the engine thread in before the step is whole): an
    inference tensor has no version counter."""
    try:
        tensor._version
    except RuntimeError:
        return tensor.is_inference()
    return False


def writable_alias(tensor: torch.Tensor) -> torch.Tensor:
    """An ordinary (not inference) tensor over ``tensor``'s memory, shape and strides, which any thread
    may write in place under ``torch.no_grad()``."""
    with torch.inference_mode(False):
        return torch.empty(0, dtype=tensor.dtype).set_(
            tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride()
        )
