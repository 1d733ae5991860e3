"""The driver's end of a job's record channel: what the workers log (``ray_logger.log``) or report
(``hvdray.report``), handed to the run's callbacks and result once each, in the order sent.

The coordinator numbers the records and keeps them until the driver acknowledges them
(``Coordinator.records``). The driver keeps one waiting call in flight, which returns as soon as a
record arrives, so that a loop waiting on the workers' calls wakes for records too; answers may
overlap, and each record is handed on once.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import ray

from hvdray.driver.coordinator_host import CoordinatorClient
from hvdray.driver.failures import add_note

#: what ``executor.run(fn, callbacks=[...])`` takes: called with each worker record and elastic event
Callback = Callable[[dict[str, Any]], None]
#: how long one waiting call stays at the coordinator for the next record (then it is made again)
RECORD_WAIT_S = 30.0


def hand_to_callbacks(callbacks: Sequence[Callback], record: dict[str, Any]) -> None:
    """Call each callback with ``record`` (a worker's record or an elastic event). One that raises ends
    the run: its error goes on, with a note naming it."""
    for cb in callbacks:
        try:
            cb(record)
        except Exception as exc:
            add_note(exc, f"hvdray: raised by the callback {getattr(cb, '__qualname__', repr(cb))} of run(); "
                          "the run was stopped, with its workers")
            raise


class RecordStream:
    """Hands one job's records on. ``coordinator()`` is the job's coordinator client (``None`` once the
    job stopped); ``ask(call, what)`` waits for a coordinator call's answer within the job's budget."""

    def __init__(self, coordinator: Callable[[], Optional[CoordinatorClient]],
                 ask: Callable[[ray.ObjectRef, str], Any]) -> None:
        self._coordinator = coordinator
        self._ask = ask
        #: receives rank 0's reports as (metrics, checkpoint path or None): the run's result (driver/results.py)
        self.on_report: Optional[Callable[[dict[str, Any], Optional[str]], None]] = None
        self._after: Optional[int] = None  # the number of the next record to hand on (None: unknown)
        self._waiting: Optional[ray.ObjectRef] = None  # the coordinator call that ends when a record arrives

    def wanted(self, callbacks: Sequence[Callback]) -> bool:
        """Whether anyone takes records (callbacks or a result) and the job's coordinator is there."""
        return (bool(callbacks) or self.on_report is not None) and self._coordinator() is not None

    def arrival(self) -> ray.ObjectRef:
        """The coordinator call (one in flight) that returns as soon as there is a record to hand on."""
        if self._waiting is None:
            self._waiting = self._client().records.remote(self._after, RECORD_WAIT_S)
        return self._waiting

    def deliver(self, callbacks: Sequence[Callback], flush: bool = False) -> None:
        """Hand the records on to each callback, in order; rank 0's reports (metrics, checkpoint path)
        also go to ``on_report``. Without ``flush``: those the waiting call brought, never blocking.
        With ``flush``: every record the coordinator holds now, at the cost of a round trip (after a
        call ended, that is all of its records: a worker's call returns once its records have reached
        the coordinator)."""
        if not self.wanted(callbacks):
            return
        if not flush:
            call = self.arrival()
            if ray.wait([call], timeout=0)[0]:
                self._waiting = None
                self.hand_on(self._ask(call, "a request for records"), callbacks)
            return
        self._drain(callbacks)

    def skip_pending(self) -> None:
        """Acknowledge every record the coordinator holds now without handing it on (those that a failed
        call's workers sent after its result was final)."""
        if self._coordinator() is not None:
            self._drain((), reports=False)

    def _drain(self, callbacks: Sequence[Callback], reports: bool = True) -> None:
        """Ask for records until the coordinator has nothing more, which also acknowledges what was handed on."""
        while True:
            answer = self._ask(self._client().records.remote(self._after, 0.0), "a request for records")
            self.hand_on(answer, callbacks, reports)
            if not answer[1]:
                return

    def hand_on(self, answer: tuple[int, list[Any]], callbacks: Sequence[Callback], reports: bool = True) -> None:
        """Pass on the records of one coordinator answer that were not handed on yet (answers overlap);
        rank 0's reports go to ``on_report`` unless ``reports`` is False."""
        first, records = answer
        done = first if self._after is None else self._after
        for number, (record, report) in enumerate(records, start=first):
            if number < done:
                continue
            self._after = number + 1
            if reports and report is not None and self.on_report is not None:
                self.on_report(*report)
            hand_to_callbacks(callbacks, record)
        if self._after is None:
            self._after = first

    def _client(self) -> CoordinatorClient:
        client = self._coordinator()
        assert client is not None, "the job was stopped"
        return client

    def forget_waiting_call(self) -> None:
        """The job stopped: its waiting call will not be answered."""
        self._waiting = None
