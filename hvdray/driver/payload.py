"""What a call ships to every worker, measured: a warning naming the function, argument or captured
variable that is large, before Ray pickles it once per worker, and an error naming the one that cannot be
pickled at all.

Sizes are measured by pickling with Ray's cloudpickle into a byte counter (nothing is kept), with
pickle protocol 5's out-of-band buffers (NumPy arrays and the like) counted by size, not copied.
"""

from __future__ import annotations

import types
import warnings
from typing import Any, Callable, Iterable, Optional

import ray.cloudpickle as cloudpickle

_MIB = 1 << 20


class LargePayloadWarning(UserWarning):
    """A function or argument sent to every worker pickles to more than ``payload_warning_mb``."""


class _ByteCounter:
    """A write-only file that only counts what is written to it."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: Any) -> int:
        length = memoryview(data).nbytes
        self.size += length
        return length


def _measure(value: Any) -> int:
    """Bytes ``value`` takes pickled with Ray's cloudpickle (raises what pickling it raises)."""
    counter = _ByteCounter()

    def out_of_band(buffer: Any) -> bool:
        counter.size += buffer.raw().nbytes
        return False  # keep it out of the stream: counted, never copied

    cloudpickle.Pickler(counter, protocol=5, buffer_callback=out_of_band).dump(value)
    return counter.size


def pickled_size(value: Any) -> Optional[int]:
    """Bytes ``value`` takes pickled with Ray's cloudpickle, or None if it cannot be pickled."""
    try:
        return _measure(value)
    except Exception:  # noqa: BLE001 - any pickling failure
        return None


def _captured(fn: Callable[..., Any]) -> Iterable[tuple[str, Any]]:
    """The variables a function carries when cloudpickle ships it by value: closure cells and the
    globals its code names (modules and other importable functions go by reference)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            yield name, cell.cell_contents
        except ValueError:  # an empty cell
            continue
    scope = getattr(fn, "__globals__", {})
    for name in code.co_names:
        if name in scope and not isinstance(scope[name], types.ModuleType):
            yield name, scope[name]


def _function_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def call_pieces(args: Any, kwargs: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(label, value)`` for each positional and keyword argument: ``args[0]``, ``kwargs['data']``."""
    pieces = [(f"{prefix}args[{i}]", value) for i, value in enumerate(args or ())]
    pieces += [(f"{prefix}kwargs[{key!r}]", value) for key, value in (kwargs or {}).items()]
    return pieces


class PayloadGuard:
    """Warns, once per executor and piece, when a piece of a call sent to every worker is large, and
    raises ``TypeError`` naming a piece that cannot be pickled (Ray's own error names its internal actor
    method, and a function's, not the captured variable at fault). With ``payload_warning_mb`` 0 nothing
    is measured, and Ray reports an unpicklable piece itself."""

    def __init__(self, limit_mb: float) -> None:
        self._limit = limit_mb * _MIB
        self._limit_mb = limit_mb
        self._warned: set[str] = set()

    def check(self, call: str, workers: int, fn: Any = None, pieces: Iterable[tuple[str, Any]] = (),
              stacklevel: int = 4) -> None:
        """``call`` (``"run()"``) is about to send ``fn`` and each ``(label, value)`` of ``pieces`` to
        ``workers`` workers; warn about each one over the limit (the function naming its largest
        captured variable). ``stacklevel`` points the warning at the user's line."""
        if not self._limit:
            return
        large: list[str] = []
        if fn is not None and f"fn {_function_name(fn)}" not in self._warned:
            try:
                size = _measure(fn)
            except Exception as exc:  # noqa: BLE001 - any pickling failure, reported by name
                raise TypeError(f"{call}: {self._unpicklable_function(fn, exc)}") from exc
            if size > self._limit:
                self._warned.add(f"fn {_function_name(fn)}")
                large.append(self._describe_function(fn, size))
        for label, value in pieces:
            if label in self._warned:
                continue
            try:
                size = _measure(value)
            except Exception as exc:  # noqa: BLE001 - any pickling failure, reported by name
                raise TypeError(f"{call}: {label} ({type(value).__name__}) cannot be pickled to be sent to the "
                                f"workers: {exc}") from exc
            if size > self._limit:
                self._warned.add(label)
                large.append(f"{label} ({type(value).__name__}) pickles to {size / _MIB:.1f} MiB")
        if large:
            warnings.warn(
                f"hvdray: {call} sends to each of its {workers} worker(s): {'; '.join(large)}. Ray copies it "
                "for every worker and every call: put it in Ray's object store once (ref = ray.put(value)), "
                "pass the ref and call ray.get(ref) in the function, or build the data on the workers. "
                f"Warned above payload_warning_mb={self._limit_mb:g} (HVDRAY_PAYLOAD_WARNING_MB; 0 turns it off).",
                LargePayloadWarning,
                stacklevel=stacklevel,
            )

    @staticmethod
    def _unpicklable_function(fn: Any, exc: Exception) -> str:
        text = f"the function {_function_name(fn)!r} cannot be pickled to be sent to the workers"
        for name, value in _captured(fn):
            if pickled_size(value) is None:
                return (f"{text}: the variable {name!r} it captures ({type(value).__name__}) cannot ({exc}); "
                        "create it inside the function, or pass what it is made from as an argument")
        return f"{text}: {exc}"

    def _describe_function(self, fn: Any, size: int) -> str:
        text = f"the function {_function_name(fn)!r} pickles to {size / _MIB:.1f} MiB"
        sizes = [(pickled_size(value) or 0, name) for name, value in _captured(fn)]
        if sizes:
            biggest, name = max(sizes)
            if biggest > size / 2:
                text += f", {biggest / _MIB:.1f} MiB of it the variable {name!r} it captures"
        return text
