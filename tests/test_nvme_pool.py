"""NVMe tier on real files: round trips, corruption on disk, crash recovery, disk full."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvtier.cache.page_pool import PoolGeometry
from kvtier.domain.errors import ConfigError, IntegrityError, InvalidArgument
from kvtier.tiers.checksum import page_checksum
from kvtier.tiers.dram import make_dram_pool
from kvtier.tiers.nvme.format import (
    ALIGN,
    HEADER_BYTES,
    IOV_MAX,
    SlotHeader,
    SlotId,
    SlotState,
    SlotVerdict,
    SyncPolicy,
    group_layout,
    slot_bytes_for,
    slots_for_bytes,
)
from kvtier.tiers.nvme.pool import NvmePool

REPO = Path(__file__).resolve().parents[1]
# 32 KiB pages (4 KiB multiple: O_DIRECT straight into aligned memory) and 384-byte
# pages (not a 512 multiple: every run bounces through the aligned staging buffer).
ALIGNED = PoolGeometry(num_layers=4, kv_heads=2, head_dim=32, page_size=16, dtype=torch.float32)
ODD = PoolGeometry(num_layers=2, kv_heads=2, head_dim=3, page_size=4, dtype=torch.float32)
NS = b"N" * 16

# Shared with the crash-test child: deterministic page content and key per index.
PAGE_CODE = """
import torch
def page_for(i, g):
    gen = torch.Generator().manual_seed(1000 + i)
    shape = (g.num_layers, 2, g.page_size, g.kv_heads, g.head_dim)
    return torch.randn(shape, generator=gen).to(g.dtype)
def key_for(i):
    return i.to_bytes(4, "little") * 4
"""
_shared: dict = {}
exec(PAGE_CODE, _shared)
page_for, key_for = _shared["page_for"], _shared["key_for"]


def pages_for(ids, g=ALIGNED) -> torch.Tensor:
    return torch.stack([page_for(i, g) for i in ids])


@pytest.fixture
def pools():
    """Every pool a test opens is integrity-checked and closed at the end."""
    opened: list[NvmePool] = []

    def open_pool(directory, num_slots=16, geometry=ALIGNED, **kw) -> NvmePool:
        pool = NvmePool(directory, num_slots, geometry, **kw)
        opened.append(pool)
        return pool

    yield open_pool
    for pool in opened:
        pool.check_integrity()
        pool.close()


def store(pool: NvmePool, ids, g=ALIGNED, slots=None):
    if slots is None:
        slots = pool.allocate_many(len(ids))
    data = pages_for(ids, g)
    pool.write_pages(
        slots,
        data,
        [key_for(i) for i in ids],
        [NS] * len(ids),
        [page_checksum(p) for p in data],
        parents=[key_for(i - 1) if i else None for i in ids],
        tokens=[list(range(i, i + 4)) for i in ids],
    )
    return slots, data


def slot_offset(pool: NvmePool, slot: int, part: str = "record") -> tuple[Path, int]:
    """The file and offset of ``slot``'s header record (``part="record"``) or payload."""
    where = pool.locate(SlotId(slot))
    return where.path, where.record_offset if part == "record" else where.payload_offset


def corrupt(pool: NvmePool, slot: int, at: int, data: bytes, part: str = "record") -> None:
    path, offset = slot_offset(pool, slot, part)
    with open(path, "r+b") as f:
        f.seek(offset + at)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def test_capacity_in_bytes_becomes_whole_slots():
    # 32 KiB pages: eight slots share a 4096-byte header block (512-byte records).
    assert group_layout(ALIGNED) == (8, 512, ALIGNED.page_bytes)
    slot = slot_bytes_for(ALIGNED)
    assert slot == ALIGNED.page_bytes + 512
    assert slots_for_bytes(10 * slot + slot - 1, ALIGNED) == 10
    assert slots_for_bytes(0, ALIGNED) == 0
    # 384-byte pages padded to 4096, eight to a group; 2 MiB pages keep a block each.
    assert slots_for_bytes(5 * (512 + ALIGN), ODD) == 5
    llama = PoolGeometry(num_layers=32, kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    assert group_layout(llama) == (1, HEADER_BYTES, 2 << 20)
    # A page of 256 tokens needs 1152 bytes of record: 2048-byte records, two to a block.
    assert group_layout(PoolGeometry(1, 1, 4, 256, torch.float32))[:2] == (2, 2048)


def test_file_layout_groups_headers_before_contiguous_payloads(tmp_path, pools):
    pool = pools(tmp_path, 11, slots_per_file=11)  # one group of 8, a short one of 3
    assert pool.file_bytes(0) == ALIGN + 2 * HEADER_BYTES + 11 * ALIGNED.page_bytes
    assert os.path.getsize(tmp_path / "slots-000.kvt") == pool.file_bytes(0)
    assert pool.locate(SlotId(0)) == (tmp_path / "slots-000.kvt", ALIGN, ALIGN + HEADER_BYTES)
    assert pool.locate(SlotId(7)) == (
        tmp_path / "slots-000.kvt",
        ALIGN + 7 * 512,
        ALIGN + HEADER_BYTES + 7 * 32768,
    )
    second = ALIGN + HEADER_BYTES + 8 * 32768
    assert pool.locate(SlotId(9)) == (tmp_path / "slots-000.kvt", second + 512, second + HEADER_BYTES + 32768)
    # Runs that share header blocks with each other and with stored slots: 2-4, then 5-9
    # (across the group boundary), then 0-1 and 10; every record survives the others.
    assert pool.allocate_many(11) == list(range(11))
    for ids in ([2, 3, 4], [5, 6, 7, 8, 9], [0, 1, 10]):
        store(pool, ids, slots=[SlotId(i) for i in ids])
    out = torch.zeros(11, *pages_for([0]).shape[1:])
    assert pool.read_pages([SlotId(i) for i in range(11)], out) == [SlotVerdict.OK] * 11
    assert torch.equal(out, pages_for(range(11)))
    odd = [SlotId(i) for i in (3, 4, 5, 9)]  # reads starting inside a group
    assert pool.read_pages(odd, out[:4]) == [SlotVerdict.OK] * 4
    pool.close()
    again = pools(tmp_path, 11, slots_per_file=11)
    assert [r.slot for r in again.recovery.recovered] == list(range(11))


@pytest.mark.parametrize("geometry", [ALIGNED, ODD], ids=["aligned", "bounce"])
def test_round_trip_contiguous_and_scattered_slots(tmp_path, pools, geometry):
    pool = pools(tmp_path, 16, geometry)
    slots, data = store(pool, range(6), geometry)
    assert slots == [0, 1, 2, 3, 4, 5]
    out = torch.zeros_like(data)
    assert pool.read_pages(slots, out) == [SlotVerdict.OK] * 6
    assert torch.equal(out, data)
    # Scattered, out of order, into separate (unaligned) tensors.
    picks = [SlotId(4), SlotId(0), SlotId(2)]
    outs = [torch.zeros_like(data[0]) for _ in picks]
    assert all(v.ok for v in pool.read_pages(picks, outs))
    for s, o in zip(picks, outs, strict=True):
        assert torch.equal(o, data[s])
    assert pool.counts() == (16, 10, 0, 6, 0)


def test_zero_copy_into_an_aligned_dram_pool(tmp_path, pools):
    pool = pools(tmp_path)
    dram = make_dram_pool(8, ALIGNED)
    assert dram.is_io_aligned
    slots, data = store(pool, range(3))
    assert pool.read_pages(slots, dram.tensor[2:5]) == [SlotVerdict.OK] * 3
    assert torch.equal(dram.tensor[2:5], data)


@pytest.mark.parametrize("geometry", [ALIGNED, ODD], ids=["aligned", "bounce"])
def test_pages_picked_by_row_from_a_pool_tensor_with_batched_headers(tmp_path, pools, geometry):
    # Scattered pool rows into scattered slots (three runs), mixed token counts and parents:
    # each slot's header is byte for byte what SlotHeader.encode_into writes.
    pool = pools(tmp_path, 16, geometry)
    dram = make_dram_pool(10, geometry)
    dram.tensor.copy_(pages_for(range(10), geometry))
    rows = [7, 0, 3, 9, 4]
    slots = [SlotId(s) for s in (5, 6, 7, 12, 1)]
    reserved = pool.allocate_many(16)
    assert reserved is not None
    for s in sorted(set(reserved) - set(slots)):
        pool.free(s)
    tokens = [list(range(r, r + (r % 3) * 5)) for r in rows]
    parents = [key_for(r + 100) if r % 2 else None for r in rows]
    sums = [page_checksum(dram.tensor[r]) for r in rows]
    keys = [key_for(r) for r in rows]
    pool.write_pages(slots, dram.tensor, keys, [NS] * 5, sums, parents=parents, tokens=tokens, rows=rows)
    for i, s in enumerate(slots):
        generation = i + 1  # a fresh pool hands out generations 1, 2, ... in call order
        header = SlotHeader(s, SlotState.COMPLETE, generation, geometry.page_bytes, sums[i], keys[i], NS)
        header.parent_key, header.tokens = parents[i], tuple(tokens[i])
        expected = bytearray(pool.record_bytes)
        header.encode_into(memoryview(expected))
        path, offset = slot_offset(pool, s)
        with open(path, "rb") as f:
            f.seek(offset)
            assert f.read(pool.record_bytes) == bytes(expected)
    out = torch.zeros(5, *dram.tensor.shape[1:], dtype=geometry.dtype)
    assert pool.read_pages(slots, out) == [SlotVerdict.OK] * 5
    assert torch.equal(out, dram.tensor[rows])
    (spare,) = pool.allocate_many(1) or []
    with pytest.raises(InvalidArgument, match="rows"):
        pool.write_pages([spare], dram.tensor, [key_for(50)], [NS], [0], rows=[10])
    assert pool.is_reserved(spare)  # a refused call changes nothing
    pool.free(spare)


def test_bf16_pages_and_buffered_io(tmp_path, pools):
    g = PoolGeometry(2, 2, 64, 16, torch.bfloat16)
    pool = pools(tmp_path, 4, g, direct_io=False, sync=SyncPolicy.DATA)
    assert not pool.is_direct
    slots, data = store(pool, [7, 8], g)
    out = torch.zeros_like(data)
    assert all(v.ok for v in pool.read_pages(slots, out)) and torch.equal(out, data)


def test_flipped_payload_byte_on_disk_fails_that_slot_only(tmp_path, pools):
    pool = pools(tmp_path)
    slots, data = store(pool, range(4))
    path, offset = slot_offset(pool, 2, "payload")
    with open(path, "r+b") as f:
        f.seek(offset + 1234)
        byte = f.read(1)
        f.seek(offset + 1234)
        f.write(bytes([byte[0] ^ 0x10]))
    verdicts = pool.read_pages(slots, torch.zeros_like(data))
    assert verdicts == [SlotVerdict.OK, SlotVerdict.OK, SlotVerdict.CHECKSUM_MISMATCH, SlotVerdict.OK]


@pytest.mark.parametrize("geometry", [ALIGNED, ODD], ids=["aligned", "bounce"])
def test_flipped_byte_in_a_scattered_multi_run_read_fails_that_slot_only(tmp_path, pools, geometry):
    # Slots out of order in two runs ({0, 1, 2} and {5, 6}), so each run's pages sit at
    # positions of the output that are not consecutive: every page is checked against its
    # own slot's checksum, whichever run read it.
    pool = pools(tmp_path, 8, geometry)
    slots, data = store(pool, range(7), geometry)
    assert slots == list(range(7))
    corrupt(pool, 1, 100, b"\xff\x00\xff", "payload")
    picks = [SlotId(s) for s in (5, 0, 1, 6, 2)]
    out = torch.zeros(5, *data.shape[1:], dtype=data.dtype)
    verdicts = pool.read_pages(picks, out)
    assert verdicts == [SlotVerdict.OK, SlotVerdict.OK, SlotVerdict.CHECKSUM_MISMATCH, SlotVerdict.OK, SlotVerdict.OK]
    for i, s in enumerate(picks):
        if s != 1:
            assert torch.equal(out[i], data[s])
    outs = [torch.zeros_like(data[0]) for _ in picks]
    assert pool.read_pages(picks, outs) == verdicts


def test_a_run_of_more_iovecs_than_iov_max_goes_out_in_several_calls(tmp_path, pools):
    # 2 KiB pages, buffered, each its own tensor: a payload and a pad iovec per slot, so
    # one run of 600 slots needs more than IOV_MAX buffers.
    g = PoolGeometry(num_layers=2, kv_heads=2, head_dim=8, page_size=8, dtype=torch.float32)
    pool = pools(tmp_path, 600, g, direct_io=False)
    assert g.page_bytes == 2048 and pool.max_slots_per_io >= 600 and 2 * 600 > IOV_MAX
    data = pages_for(range(600), g)
    slots = pool.allocate_many(600)
    assert slots == list(range(600))
    pages = [p.clone() for p in data]
    pool.write_pages(slots, pages, [key_for(i) for i in range(600)], [NS] * 600, [page_checksum(p) for p in data])
    outs = [torch.zeros_like(data[0]) for _ in range(600)]
    assert pool.read_pages(slots, outs) == [SlotVerdict.OK] * 600
    assert all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))


def test_garbled_header_and_misplaced_header_are_reported(tmp_path, pools):
    pool = pools(tmp_path)
    slots, data = store(pool, range(3))
    corrupt(pool, 0, 20, b"\xff\xff")
    # A valid header of another page written over slot 1 (a misdirected write).
    buf = memoryview(bytearray(pool.record_bytes))
    SlotHeader(1, SlotState.COMPLETE, 99, ALIGNED.page_bytes, 5, key_for(42), NS).encode_into(buf)
    corrupt(pool, 1, 0, bytes(buf))
    verdicts = pool.read_pages(slots, torch.zeros_like(data))
    assert verdicts == [SlotVerdict.HEADER_CORRUPT, SlotVerdict.WRONG_PAGE, SlotVerdict.OK]


def test_clean_reopen_recovers_every_page_with_its_lineage(tmp_path, pools):
    pool = pools(tmp_path, 16)
    slots, data = store(pool, range(5))
    pool.free(slots[1])
    pool.close()
    again = pools(tmp_path, 16)
    rec = again.recovery
    assert [r.slot for r in rec.recovered] == [0, 2, 3, 4]
    assert rec.discarded == [] and rec.num_empty == 12
    for r in rec.recovered:
        assert r.key == key_for(r.slot) and r.namespace == NS
        assert r.checksum == page_checksum(data[r.slot])
        assert r.parent_key == (key_for(r.slot - 1) if r.slot else None)
        assert r.tokens == tuple(range(r.slot, r.slot + 4))
    out = torch.zeros_like(data[:1])
    assert again.read_pages([SlotId(3)], out) == [SlotVerdict.OK] and torch.equal(out[0], data[3])
    assert again.lookup(key_for(4), NS) == 4
    # The next allocation reuses the freed and the empty slots.
    assert again.allocate_many(2) == [1, 5]


def test_recovery_discards_torn_corrupt_and_duplicate_slots(tmp_path, pools):
    pool = pools(tmp_path, 8)
    slots, data = store(pool, range(6))
    pool.close()
    corrupt(pool, 0, 30, b"\x00\x01\x02")  # torn header
    corrupt(pool, 1, 100, b"\x00" * 4000, "payload")  # payload half written
    # Slot 5 becomes a second copy of page 4 with a newer generation: slot 4 loses.
    path, offset4 = slot_offset(pool, 4, "payload")
    with open(path, "rb") as f:
        f.seek(offset4)
        payload = f.read(ALIGNED.page_bytes)
    buf = memoryview(bytearray(pool.record_bytes))
    SlotHeader(
        5, SlotState.COMPLETE, 1000, ALIGNED.page_bytes, page_checksum(payload), key_for(4), NS
    ).encode_into(buf)
    corrupt(pool, 5, 0, bytes(buf))
    corrupt(pool, 5, 0, payload, "payload")
    again = pools(tmp_path, 8)
    reasons = dict(again.recovery.discarded)
    assert set(reasons) == {0, 1, 4}
    assert reasons[0].startswith("header corrupt") and reasons[1] == "payload checksum mismatch"
    assert reasons[4] == "duplicate of slot 5"
    assert [r.slot for r in again.recovery.recovered] == [2, 3, 5]
    assert again.counts().free == 5
    again.close()
    # Discarded slots were marked FREE on disk: a second start finds nothing to discard.
    third = pools(tmp_path, 8)
    assert third.recovery.discarded == [] and len(third.recovery.recovered) == 3


def test_truncated_file_loses_the_tail_slots_only(tmp_path, pools):
    pool = pools(tmp_path, 6)
    store(pool, range(5))
    pool.close()
    path, offset = slot_offset(pool, 4, "payload")
    os.truncate(path, offset + 10)
    again = pools(tmp_path, 6)
    # The group's header block survives the cut: slot 4's record is intact, its payload is not.
    assert [r.slot for r in again.recovery.recovered] == [0, 1, 2, 3]
    assert dict(again.recovery.discarded) == {4: "payload checksum mismatch"}
    assert again.recovery.num_empty == 1
    assert os.path.getsize(path) == again.file_bytes(0) == ALIGN + HEADER_BYTES + 6 * ALIGNED.page_bytes


FREE_THEN_DIE_CHILD = PAGE_CODE + textwrap.dedent(
    """
    import os, sys
    from kvtier.tiers.checksum import page_checksum
    from kvtier.tiers.nvme.pool import NvmePool
    from kvtier.cache.page_pool import PoolGeometry
    g = PoolGeometry(4, 2, 32, 16, torch.float32)
    pool = NvmePool(sys.argv[1], 4, g)
    pages = [page_for(i, g) for i in range(3)]
    keys = [key_for(i) for i in range(3)]
    pool.write_pages(pool.allocate_many(3), torch.stack(pages), keys, [b"N" * 16] * 3,
                     [page_checksum(p) for p in pages])
    pool.free(0)
    pool.free(1)
    assert pool.counts().releasing == 2 and pool.lookup(key_for(0), b"N" * 16) is None
    os._exit(0)  # dies before any flush
    """
)


def test_free_defers_the_header_rewrite_to_a_flush(tmp_path, pools):
    subprocess.run(
        [sys.executable, "-c", FREE_THEN_DIE_CHILD, str(tmp_path)], cwd=REPO, check=True, timeout=120
    )
    # The frees never reached the disk: both pages come back, verified, under their own keys.
    pool = pools(tmp_path, 4)
    assert [r.slot for r in pool.recovery.recovered] == [0, 1, 2]
    pool.free(SlotId(0))
    pool.free(SlotId(1))
    assert pool.flush_frees() == 2 and pool.counts() == (4, 3, 0, 1, 0)
    pool.close()
    assert [r.slot for r in pools(tmp_path, 4).recovery.recovered] == [2]


def test_allocation_reuses_releasing_slots_without_a_rewrite(tmp_path, pools):
    pool = pools(tmp_path, 4)
    store(pool, range(4))
    pool.free(SlotId(2))
    pool.free(SlotId(0))
    assert pool.counts() == (4, 0, 0, 2, 2)
    # Short of free slots: the releasing ones come back (lowest first) with no I/O.
    assert pool.allocate_many(2) == [0, 2] and pool.counts() == (4, 0, 2, 2, 0)
    pool.free(SlotId(2))  # unwritten: its disk header still names page 2, so releasing
    assert pool.counts() == (4, 0, 1, 2, 1)
    store(pool, [10], slots=[SlotId(0)])  # the write replaces page 0's header
    pool.close()
    # Page 2 was flushed at close, page 0 was overwritten: neither comes back.
    again = pools(tmp_path, 4)
    assert sorted((r.slot, r.key) for r in again.recovery.recovered) == [
        (0, key_for(10)),
        (1, key_for(1)),
        (3, key_for(3)),
    ]


def test_one_pool_per_directory(tmp_path, pools):
    pools(tmp_path, 4)
    with pytest.raises(ConfigError, match="in use by another pool"):
        NvmePool(tmp_path, 4, ALIGNED)


def test_header_only_recovery_trusts_headers_and_reads_still_verify(tmp_path, pools):
    pool = pools(tmp_path, 4)
    slots, data = store(pool, range(2))
    pool.close()
    corrupt(pool, 1, 8, b"\x01\x02\x03", "payload")
    again = pools(tmp_path, 4, verify_payload_on_recover=False)
    assert [r.slot for r in again.recovery.recovered] == [0, 1]
    assert again.read_pages(slots, torch.zeros_like(data)) == [SlotVerdict.OK, SlotVerdict.CHECKSUM_MISMATCH]


def test_slot_files_split_and_runs_stop_at_file_boundaries(tmp_path, pools):
    pool = pools(tmp_path, 10, slots_per_file=4)
    assert sorted(p.name for p in tmp_path.glob("*.kvt")) == [
        "slots-000.kvt",
        "slots-001.kvt",
        "slots-002.kvt",
    ]
    slots, data = store(pool, range(10))
    out = torch.zeros_like(data)
    assert all(v.ok for v in pool.read_pages(slots, out)) and torch.equal(out, data)
    pool.close()
    again = pools(tmp_path, 10, slots_per_file=4)
    assert len(again.recovery.recovered) == 10


def test_reopen_with_another_geometry_or_capacity_is_refused(tmp_path, pools):
    pools(tmp_path, 4).close()
    with pytest.raises(ConfigError, match="another geometry"):
        NvmePool(tmp_path, 4, ODD)
    with pytest.raises(ConfigError, match="another geometry"):
        NvmePool(tmp_path, 5, ALIGNED)
    with pytest.raises(ConfigError, match="does not exist"):
        NvmePool(tmp_path / "missing", 4, ALIGNED, create=False)


def test_a_directory_of_another_format_version_is_refused_naming_it(tmp_path, pools):
    """Version 1 kept one 4 KiB header per slot: its files must never be read as version 2."""
    pools(tmp_path, 4).close()
    path = tmp_path / "slots-000.kvt"
    with open(path, "r+b") as f:
        f.seek(8)
        f.write((1).to_bytes(2, "little"))  # the superblock's version field
    with pytest.raises(ConfigError, match="slot format version 1, this build reads 2") as info:
        NvmePool(tmp_path, 4, ALIGNED)
    assert info.value.field == "nvme.dir"


def test_allocation_contract(tmp_path, pools):
    pool = pools(tmp_path, 4)
    assert pool.allocate_many(5) is None
    slots = pool.allocate_many(4)
    assert pool.allocate() is None and pool.counts() == (4, 0, 4, 0, 0)
    with pytest.raises(InvalidArgument, match="holds no page"):
        pool.read_pages(slots[:1], torch.zeros(1, *pages_for([0]).shape[1:]))
    store(pool, [0], slots=slots[:1])
    with pytest.raises(InvalidArgument, match="not reserved"):
        store(pool, [1], slots=slots[:1])
    with pytest.raises(InvalidArgument, match="already stored"):
        store(pool, [0], slots=slots[1:2])
    for s in slots:
        pool.free(s)
    with pytest.raises(IntegrityError, match="already free"):
        pool.free(slots[0])
    assert pool.counts() == (4, 3, 0, 0, 1)  # the stored one waits for its header rewrite
    assert pool.num_free == 4 and pool.allocate_many(4) is not None  # allocation flushes it


CRASH_CHILD = PAGE_CODE + textwrap.dedent(
    """
    import sys, time
    from kvtier.tiers.checksum import page_checksum
    from kvtier.tiers.nvme.pool import NvmePool
    from kvtier.cache.page_pool import PoolGeometry
    g = PoolGeometry(4, 2, 32, 16, torch.float32)
    pool = NvmePool(sys.argv[1], 64, g)
    for i in range(64):
        slot = pool.allocate()
        page = page_for(i, g)
        pool.write_pages([slot], page[None], [key_for(i)], [b"N" * 16], [page_checksum(page)])
        print(i, slot, flush=True)
        time.sleep(0.02)
    time.sleep(60)
    """
)


def test_sigkilled_writer_leaves_recoverable_pages(tmp_path, pools):
    child = subprocess.Popen(
        [sys.executable, "-c", CRASH_CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    reported: dict[int, int] = {}  # slot -> page index
    try:
        assert child.stdout is not None
        while len(reported) < 24:
            line = child.stdout.readline()
            assert line, "crash-test child exited early"
            i, slot = map(int, line.split())
            reported[slot] = i
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    probe = NvmePool(tmp_path, 64, ALIGNED)
    probe.close()
    # Tear two acknowledged pages the way a crash would: a header half written, a payload cut short.
    corrupt(probe, 3, 40, b"\xde\xad\xbe\xef")
    corrupt(probe, 7, 2048, os.urandom(8192), "payload")
    pool = pools(tmp_path, 64)
    rec = pool.recovery
    assert {s for s, _ in rec.discarded} == {3, 7}
    recovered = {r.slot: r for r in rec.recovered}
    # Every acknowledged, untouched page is back; at most one more (written, killed before its print).
    assert set(reported) - {3, 7} <= set(recovered)
    assert len(set(recovered) - set(reported)) <= 1
    for slot, r in recovered.items():
        i = reported.get(slot, slot)
        assert r.key == key_for(i) and r.checksum == page_checksum(page_for(i, ALIGNED))
    out = torch.zeros(len(recovered), *pages_for([0]).shape[1:])
    assert all(v.ok for v in pool.read_pages(sorted(recovered), out))


DISK_FULL_CHILD = textwrap.dedent(
    """
    import json, os, resource, signal, sys, torch
    from kvtier.tiers.checksum import page_checksum
    from kvtier.tiers.nvme.format import DiskFull
    from kvtier.tiers.nvme.pool import NvmePool
    from kvtier.cache.page_pool import PoolGeometry
    g = PoolGeometry(4, 2, 32, 16, torch.float32)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
    base, limit = sys.argv[1], int(sys.argv[2])
    pools = {
        "direct": NvmePool(base + "/direct", 8, g),
        "buffered": NvmePool(base + "/buffered", 8, g, direct_io=False),
    }
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    result = {}
    pages = torch.randn(8, 4, 2, 16, 2, 32)
    sums = [page_checksum(p) for p in pages]
    for name, pool in pools.items():
        r = result[name] = {"is_direct": pool.is_direct}
        slots = pool.allocate_many(8)
        try:
            pool.write_pages(slots, pages, [bytes([i]) * 16 for i in range(8)], [b"N" * 16] * 8, sums)
        except DiskFull as exc:
            r["error"] = str(exc)
        pool.check_integrity()
        r["counts"] = list(pool.counts())
        low = pool.allocate_many(2)
        pool.write_pages(low, pages[:2], [b"a" * 16, b"b" * 16], [b"N" * 16] * 2, sums[:2])
        r["low_slots"] = low
        pool.check_integrity()
        pool.close()
    try:
        NvmePool(base + "/new", 8, g)
    except DiskFull as exc:
        result["create_error"] = str(exc)
    result["new_dir_files"] = sorted(f for f in os.listdir(base + "/new") if f.endswith(".kvt"))
    print(json.dumps(result))
    """
)


def test_disk_full_is_a_typed_error_and_leaves_the_pool_consistent(tmp_path):
    # The file size limit falls on a slot boundary: the group's header block and slots 0-4
    # fit, slot 5 gets EFBIG. (An O_DIRECT write cut to an unaligned size by the limit fails
    # with EINVAL instead, which surfaces as NvmeIOError; a full filesystem gives ENOSPC at
    # preallocation.)
    limit = ALIGN + HEADER_BYTES + 5 * ALIGNED.page_bytes
    out = subprocess.run(
        [sys.executable, "-c", DISK_FULL_CHILD, str(tmp_path), str(limit)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not result["buffered"]["is_direct"]  # the other one is direct where the filesystem allows
    for name in ("direct", "buffered"):
        r = result[name]
        assert "out of space" in r["error"] and "drop them" in r["error"], r
        assert r["counts"] == [8, 8, 0, 0, 0]  # every slot of the failed call is free again
        assert r["low_slots"] == [0, 1]
        # The parent sees the two pages written after the failure, and none of the failed call.
        with NvmePool(tmp_path / name, 8, ALIGNED, direct_io=name == "direct") as pool:
            assert [r.key for r in pool.recovery.recovered] == [b"a" * 16, b"b" * 16]
            assert pool.recovery.discarded == []
            pool.check_integrity()
    assert "cannot preallocate" in result["create_error"]
    assert result["new_dir_files"] == []  # the half-created slot file was removed
