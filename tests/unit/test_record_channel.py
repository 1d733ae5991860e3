"""The worker record channel on its own: the coordinator numbers records, hands them out from a cursor
(waiting for the next one), drops those the driver acknowledged; the driver hands each on once."""

from __future__ import annotations

import asyncio
import hashlib

from hvdray.driver.coordinator import Coordinator
from hvdray.driver.records import RecordStream

TOKEN = b"t" * 32


def test_records_are_numbered_waited_for_and_dropped_once_acknowledged():
    async def scenario() -> None:
        coordinator = Coordinator(hashlib.sha256(TOKEN).digest())
        await coordinator.push_log(TOKEN, 1, {"epoch": 0})
        await coordinator.push_report(TOKEN, 0, {"loss": 1.0}, "/storage/checkpoint_000000")
        log = ({"rank": 1, "epoch": 0}, None)
        report = ({"rank": 0, "loss": 1.0}, ({"loss": 1.0}, "/storage/checkpoint_000000"))
        assert await coordinator.records(TOKEN, None, 0.0) == (0, [log, report])
        assert await coordinator.records(TOKEN, 1, 0.0) == (1, [report])  # record 0 acknowledged: dropped
        assert await coordinator.records(TOKEN, None, 0.0) == (1, [report])  # a new reader: the oldest kept
        assert await coordinator.records(TOKEN, 0, 0.0) == (1, [report])  # a stale cursor gets no dropped one

        waiting = asyncio.ensure_future(coordinator.records(TOKEN, 2, 30.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # nothing new: it waits ...
        await coordinator.push_log(TOKEN, 0, {"epoch": 1})
        assert await asyncio.wait_for(waiting, 5.0) == (2, [({"rank": 0, "epoch": 1}, None)])  # ... until one comes
        assert await coordinator.records(TOKEN, 3, 0.05) == (3, [])  # or its timeout passes

    asyncio.run(scenario())


def test_the_driver_hands_overlapping_answers_on_once_each_in_order():
    def stream() -> RecordStream:
        records = RecordStream(lambda: None, lambda call, what: None)
        records.on_report = lambda metrics, path: reports.append((metrics, path))
        return records

    seen, reports = [], []
    records = stream()
    record = lambda n: ({"rank": 0, "n": n}, ({"n": n}, None) if n == 1 else None)  # noqa: E731
    records.hand_on((3, [record(3), record(4)]), [seen.append])  # the first answer starts at the oldest kept
    records.hand_on((3, [record(3), record(4), record(5)]), [seen.append])  # a waiting call's, overlapping
    records.hand_on((6, []), [seen.append])
    assert [r["n"] for r in seen] == [3, 4, 5]
    records.hand_on((6, [record(6)]), [seen.append])
    records.hand_on((5, [record(5), record(6)]), [seen.append])  # an older answer: nothing new in it
    assert [r["n"] for r in seen] == [3, 4, 5, 6] and reports == []
    other = stream()
    other.hand_on((1, [record(1)]), [])
    other.hand_on((1, [record(1), record(2)]), [])
    assert reports == [({"n": 1}, None)]  # rank 0's report, handed on once


def test_records_are_kept_in_the_order_their_sender_numbered_them(monkeypatch):
    """Ray may run an async actor's calls out of the order one worker sent them: a record waits for those
    its sender numbered before it, and a gap left by a record that never comes is skipped after
    RECORD_GAP_S."""
    from hvdray.driver import coordinator as module

    async def scenario() -> None:
        coordinator = Coordinator(hashlib.sha256(TOKEN).digest())
        await coordinator.push_log(TOKEN, 0, {"epoch": 2}, ("a", 1))  # arrives before number 0
        await coordinator.push_log(TOKEN, 1, {"epoch": 1}, ("b", 0))  # another sender is not held up
        assert await coordinator.records(TOKEN, None, 0.0) == (0, [({"rank": 1, "epoch": 1}, None)])
        await coordinator.push_report(TOKEN, 0, {"epoch": 1}, None, ("a", 0))
        kept = [record for record, _ in (await coordinator.records(TOKEN, None, 0.0))[1]]
        assert kept == [{"rank": 1, "epoch": 1}, {"rank": 0, "epoch": 1}, {"rank": 0, "epoch": 2}]

        await coordinator.push_log(TOKEN, 0, {"epoch": 4}, ("a", 3))  # number 2 never comes
        assert len((await coordinator.records(TOKEN, None, 0.0))[1]) == 3
        monkeypatch.setattr(module, "RECORD_GAP_S", 0.0)
        kept = [record for record, _ in (await coordinator.records(TOKEN, None, 0.0))[1]]
        assert kept[-1] == {"rank": 0, "epoch": 4}
        await coordinator.push_log(TOKEN, 0, {"epoch": 5}, ("a", 4))  # and it goes on after the gap
        assert [r for r, _ in (await coordinator.records(TOKEN, None, 0.0))[1]][-1] == {"rank": 0, "epoch": 5}

    asyncio.run(scenario())
