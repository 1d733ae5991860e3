"""Interrupts held back while the main thread is in the middle of the engine's bookkeeping.

Ctrl-C, a notebook's *interrupt kernel* and anything else that goes through Python's SIGINT handler
raise ``KeyboardInterrupt`` in the main thread at whatever line it is on. Some of the engine's work runs
on the caller's thread: a caller's tick (``Engine._tick_for``) runs whole collectives there, and a
gradient hook submits an op and records its handle. Stopped halfway, the first breaks the ring (every
later op fails), the second leaves an op in flight that nobody waits for or submits it twice.

While the main thread is inside such a section (``with INTERRUPTS:``), SIGINT's handler only notes
the signal; when the outermost section ends, the handler it stands in for runs with it (Python's
default raises ``KeyboardInterrupt`` there, after the section's work is consistent). Other threads never
run signal handlers, so they hold nothing. The stand-in is installed the first time the main thread
enters a section, over whatever callable handler is there then (a user's own included); a handler that
is not a callable (``SIG_IGN``, ``SIG_DFL``) is left alone. A section lasts as long as its work: a
caller's tick waits for peers that have already agreed to run its op, so at most until the stall bound.
"""

from __future__ import annotations

import _signal
import signal
import threading
from types import FrameType
from typing import Any, Callable, Optional

_MAIN_THREAD = threading.main_thread().ident
_get_ident = threading.get_ident


class InterruptHold:
    """A process's SIGINT stand-in and the main thread's depth of held sections (use :data:`INTERRUPTS`)."""

    def __init__(self) -> None:
        self.depth = 0  # held sections the main thread is in
        self.pending: Optional[tuple[int, Optional[FrameType]]] = None  # a SIGINT noted while held
        #: SIGINTs the stand-in has seen, held or not (an optimizer tells an interrupted step by it)
        self.delivered = 0
        self._standing_in_for: Optional[Callable[[int, Optional[FrameType]], Any]] = None
        self._handler = self._on_signal  # one bound method, so that "is it installed" is an identity check

    def __enter__(self) -> None:
        if _get_ident() == _MAIN_THREAD:
            if not self.depth and _signal.getsignal(signal.SIGINT) is not self._handler:
                self._install()
            self.depth += 1

    def __exit__(self, *exc: Any) -> None:
        if _get_ident() == _MAIN_THREAD:
            self.depth -= 1
            if not self.depth and self.pending is not None:
                (signum, frame), self.pending = self.pending, None
                self._pass_on(signum, frame)

    def release(self) -> None:
        """Put the handler back that the stand-in replaced (hvd.shutdown), unless a section is open or
        someone has installed another handler since."""
        if _get_ident() == _MAIN_THREAD and not self.depth and _signal.getsignal(signal.SIGINT) is self._handler:
            signal.signal(signal.SIGINT, self._standing_in_for)
            self._standing_in_for = None

    def _install(self) -> None:
        current = _signal.getsignal(signal.SIGINT)
        if callable(current):
            self._standing_in_for = current
            signal.signal(signal.SIGINT, self._handler)

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        self.delivered += 1
        if self.depth:
            self.pending = (signum, frame)
        else:
            self._pass_on(signum, frame)

    def _pass_on(self, signum: int, frame: Optional[FrameType]) -> None:
        handler = self._standing_in_for
        if callable(handler):
            handler(signum, frame)


#: the process's one hold: ``with INTERRUPTS:`` around work that must not stop halfway on the main thread
INTERRUPTS = InterruptHold()
