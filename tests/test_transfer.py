"""Transfer engine with real pools, real files and real worker threads."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from kvtier.cache.page_pool import PagePool, PoolGeometry
from kvtier.domain.errors import InvalidArgument
from kvtier.domain.tiers import Tier
from kvtier.tiers.checksum import page_checksum
from kvtier.tiers.dram import make_dram_pool
from kvtier.tiers.nvme.format import SlotId
from kvtier.tiers.nvme.pool import NvmePool
from kvtier.tiers.transfer import CancelOutcome, TransferDone, TransferReason, TransferStatus
from kvtier.tiers.transfer_engine import TransferEngine

GEOMETRY = PoolGeometry(num_layers=4, kv_heads=2, head_dim=32, page_size=16, dtype=torch.float32)
NS = b"N" * 16
HBM, DRAM, NVME = Tier.HBM, Tier.DRAM, Tier.NVME


def key(i: int) -> bytes:
    return i.to_bytes(2, "little") * 8


class Tiers:
    """HBM, DRAM and NVMe pools plus an engine; ``check`` runs every integrity check."""

    def __init__(self, directory, *, num_hbm=24, num_dram=24, num_slots=32, nvme_cls=NvmePool, **engine_kw):
        self.hbm = PagePool(num_hbm, GEOMETRY)
        self.dram = make_dram_pool(num_dram, GEOMETRY)
        self.nvme = nvme_cls(directory, num_slots, GEOMETRY)
        self.engine = TransferEngine(self.hbm, self.dram, self.nvme, **engine_kw)
        # The caller (the engine's scheduler, here the test) holds every page it names.
        for pool in (self.hbm, self.dram):
            while pool.allocate() is not None:
                pass

    def fill_hbm(self, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        self.hbm.tensor.copy_(torch.randn(self.hbm.tensor.shape, generator=g))
        return self.hbm.tensor.clone()

    def run(self, src, dst, pairs, reason=TransferReason.EVICTION, **kw) -> TransferDone:
        t = self.engine.submit(src, dst, pairs, reason, **kw)
        assert self.engine.wait_idle(timeout_s=30)
        done = [d for d in self.engine.poll_completed() if d.transfer.transfer_id == t.transfer_id]
        assert len(done) == 1
        return done[0]

    def to_nvme(self, src, pairs, **kw) -> TransferDone:
        n = len(pairs)
        return self.run(src, NVME, pairs, keys=[key(d) for _, d in pairs], namespaces=[NS] * n, **kw)

    def check(self) -> None:
        self.engine.check_integrity()
        self.hbm.check_integrity()
        self.dram.check_integrity()
        self.nvme.check_integrity()

    def close(self) -> None:
        self.engine.close()
        self.check()
        self.nvme.close()


@pytest.fixture
def tiers(tmp_path):
    made: list[Tiers] = []

    def make(**kw) -> Tiers:
        t = Tiers(tmp_path / f"nvme{len(made)}", **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def test_round_trip_through_every_tier_is_byte_identical(tiers):
    t = tiers()
    original = t.fill_hbm()
    contiguous = [(0, 0), (1, 1), (2, 2), (3, 3)]
    scattered = [(9, 4), (5, 7), (17, 5), (11, 6)]
    pages = [s for s, _ in contiguous + scattered]

    down = t.run(HBM, DRAM, contiguous + scattered)
    assert down.is_ok and down.verified is None
    expected = {s: page_checksum(original[s]) for s in pages}
    assert down.checksums == [expected[s] for s, _ in down.transfer.pairs]
    for s, d in down.transfer.pairs:
        assert torch.equal(t.dram.tensor[d], original[s]) and t.dram.checksum(d) == expected[s]

    # DRAM -> NVMe (slots 10..13 contiguous, the rest scattered), checksums carried.
    dram_to_slot = [(0, 10), (1, 11), (2, 12), (3, 13), (4, 20), (7, 3), (5, 25), (6, 30)]
    for _ in range(32):
        t.nvme.allocate()
    sunk = t.to_nvme(DRAM, dram_to_slot)
    assert sunk.is_ok
    assert sunk.checksums == [t.dram.checksum(d) for d, _ in dram_to_slot]

    # NVMe -> fresh DRAM pages -> HBM pages that were zeroed.
    slot_to_dram = [(10, 12), (11, 13), (12, 14), (13, 15), (20, 20), (3, 18), (25, 22), (30, 23)]
    up = t.run(NVME, DRAM, slot_to_dram, TransferReason.PREFETCH)
    assert up.is_ok and up.verified == [True] * 8
    dram_to_hbm = [(12, 12), (13, 13), (14, 14), (15, 15), (20, 0), (18, 21), (22, 4), (23, 8)]
    t.hbm.tensor.zero_()
    back = t.run(DRAM, HBM, dram_to_hbm, TransferReason.PROMOTION_ON_HIT)
    assert back.is_ok and back.verified == [True] * 8

    # Follow each page along its path and compare bytes.
    hbm_of = dict(dram_to_hbm)
    dram_of = dict(slot_to_dram)
    slot_of = dict(dram_to_slot)
    for src_hbm, first_dram in contiguous + scattered:
        final = hbm_of[dram_of[slot_of[first_dram]]]
        assert torch.equal(t.hbm.tensor[final], original[src_hbm]), (src_hbm, final)

    stats = t.engine.stats()
    page = GEOMETRY.page_bytes
    assert stats.bytes_moved == {
        (HBM, DRAM): 8 * page,
        (DRAM, NVME): 8 * page,
        (NVME, DRAM): 8 * page,
        (DRAM, HBM): 8 * page,
    }
    assert stats.num_submitted == stats.num_ok == 4 and stats.num_checksum_failures == 0
    assert sum(stats.pages_moved.values()) == 32


def test_hbm_to_nvme_and_back_directly(tiers):
    t = tiers()
    original = t.fill_hbm(seed=1)
    slots = t.nvme.allocate_many(5)
    pairs = list(zip([2, 3, 4, 10, 6], slots, strict=True))
    down = t.run(
        HBM,
        NVME,
        pairs,
        keys=[key(s) for s, _ in pairs],
        namespaces=[NS] * 5,
        tokens=[[1, 2, 3]] * 5,
        parents=[None] * 5,
    )
    assert down.is_ok and down.checksums == [page_checksum(original[s]) for s, _ in pairs]
    t.hbm.tensor.zero_()
    up = t.run(NVME, HBM, [(s, h) for h, s in pairs])
    assert up.is_ok
    for h, _ in pairs:
        assert torch.equal(t.hbm.tensor[h], original[h])


def test_corrupt_dram_page_fails_verification_of_that_page_only(tiers):
    t = tiers()
    t.fill_hbm(seed=2)
    assert t.run(HBM, DRAM, [(i, i) for i in range(4)]).is_ok
    t.dram.tensor[2].view(-1)[100] += 1.0  # a bit flip's worth of damage in host memory
    back = t.run(DRAM, HBM, [(i, 10 + i) for i in range(4)], TransferReason.PROMOTION_ON_HIT)
    assert back.status is TransferStatus.OK and not back.is_ok
    assert back.verified == [True, True, False, True] and back.bad_pairs == [(2, 12)]
    assert t.engine.stats().num_checksum_failures == 1


def test_corrupt_nvme_slot_fails_verification_of_that_slot_only(tiers):
    t = tiers()
    t.fill_hbm(seed=3)
    slots = t.nvme.allocate_many(3)
    assert t.to_nvme(HBM, [(i, s) for i, s in enumerate(slots)]).is_ok
    where = t.nvme.locate(slots[1])
    with open(where.path, "r+b") as f:
        f.seek(where.payload_offset + 77)
        f.write(b"\x5a")
    up = t.run(NVME, DRAM, [(s, 5 + i) for i, s in enumerate(slots)])
    assert up.verified == [True, False, True] and up.bad_pairs == [(slots[1], 6)]
    # Only verified pages get a DRAM checksum: the bad one can never be promoted further.
    assert t.dram.checksum(5) is not None and t.dram.checksum(6) is None
    with pytest.raises(InvalidArgument, match="no checksum"):
        t.engine.submit(DRAM, HBM, [(6, 0)], TransferReason.PROMOTION_ON_HIT)


def test_cancel_before_start_and_priority_order(tiers):
    entered, gate = threading.Event(), threading.Event()
    order: list[int] = []

    def on_done(done: TransferDone) -> None:
        order.append(done.transfer.transfer_id)
        if done.transfer.reason is TransferReason.DRAIN:
            entered.set()
            gate.wait(timeout=30)  # holds the copy lane's only thread

    t = tiers(on_done=on_done)
    t.fill_hbm(seed=4)
    blocker = t.engine.submit(HBM, DRAM, [(0, 0)], TransferReason.DRAIN)
    assert entered.wait(timeout=30)
    low = t.engine.submit(HBM, DRAM, [(1, 1)], TransferReason.WATERMARK, priority=0)
    victim = t.engine.submit(HBM, DRAM, [(2, 2)], TransferReason.WATERMARK, priority=5)
    high = t.engine.submit(HBM, DRAM, [(3, 3)], TransferReason.PROMOTION_ON_HIT, priority=10)
    assert t.engine.cancel(victim.transfer_id) is CancelOutcome.BEFORE_START
    assert t.engine.cancel(victim.transfer_id) is CancelOutcome.NOT_PENDING
    gate.set()
    assert t.engine.wait_idle(timeout_s=30)
    done = {d.transfer.transfer_id: d for d in t.engine.poll_completed()}
    assert (
        done[victim.transfer_id].status is TransferStatus.CANCELLED
        and done[victim.transfer_id].num_bytes == 0
    )
    ran = [tid for tid in order if tid != victim.transfer_id]
    assert ran == [blocker.transfer_id, high.transfer_id, low.transfer_id]
    s = t.engine.stats()
    assert (s.num_submitted, s.num_ok, s.num_cancelled) == (4, 3, 1)
    assert s.bytes_moved == {(HBM, DRAM): 3 * GEOMETRY.page_bytes}
    assert t.dram.checksum(2) is None  # nothing of the cancelled transfer was written


class GatedNvmePool(NvmePool):
    """A real pool whose first read waits until the test lets it go (to cancel mid-transfer)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.entered = threading.Event()
        self.release = threading.Event()

    def read_pages(self, slots, out):
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(timeout=30)
        return super().read_pages(slots, out)


def test_cancel_in_progress_reports_cancelled_and_stops_at_a_run_boundary(tiers):
    t = tiers(nvme_cls=GatedNvmePool)
    t.fill_hbm(seed=5)
    slots = t.nvme.allocate_many(6)
    assert t.to_nvme(HBM, [(i, s) for i, s in enumerate(slots)]).is_ok
    # Three separate runs (destinations are not consecutive).
    tr = t.engine.submit(NVME, DRAM, [(slots[0], 0), (slots[1], 5), (slots[2], 10)], TransferReason.PREFETCH)
    assert t.nvme.entered.wait(timeout=30)
    assert t.engine.cancel(tr.transfer_id) is CancelOutcome.IN_PROGRESS
    t.nvme.release.set()
    assert t.engine.wait_idle(timeout_s=30)
    (done,) = t.engine.poll_completed()
    assert done.status is TransferStatus.CANCELLED and not done.is_ok
    assert done.num_bytes == GEOMETRY.page_bytes  # the run in flight finished, the others never started
    assert t.engine.stats().bytes_moved[(NVME, DRAM)] == GEOMETRY.page_bytes


def test_cpu_copy_cancelled_in_progress_stops_between_parts(tiers):
    # One page per part and a budget of one page a second: after its first part the job
    # sleeps in the pacer, where cancel finds it running.
    t = tiers(chunk_bytes=GEOMETRY.page_bytes, budget_bytes_per_s=GEOMETRY.page_bytes)
    original = t.fill_hbm(seed=8)
    t.dram.tensor.zero_()  # a pinned pool (any host with CUDA) starts uninitialised
    pairs = [(i, 10 + i) for i in range(6)]
    tr = t.engine.submit(HBM, DRAM, pairs, TransferReason.WATERMARK)
    deadline = time.monotonic() + 30
    while not torch.equal(t.dram.tensor[10], original[0]):
        assert time.monotonic() < deadline, "the first part was never copied"
        time.sleep(0.005)
    assert t.engine.cancel(tr.transfer_id) is CancelOutcome.IN_PROGRESS
    assert t.engine.wait_idle(timeout_s=30)
    (done,) = t.engine.poll_completed()
    assert done.status is TransferStatus.CANCELLED
    copied = done.num_bytes // GEOMETRY.page_bytes
    assert 1 <= copied < 6 and done.num_bytes == copied * GEOMETRY.page_bytes
    assert not t.dram.tensor[10 + copied :].any()  # parts after the cancel never ran
    t.check()


def test_large_scattered_cpu_copy_in_many_parts_round_trips(tiers):
    t = tiers(num_hbm=64, num_dram=64, chunk_bytes=5 * GEOMETRY.page_bytes, copy_threads=2)
    original = t.fill_hbm(seed=9)
    rng = np.random.default_rng(0)
    pairs = np.stack([rng.permutation(64)[:50], rng.permutation(64)[:50]], axis=1)
    down = t.run(HBM, DRAM, pairs)
    assert down.is_ok and down.num_bytes == 50 * GEOMETRY.page_bytes
    assert down.checksums == [page_checksum(original[s]) for s in pairs[:, 0].tolist()]
    t.hbm.tensor.zero_()
    up = t.run(DRAM, HBM, pairs[:, ::-1], TransferReason.PROMOTION_ON_HIT)
    assert up.is_ok and up.verified == [True] * 50
    assert torch.equal(t.hbm.tensor[pairs[:, 0]], original[pairs[:, 0]])
    t.check()


def test_concurrent_submitters_across_lanes(tiers):
    t = tiers(num_hbm=64, num_dram=64, num_slots=64)
    original = t.fill_hbm(seed=6)
    slots = t.nvme.allocate_many(32)
    results: list[TransferDone] = []
    lock = threading.Lock()
    t.engine.on_done = lambda d: (lock.acquire(), results.append(d), lock.release())

    def submitter(w: int) -> None:
        for j in range(4):
            i = w * 8 + j * 2
            t.engine.submit(HBM, DRAM, [(i, i), (i + 1, i + 1)], TransferReason.WATERMARK)
            t.engine.submit(
                HBM,
                NVME,
                [(32 + i // 2, slots[i // 2])],
                TransferReason.PREEMPTION,
                keys=[key(i)],
                namespaces=[NS],
            )

    threads = [threading.Thread(target=submitter, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.engine.wait_idle(timeout_s=60)
    assert len(results) == 32 and all(d.is_ok for d in results)
    assert len(t.engine.poll_completed()) == 32
    for i in range(32):
        assert torch.equal(t.dram.tensor[i], original[i])
    out = torch.zeros(16, *original.shape[1:])
    assert all(v.ok for v in t.nvme.read_pages(slots[:16], out))
    assert torch.equal(out, original[32:48])
    s = t.engine.stats()
    assert s.num_ok == s.num_submitted == 32 and s.num_in_flight == 0
    assert s.bytes_moved == {(HBM, DRAM): 32 * GEOMETRY.page_bytes, (HBM, NVME): 16 * GEOMETRY.page_bytes}
    assert s.bytes_moved[(HBM, DRAM)] == sum(d.num_bytes for d in results if d.transfer.dst_tier is DRAM)
    assert s.latency_s_max >= max(d.latency_s for d in results) > 0


def test_contract_violations_raise_at_submit(tiers):
    t = tiers()
    t.nvme.allocate_many(2)
    with pytest.raises(InvalidArgument, match="no pages"):
        t.engine.submit(HBM, DRAM, [], TransferReason.EVICTION)
    with pytest.raises(InvalidArgument, match="to itself"):
        t.engine.submit(HBM, HBM, [(0, 1)], TransferReason.EVICTION)
    with pytest.raises(InvalidArgument, match="out of range"):
        t.engine.submit(HBM, DRAM, [(0, 99)], TransferReason.EVICTION)
    with pytest.raises(InvalidArgument, match="appears twice"):
        t.engine.submit(HBM, DRAM, [(0, 1), (2, 1)], TransferReason.EVICTION)
    with pytest.raises(InvalidArgument, match="appears twice"):
        t.engine.submit(HBM, DRAM, np.array([[3, 1], [0, 2], [3, 4]]), TransferReason.EVICTION)
    with pytest.raises(InvalidArgument, match="source page, destination page"):
        t.engine.submit(HBM, DRAM, [(0, 1, 2), (3,)], TransferReason.EVICTION)
    with pytest.raises(InvalidArgument, match=r"\[n, 2\]"):
        t.engine.submit(HBM, DRAM, np.arange(3), TransferReason.EVICTION)
    with pytest.raises(InvalidArgument, match="needs 1 keys"):
        t.engine.submit(HBM, NVME, [(0, 0)], TransferReason.EVICTION)
    with pytest.raises(InvalidArgument, match="holds no page"):
        t.engine.submit(NVME, HBM, [(0, 1)], TransferReason.EVICTION)
    with pytest.raises(InvalidArgument, match="no checksum"):
        t.engine.submit(DRAM, HBM, [(0, 1)], TransferReason.EVICTION)
    fresh = PagePool(4, GEOMETRY)
    dram = make_dram_pool(4, GEOMETRY)
    fresh.allocate()
    unowned = TransferEngine(fresh, dram)
    with pytest.raises(InvalidArgument, match="dram page 0 is free"):
        unowned.submit(HBM, DRAM, [(0, 0)], TransferReason.EVICTION)
    with pytest.raises(InvalidArgument, match="hbm page 1 is free"):
        unowned.submit(HBM, DRAM, [(1, 0)], TransferReason.EVICTION)
    unowned.close()
    t.nvme.free(SlotId(1))
    with pytest.raises(InvalidArgument, match="nvme slot 1 is not reserved"):
        t.engine.submit(HBM, NVME, [(0, 1)], TransferReason.EVICTION, keys=[key(0)], namespaces=[NS])
    t.nvme.free(SlotId(0))
    hbm_only = TransferEngine(PagePool(4, GEOMETRY))
    with pytest.raises(InvalidArgument, match="no dram tier"):
        hbm_only.submit(HBM, DRAM, [(0, 0)], TransferReason.EVICTION)
    hbm_only.close()
    with pytest.raises(InvalidArgument, match="page size"):
        TransferEngine(PagePool(4, GEOMETRY), make_dram_pool(4, PoolGeometry(1, 1, 8, 16)))


def test_a_destination_can_be_the_target_of_one_pending_transfer(tiers):
    gate = threading.Event()
    t = tiers(on_done=lambda d: gate.wait(timeout=30))
    first = t.engine.submit(HBM, DRAM, [(0, 0)], TransferReason.EVICTION)
    second = t.engine.submit(HBM, DRAM, [(1, 1)], TransferReason.EVICTION)
    with pytest.raises(InvalidArgument, match=f"already the destination of pending transfer {second.transfer_id}"):
        t.engine.submit(HBM, DRAM, [(2, 1)], TransferReason.EVICTION)
    with pytest.raises(InvalidArgument, match="dram page 1 is already"):
        t.engine.submit(HBM, DRAM, np.array([[3, 9], [2, 1]]), TransferReason.EVICTION)
    third = t.engine.submit(HBM, DRAM, [(3, 9)], TransferReason.EVICTION)  # the refusal marked nothing
    t.engine.check_integrity()
    gate.set()
    assert t.engine.wait_idle(timeout_s=30)
    assert {d.transfer.transfer_id for d in t.engine.poll_completed()} == {
        first.transfer_id,
        second.transfer_id,
        third.transfer_id,
    }


def test_failed_write_to_nvme_frees_every_destination_slot(tiers, tmp_path):
    t = tiers()
    t.fill_hbm(seed=7)
    slots = t.nvme.allocate_many(4)
    # Make the second run's file region unwritable: replace the slot file by a read-only
    # descriptor the pool will use (EBADF on write, a device-level failure).
    fd = t.nvme.files.fds[0]
    ro = os.open(t.nvme.directory / "slots-000.kvt", os.O_RDONLY)
    os.dup2(ro, fd)
    os.close(ro)
    done = t.to_nvme(HBM, [(0, slots[0]), (1, slots[1]), (5, slots[2]), (6, slots[3])])
    assert done.status is TransferStatus.FAILED and done.dst_released
    assert type(done.error).__name__ == "NvmeIOError"
    assert t.nvme.num_free == t.nvme.num_slots
    assert t.engine.stats().num_failed == 1


def test_close_cancels_queued_transfers(tiers):
    entered, gate = threading.Event(), threading.Event()

    def hold_first(done: TransferDone) -> None:
        if done.transfer.transfer_id == 1:
            entered.set()
            gate.wait(timeout=30)

    t = tiers(on_done=hold_first)
    t.engine.submit(HBM, DRAM, [(0, 0)], TransferReason.EVICTION)
    assert entered.wait(timeout=30)
    queued = t.engine.submit(HBM, DRAM, [(1, 1)], TransferReason.EVICTION)
    closer = threading.Thread(target=t.engine.close)
    closer.start()
    while t.engine.num_pending > 1:  # close() cancels the queued one first
        threading.Event().wait(0.001)
    gate.set()
    closer.join(timeout=30)
    statuses = {d.transfer.transfer_id: d.status for d in t.engine.poll_completed()}
    assert statuses == {1: TransferStatus.OK, queued.transfer_id: TransferStatus.CANCELLED}
    assert t.engine.num_pending == 0
    with pytest.raises(InvalidArgument, match="after close"):
        t.engine.submit(HBM, DRAM, [(2, 2)], TransferReason.EVICTION)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip(tmp_path):
    hbm = PagePool(8, GEOMETRY, device="cuda")
    dram = make_dram_pool(8, GEOMETRY)
    for pool in (hbm, dram):
        while pool.allocate() is not None:
            pass
    nvme = NvmePool(tmp_path, 8, GEOMETRY)
    slots = nvme.allocate_many(2)
    engine = TransferEngine(hbm, dram, nvme)
    hbm.tensor.copy_(torch.randn(hbm.tensor.shape, device="cuda"))
    original = hbm.tensor.clone()
    engine.submit(HBM, DRAM, [(i, i) for i in range(4)], TransferReason.EVICTION)
    engine.submit(
        HBM,
        NVME,
        [(4, slots[0]), (5, slots[1])],
        TransferReason.EVICTION,
        keys=[key(0), key(1)],
        namespaces=[NS, NS],
    )
    assert engine.wait_idle(30) and all(d.is_ok for d in engine.poll_completed())
    hbm.tensor.zero_()
    engine.submit(DRAM, HBM, [(i, i) for i in range(4)], TransferReason.PROMOTION_ON_HIT)
    engine.submit(NVME, HBM, [(slots[0], 4), (slots[1], 5)], TransferReason.PROMOTION_ON_HIT)
    assert engine.wait_idle(30) and all(d.is_ok for d in engine.poll_completed())
    torch.cuda.synchronize()
    assert torch.equal(hbm.tensor[:6], original[:6])
    engine.close()
    nvme.close()


# ---- link emulation (decision 0011) ---------------------------------------------------
PAGE = GEOMETRY.page_bytes


@pytest.mark.parametrize(
    "src, dst, reason",
    [
        (HBM, DRAM, TransferReason.EVICTION),
        (DRAM, HBM, TransferReason.PROMOTION_ON_HIT),
        (HBM, NVME, TransferReason.PARK),
        (NVME, HBM, TransferReason.PREFETCH),
    ],
)
def test_an_emulated_link_is_never_faster_than_its_rate(tiers, src, dst, reason):
    rate = 40 * PAGE  # bytes/s: 8 pages take at least 0.2 s
    t = tiers(link_bytes_per_s={(src, dst): rate})
    original = t.fill_hbm(seed=7)
    pairs = [(i, i) for i in range(8)]
    if src is not HBM:  # put the pages in the source tier first (unemulated pairs: no wait)
        slots = t.nvme.allocate_many(8) if src is NVME else None
        down = t.to_nvme(HBM, [(i, s) for i, s in enumerate(slots)]) if slots else t.run(HBM, DRAM, pairs)
        assert down.is_ok and down.link_wait_s == 0.0
        pairs = [(s, i) for i, s in enumerate(slots)] if slots else pairs
        t.hbm.tensor.zero_()
    if dst is NVME:
        slots = t.nvme.allocate_many(8)
        done = t.to_nvme(HBM, [(i, s) for i, s in enumerate(slots)], reason=reason)
    else:
        done = t.run(src, dst, pairs, reason)
    assert done.is_ok and done.num_bytes == 8 * PAGE
    # A lower bound on the transfer's own latency, not a timed assertion on the test.
    assert done.run_s >= 8 * PAGE / rate and done.latency_s >= 8 * PAGE / rate
    assert done.link_wait_s > 0
    if dst is HBM:
        assert torch.equal(t.hbm.tensor[:8], original[:8])
    t.check()


def test_transfers_on_one_emulated_link_share_it(tiers):
    rate = 40 * PAGE
    t = tiers(link_bytes_per_s={(HBM, DRAM): rate, (DRAM, HBM): rate})
    t.fill_hbm()
    a = t.engine.submit(HBM, DRAM, [(i, i) for i in range(4)], TransferReason.EVICTION)
    b = t.engine.submit(HBM, DRAM, [(i, i) for i in range(4, 8)], TransferReason.EVICTION)
    assert t.engine.wait_idle(timeout_s=30)
    done = {d.transfer.transfer_id: d for d in t.engine.poll_completed()}
    assert done[a.transfer_id].is_ok and done[b.transfer_id].is_ok
    # The link is shared: the last to finish waited for (about) both transfers' bytes, far
    # more than its own 4 pages' 0.1 s (the 10 % is the real copy, credited at full rate).
    slowest = max(d.latency_s for d in done.values())
    assert slowest >= 0.9 * 8 * PAGE / rate
    t.check()


def test_dram_nvme_is_not_emulated_and_bad_rates_name_the_field():
    hbm, dram = PagePool(4, GEOMETRY), make_dram_pool(4, GEOMETRY)
    with pytest.raises(InvalidArgument, match="to or from HBM only") as exc:
        TransferEngine(hbm, dram, link_bytes_per_s={(DRAM, NVME): 1e6})
    assert exc.value.field == "link_bytes_per_s"
    for bad in (0, -1.0, float("nan"), float("inf"), "fast"):
        with pytest.raises(InvalidArgument, match="positive number of bytes/s") as exc:
            TransferEngine(hbm, dram, link_bytes_per_s={(HBM, DRAM): bad})
        assert exc.value.field == "link_bytes_per_s"


def test_cancel_during_the_emulated_wait_reports_cancelled_at_once(tiers):
    t = tiers(link_bytes_per_s={(NVME, HBM): 1.0 * PAGE})  # one page a second: 4 pages wait 4 s
    t.fill_hbm(seed=3)
    slots = t.nvme.allocate_many(4)
    assert t.to_nvme(HBM, [(i, s) for i, s in enumerate(slots)]).is_ok
    tr = t.engine.submit(NVME, HBM, [(s, 10 + i) for i, s in enumerate(slots)], TransferReason.PREFETCH)
    while True:  # the real copy is done quickly; then the job waits on the link
        with t.engine._lock:
            job = t.engine._jobs[tr.transfer_id]
            if job.result is not None:
                break
        time.sleep(0.001)
    assert t.engine.cancel(tr.transfer_id) is CancelOutcome.IN_PROGRESS
    assert t.engine.wait_idle(timeout_s=2.0)  # well before the 4 s the link would take
    (done,) = t.engine.poll_completed()
    assert done.status is TransferStatus.CANCELLED and not done.is_ok
    assert t.engine.cancel(tr.transfer_id) is CancelOutcome.NOT_PENDING
    t.check()


def test_close_cancels_transfers_waiting_on_an_emulated_link(tiers):
    t = tiers(link_bytes_per_s={(HBM, DRAM): 1.0 * PAGE})
    t.fill_hbm()
    tr = t.engine.submit(HBM, DRAM, [(i, i) for i in range(4)], TransferReason.EVICTION)
    while t.engine.num_pending and t.engine._jobs[tr.transfer_id].result is None:
        time.sleep(0.001)
    t.engine.close()
    (done,) = t.engine.poll_completed()
    assert done.status is TransferStatus.CANCELLED
    t.check()


def test_run_waits_for_the_link_thread_and_costs_nothing_unemulated(tiers):
    rate = 40 * PAGE
    t = tiers(link_bytes_per_s={(HBM, DRAM): rate}, budget_bytes_per_s=1.0)
    original = t.fill_hbm()
    started = time.monotonic()
    done = t.engine.run(HBM, DRAM, [(i, i) for i in range(4)], TransferReason.EVICTION)
    # Acknowledged by the link thread once 4 pages crossed at ``rate``; never paced (a 1 B/s
    # budget would hold a background job for hours).
    assert done.is_ok and time.monotonic() - started >= 4 * PAGE / rate and done.link_wait_s > 0
    assert all(torch.equal(t.dram.tensor[i], original[i]) for i in range(4))
    assert done.checksums == [page_checksum(original[i]) for i in range(4)]
    fast = t.engine.run(HBM, NVME, [(4, t.nvme.allocate())], TransferReason.EVICTION, keys=[key(4)], namespaces=[NS])
    assert fast.is_ok and fast.link_wait_s == 0.0  # not emulated
    assert t.engine.poll_completed() == []  # a run's result is delivered to its caller only
    stats = t.engine.stats()
    assert stats.num_ok == 2 and stats.pages_moved == {(HBM, DRAM): 4, (HBM, NVME): 1}
    t.check()


def test_an_awaited_transfer_reports_through_its_result_once(tiers):
    t = tiers(link_bytes_per_s={(DRAM, HBM): 20 * PAGE})
    t.fill_hbm()
    down = t.run(HBM, DRAM, [(0, 0), (1, 1)])
    assert down.is_ok
    background = t.engine.submit(HBM, DRAM, [(2, 2)], TransferReason.WATERMARK)
    awaited = t.engine.submit(DRAM, HBM, [(0, 10), (1, 11)], TransferReason.PROMOTION_ON_HIT, awaited=True)
    done = t.engine.result(awaited.transfer_id, timeout_s=30)
    assert done.transfer is awaited and done.is_ok and done.verified == [True, True]
    with pytest.raises(InvalidArgument, match="not awaited"):
        t.engine.result(awaited.transfer_id)
    with pytest.raises(InvalidArgument, match="not awaited"):
        t.engine.result(background.transfer_id)
    # A blocking poll hands out the background one (never the awaited one), waiting if need be.
    (bg,) = t.engine.poll_completed(timeout_s=30)
    assert bg.transfer is background and bg.is_ok
    assert t.engine.poll_completed(timeout_s=5) == []  # nothing pending: returns at once
    t.check()
