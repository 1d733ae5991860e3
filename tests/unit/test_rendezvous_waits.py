"""The coordinator's rendezvous waits on their own (no Ray): a wait for many keys ends when its last key
arrives, once, however many readers wait; it ends ``superseded`` at once when its epoch is over,
``timeout`` at its timeout, and waits again for a key deleted meanwhile; records come back as one reader's
parts when asked."""

from __future__ import annotations

import asyncio
import hashlib

from hvdray.collective import gloo_record
from hvdray.collective.topology import WorkerSlot
from hvdray.driver.coordinator import Coordinator

TOKEN = b"t" * 32


async def _coordinator(size: int = 2) -> tuple[Coordinator, int]:
    coordinator = Coordinator(hashlib.sha256(TOKEN).digest())
    slots = [WorkerSlot(node_id="n", hostname="h", ip="10.0.0.1") for _ in range(size)]
    epoch, _, _ = await coordinator.assign(TOKEN, slots)
    return coordinator, epoch


def test_many_readers_of_many_keys_end_when_the_last_key_arrives():
    async def scenario() -> None:
        coordinator, epoch = await _coordinator()
        keys = [f"e{epoch}/g/0/{r}" for r in range(64)]
        readers = [asyncio.ensure_future(coordinator.kv_read(TOKEN, keys, 30.0)) for _ in range(64)]
        for key in keys[:-1]:
            await coordinator.kv_set(TOKEN, key, key.encode())
        await asyncio.sleep(0.05)
        assert not any(reader.done() for reader in readers)  # every reader still misses the last key
        await coordinator.kv_set(TOKEN, keys[-1], b"last")
        answers = await asyncio.wait_for(asyncio.gather(*readers), 5.0)
        assert all(answer == ("ok", [k.encode() for k in keys[:-1]] + [b"last"]) for answer in answers)
        assert coordinator._key_waits == {} and coordinator._shared_waits == {}  # nothing is left registered

    asyncio.run(scenario())


def test_readers_of_the_same_keys_share_one_wait_and_a_timed_out_reader_leaves_the_others_waiting():
    async def scenario() -> None:
        coordinator, epoch = await _coordinator()
        keys = [f"e{epoch}/g/0/{r}" for r in range(8)]
        await coordinator.kv_set(TOKEN, keys[0], b"0")
        early = [asyncio.ensure_future(coordinator.kv_read(TOKEN, keys, 30.0, (r, 8))) for r in range(4)]
        impatient = asyncio.ensure_future(coordinator.kv_wait(TOKEN, keys, 0.05))
        await asyncio.sleep(0.01)
        # one wait, registered once on each missing key, for the five readers
        assert len(coordinator._shared_waits) == 1
        assert all(len(waits) == 1 for waits in coordinator._key_waits.values()) and len(coordinator._key_waits) == 7
        assert await impatient == "timeout"
        for key in keys[1:5]:
            await coordinator.kv_set(TOKEN, key, b"x")
        late = [asyncio.ensure_future(coordinator.kv_read(TOKEN, keys, 30.0, (r, 8))) for r in range(4, 8)]
        await asyncio.sleep(0.01)
        assert len(coordinator._shared_waits) == 1 and len(coordinator._key_waits) == 3  # the late ones joined it
        assert not any(reader.done() for reader in early + late)
        for key in keys[5:]:
            await coordinator.kv_set(TOKEN, key, b"x")
        answers = await asyncio.wait_for(asyncio.gather(*early, *late), 5.0)
        assert [status for status, _ in answers] == ["ok"] * 8
        assert coordinator._key_waits == {} and coordinator._shared_waits == {}
        # the last reader to time out forgets the wait: nothing stays registered
        lonely = [asyncio.ensure_future(coordinator.kv_wait(TOKEN, [f"e{epoch}/none"], 0.05)) for _ in range(3)]
        assert await asyncio.gather(*lonely) == ["timeout"] * 3
        assert coordinator._key_waits == {} and coordinator._shared_waits == {}

    asyncio.run(scenario())


def test_a_wait_ends_superseded_at_once_when_its_epoch_is_abandoned_or_replaced():
    async def scenario() -> None:
        coordinator, epoch = await _coordinator()
        waiting = asyncio.ensure_future(coordinator.kv_wait(TOKEN, [f"e{epoch}/a", f"e{epoch}/b"], 60.0))
        await coordinator.kv_set(TOKEN, f"e{epoch}/a", b"1")
        await asyncio.sleep(0.01)
        await coordinator.abandon(TOKEN, epoch)
        assert await asyncio.wait_for(waiting, 1.0) == "superseded"
        assert await coordinator.kv_wait(TOKEN, [f"e{epoch}/a"], 60.0) == "superseded"  # and new waits too

        coordinator, epoch = await _coordinator()
        waiting = asyncio.ensure_future(coordinator.kv_wait(TOKEN, [f"e{epoch}/x"], 60.0))
        await asyncio.sleep(0.01)
        newer, _, _ = await coordinator.assign(TOKEN, [WorkerSlot(node_id="n", hostname="h", ip="10.0.0.1")] * 2)
        assert newer == epoch + 1
        assert await asyncio.wait_for(waiting, 1.0) == "superseded"

    asyncio.run(scenario())


def test_a_wait_times_out_and_waits_again_for_a_key_deleted_meanwhile():
    async def scenario() -> None:
        coordinator, epoch = await _coordinator()
        assert await coordinator.kv_wait(TOKEN, [f"e{epoch}/never"], 0.05) == "timeout"
        assert coordinator._key_waits == {}  # a wait that timed out is forgotten
        cancelled = asyncio.ensure_future(coordinator.kv_wait(TOKEN, [f"e{epoch}/never"], 60.0))
        await asyncio.sleep(0.01)
        cancelled.cancel()  # the caller went away
        await asyncio.sleep(0.01)
        assert coordinator._key_waits == {} and coordinator._shared_waits == {}
        a, b = f"e{epoch}/a", f"e{epoch}/b"
        await coordinator.kv_set(TOKEN, a, b"1")
        waiting = asyncio.ensure_future(coordinator.kv_read(TOKEN, [a, b], 60.0))
        await asyncio.sleep(0.01)
        coordinator.kv_delete(TOKEN, a)
        await coordinator.kv_set(TOKEN, b, b"2")  # b completes the wait, but a is gone again
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await coordinator.kv_set(TOKEN, a, b"3")
        assert await asyncio.wait_for(waiting, 1.0) == ("ok", [b"3", b"2"])

    asyncio.run(scenario())


def test_a_read_for_a_reader_answers_each_record_as_that_readers_part():
    async def scenario() -> None:
        coordinator, epoch = await _coordinator()
        record = gloo_record.record(b"h", b"address", [7, 8, 9])
        await coordinator.kv_set(TOKEN, f"e{epoch}/0/0", record)
        await coordinator.kv_set(TOKEN, f"e{epoch}/shm", b"segment")
        status, answer = await coordinator.kv_read(TOKEN, [f"e{epoch}/0/0", f"e{epoch}/shm"], 1.0, (1, 3))
        assert status == "ok"
        parts = gloo_record.parts(*answer)
        assert parts == [gloo_record.part_for(record, 1, 3), gloo_record.part_for(b"segment", 1, 3)]
        assert gloo_record.as_read_by(parts[0], 1, 3) == gloo_record.record(b"h", b"address", [0, 8, 0])
        assert gloo_record.as_read_by(parts[1], 1, 3) == b"segment"

    asyncio.run(scenario())
