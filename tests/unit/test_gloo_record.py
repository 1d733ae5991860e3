"""Gloo's full-mesh records cut to one reader's part (``hvdray.collective.gloo_record``): a real
``ProcessGroupGloo`` connects and reduces when every record it reads was cut by the coordinator and
rebuilt by the reader's store, and a value that is not a record passes through whole; a full-mesh store
refuses a rank outside its group."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hvdray.collective import gloo_record
from hvdray.collective.transport.mesh_store import FullMeshStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gloo_threads import gloo_group, in_threads  # noqa: E402 - shared by the Gloo unit tests


class _PartsOnly(dist.Store):
    """What the coordinator and a worker's store do to Gloo's records, over a shared HashStore: every
    value read is cut to this rank's part, then rebuilt; the bytes that crossed are counted."""

    def __init__(self, base: dist.HashStore, rank: int, size: int) -> None:
        super().__init__()
        self.base, self.rank, self.size = base, rank, size
        self.stored = self.crossed = 0

    def set(self, key, value):
        self.stored += len(value)
        self.base.set(key, value)

    def get(self, key):
        part = gloo_record.part_for(self.base.get(key), self.rank, self.size)
        self.crossed += len(part)
        return gloo_record.as_read_by(part, self.rank, self.size)

    def wait(self, keys, timeout=None):
        self.base.wait(keys)

    def add(self, key, amount):
        return self.base.add(key, amount)

    def check(self, keys):
        return self.base.check(keys)


@pytest.mark.parametrize("size", [2, 5])
def test_a_real_gloo_group_connects_from_record_parts(size):
    base = dist.HashStore()
    stores = [_PartsOnly(base, rank, size) for rank in range(size)]

    groups = in_threads(size, lambda rank: gloo_group(stores[rank], rank, size))

    def reduce(rank):
        tensor = torch.full((3,), float(rank + 1))
        groups[rank].allreduce([tensor]).wait()
        return tensor.tolist()

    assert in_threads(size, reduce) == [[size * (size + 1) / 2] * 3] * size
    # each rank read every record, but only the record's header and its own pair identifier crossed
    record = stores[0].stored
    assert all(s.stored == record for s in stores)
    assert all(s.crossed == size * (1 + record - 8 * size + 8) for s in stores)


def test_the_part_holds_the_header_and_the_readers_own_pair_id_only():
    record = gloo_record.record(b"host-a", b"\x07" * 20, [10, 11, 12, 13])
    part = gloo_record.part_for(record, 2, 4)
    assert len(part) == 1 + 16 + 6 + 20 + 8
    rebuilt = gloo_record.as_read_by(part, 2, 4)
    assert rebuilt == gloo_record.record(b"host-a", b"\x07" * 20, [0, 0, 12, 0])
    assert len(rebuilt) == len(record)


@pytest.mark.parametrize("value", [
    b"", b"rank 3's shared-memory segment", b"\x01" * 7,
    gloo_record.record(b"h", b"addr", [1, 2, 3]),  # a record of a group of 3, read as one of 4
    gloo_record.record(b"h", b"addr", []),  # Gloo's lazy connect publishes no pair ids
])
def test_a_value_that_is_not_a_record_of_the_group_passes_whole(value):
    assert gloo_record.as_read_by(gloo_record.part_for(value, 1, 4), 1, 4) == value


def test_a_groups_cuts_kept_for_all_its_readers_equal_one_off_cuts_and_follow_new_values():
    cuts = gloo_record.RecordCuts()

    def read(values, reader, size):
        return gloo_record.parts(*cuts.parts_for(values, reader, size))

    # pair ids with zero bytes at both ends and negative ones: the 8 bytes cross as they are
    records = [gloo_record.record(f"h{i}".encode(), bytes([i]) * (9 + i), [(100 * i + r) << 40 if r % 2 else -(i + r)
                                                                           for r in range(4)]) for i in range(4)]
    heads = None
    for reader in [*range(4), 2]:  # every reader, one of them twice
        parts = read(records, reader, 4)
        assert parts == [gloo_record.part_for(record, reader, 4) for record in records]
        for record, part in zip(records, parts):
            own = slice(len(record) - 32 + 8 * reader, len(record) - 24 + 8 * reader)
            assert gloo_record.as_read_by(part, reader, 4)[own] == record[own]
        answer = cuts.parts_for(records, reader, 4)
        assert len(answer[1]) == 8 * len(records)  # the reader's own pair ids only
        assert heads is None or answer[0] is heads  # one list of heads for every reader
        heads = answer[0]
    assert len(cuts._tables) == 1  # one table for the group's four readers
    mixed = [records[0], b"segment", records[1], b""]  # values that are no record pass whole, the others are cut
    assert read(mixed, 1, 4) == [gloo_record.part_for(value, 1, 4) for value in mixed]
    assert read(records, 1, 3) == [gloo_record.part_for(r, 1, 3) for r in records]  # another group size: whole
    assert read(records, 9, 4) == [gloo_record.part_for(r, 9, 4) for r in records]  # a reader outside: whole
    assert read([], 0, 4) == []
    # a new value under an old key is another object: its own cut, not the old one's
    changed = records[:3] + [gloo_record.record(b"other-host", b"\x05" * 9, [7, 8, 9, 10])]
    assert read(changed, 2, 4) == [gloo_record.part_for(r, 2, 4) for r in changed]
    cuts.clear()
    assert cuts._tables == {}
    assert read(records, 3, 4) == [gloo_record.part_for(r, 3, 4) for r in records]
    with pytest.raises(ValueError, match="ids must hold 8 bytes per head"):
        gloo_record.parts(heads, b"\x00" * 7)


def test_a_reader_outside_the_group_gets_the_whole_value_and_a_broken_part_is_refused():
    record = gloo_record.record(b"h", b"addr", [0, 1])
    assert gloo_record.as_read_by(gloo_record.part_for(record, 5, 2), 5, 2) == record
    with pytest.raises(ValueError, match="not a part of a Gloo record for rank 1 of 2"):
        gloo_record.as_read_by(b"\x02junk", 1, 2)


@pytest.mark.parametrize("rank,size,argument", [(0, 0, "size"), (2, 2, "rank"), (-1, 3, "rank")])
def test_a_full_mesh_store_refuses_a_rank_outside_its_group(rank, size, argument):
    with pytest.raises(ValueError, match=f"^{argument} must"):
        FullMeshStore(dist.HashStore(), rank, size)
