"""The NVMe slot table alone: lifecycle, generations and integrity, with no files."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.domain.errors import FailedPrecondition, IntegrityError, InvalidArgument
from kvtier.tiers.nvme.format import SlotEntry, SlotId
from kvtier.tiers.nvme.slots import NvmeCounts, SlotTable

NS = b"N" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def store(table: SlotTable, slots: list[SlotId], first_key: int = 0) -> np.ndarray:
    ids = np.asarray(slots, dtype=np.int64)
    keys = [key(first_key + j) for j in range(len(slots))]
    generations = table.begin_write(ids, keys, [NS] * len(slots))
    sums = np.arange(100, 100 + len(slots), dtype=np.uint64)
    crcs = np.arange(7, 7 + len(slots), dtype=np.uint32)
    entries = [
        SlotEntry(k, NS, int(c), int(g), b"") for k, c, g in zip(keys, sums.tolist(), generations.tolist(), strict=True)
    ]
    table.commit_write(ids, generations, sums, crcs, entries)
    return generations


def test_a_slot_goes_free_reserved_stored_releasing_free():
    table = SlotTable(6)
    got = table.allocate_many(3)
    assert got == [0, 1, 2]
    assert table.counts() == NvmeCounts(6, 3, 3, 0, 0)
    generations = store(table, got)
    assert generations.tolist() == [1, 2, 3]
    assert table.counts() == NvmeCounts(6, 3, 0, 3, 0)
    assert table.lookup(key(1), NS) == 1 and table.entry(SlotId(1)) == (key(1), NS, 101)
    assert table.expected(np.array([2, 0])).checksums.tolist() == [102, 100]
    assert table.stored_checksums(np.array([0, 4])).tolist() == [100, 0]
    table.free(SlotId(1))
    assert table.counts() == NvmeCounts(6, 3, 0, 2, 1)
    batch, fresh = table.take_releasing()
    assert batch == [1] and fresh == [4]  # a FREE record gets a generation above every write's
    table.finish_release(batch)
    assert table.counts() == NvmeCounts(6, 4, 0, 2, 0)
    table.check_integrity()


def test_an_allocation_takes_releasing_slots_when_free_ones_run_short_and_they_stay_stale():
    table = SlotTable(2)
    slots = table.allocate_many(2)
    assert slots is not None
    store(table, slots)
    table.free(SlotId(0))
    assert table.allocate_many(2) is None
    assert table.allocate() == 0  # releasing, handed out without a header rewrite
    table.free(SlotId(0))  # unwritten: back to releasing, its header still names the old page
    assert table.counts() == NvmeCounts(2, 0, 0, 1, 1)
    table.check_integrity()


def test_a_write_refuses_unreserved_slots_and_pages_already_stored():
    table = SlotTable(4)
    slots = table.allocate_many(2)
    assert slots is not None
    store(table, slots)
    with pytest.raises(InvalidArgument, match="not reserved"):
        table.begin_write(np.array([3]), [key(9)], [NS])
    spare = table.allocate_many(1)
    assert spare is not None
    with pytest.raises(InvalidArgument, match="already stored in nvme slot 0"):
        table.begin_write(np.asarray(spare), [key(0)], [NS])
    with pytest.raises(InvalidArgument, match="holds no page"):
        table.expected(np.asarray(spare))
    table.abort_write(np.asarray(spare))
    assert table.counts().free == 2
    with pytest.raises(IntegrityError, match="already free"):
        table.free(SlotId(spare[0]))
    table.check_integrity()


def test_restore_rebuilds_a_cleared_table_and_clear_refuses_reserved_slots():
    table = SlotTable(4)
    assert table.allocate() == 0
    with pytest.raises(FailedPrecondition):
        table.clear()
    table.free(SlotId(0))
    table.clear()
    entry = SlotEntry(key(5), NS, 55, 40, b"")
    fresh = table.restore([(SlotId(2), entry, 9)], max_generation=40, num_bad=2)
    assert fresh == [41, 42]
    assert table.lookup(key(5), NS) == 2
    assert table.expected(np.array([2])).crcs.tolist() == [9]
    assert table.allocate_many(3) == [0, 1, 3]
    table.check_integrity()
