"""Tier moves as records, executed off the engine thread, acknowledged then applied (DESIGN §5.5-6).

The engine thread ``submit``s a ``Transfer`` (pages it has already allocated in the
destination tier), keeps going, and later receives a ``TransferDone`` through
``poll_completed()`` or the ``on_done`` callback. This module moves bytes and checksums
only: it never touches a radix index or a page's ref count. The caller applies an OK
result (point the index at the destination, release the source) or, for FAILED and
CANCELLED results, releases the destination pages it allocated.

Lanes keep slow disks from stalling fast copies:

    copy lane   1 thread      HBM <-> DRAM   (a CUDA stream + events when HBM is a GPU)
    disk lane   N threads     anything with NVMe: preadv/pwritev of slot runs

Each lane runs its highest ``priority`` transfer first (FIFO among equals). Pairs are an
int64 array (no Python object per page), and submission checks them with array
operations: page ranges, duplicates, held pages (``PagePool.free_mask``) and busy
destinations (a mask per tier), so submitting 8192 small pages costs ~0.5 ms, most of it
turning the caller's list of tuples into the array. On the CPU the copy lane hands the
whole id arrays to the fused copy + checksum kernel (``kvtier.tiers.copy``), which walks
them in C++ with the GIL released, in parts of ``chunk_bytes`` (32 MiB) between which
cancellation and pacing are honoured. On CUDA, and for NVMe, pairs are sorted and cut
into runs of consecutive pages: one async copy (at most ``chunk_bytes``, 8 MiB) or one
vectored syscall per run.

Checksums (``kvtier.tiers.checksum``): computed when a page leaves HBM and stored with it (the
DRAM pool's checksum array, the NVMe slot header); DRAM -> NVMe carries the stored value
rather than recomputing it, so corruption in DRAM is caught at promotion, not laundered;
every promotion verifies the bytes where they landed and reports per-page results.

CUDA (present, untested on the CPU-only CI machine): each lane has its own stream, which
first waits on an event recorded at ``submit`` on the caller's current stream (so a page
is copied as of submission and a destination page is not overwritten while earlier
kernels still read it); checksums are computed on the device; the lane thread waits on a
completion event before reporting. NVMe <-> HBM goes through a pinned staging buffer.

Lane threads run torch with ``intra_op_threads`` (default 1) OpenMP threads each, and
the copy kernel shares a part among ``copy_threads`` (default 2). Helpers pull 256 KiB
chunks from a shared counter, so a helper that a busy core keeps waiting costs nothing,
unlike an OpenMP barrier: on the 2-core CI VM, with the other core held by another
process two threads copied as fast as one; with it free, 5-10 % faster (memcpy's
second thread gained 7-17 %, in rare runs up to 1.9x). Background demotions are paced
anyway (``budget_bytes_per_s``): decode beside a 256 MiB demotion slowed 1.01-1.05x
with two threads against 0.99-1.01x with one (decision 0005).

Link emulation (``link_bytes_per_s``, off by default; ``kvtier.tiers.link_emulation``, decision
0011): a stand-in for GPU
hardware on machines without one, for benchmarks only, like a tool that sleeps. Here "HBM" is
host memory, so HBM <-> DRAM is a memcpy as fast as attention reads and NVMe -> HBM costs what
the disk costs; on a GPU both cross PCIe (~25 GB/s) or the NVMe (~7 GB/s), 100-400x slower
than the 3 TB/s that attention reads. With a rate set for a pair that touches HBM, a
transfer of that pair is acknowledged no sooner than ``bytes / rate`` after it started, the
same for demotions, promotions on hit and prefetches. The real copy runs first at full speed
(its bytes are in place, unacknowledged, as a GPU's DMA would leave them mid-flight); the job
then waits on the link thread, not in its lane, so a long emulated write never holds up a read
queued behind it (a GPU's copy engines and an NVMe's queues do not serialise that way). Each
pair (direction) is one link whose rate is split evenly among the transfers on it (processor
sharing, as concurrent DMA streams share PCIe): two concurrent promotions each get half, and
a one-page move is not queued behind a 256-page demotion, as it would be with a FIFO booking.
The time a transfer spent in its real copy counts as link time at the share it would have had.
``cancel`` during the wait reports CANCELLED at once; ``close`` cancels what still waits.
DRAM <-> NVMe is never emulated: that link is the real disk.

    submit -> lane: real copy -> link thread: until its bytes are across (shared) -> done
"""

from __future__ import annotations

import collections
import enum
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NewType

import numpy as np
import torch

from kvtier.cache.page_pool import PagePool
from kvtier.domain.errors import IntegrityError, InvalidArgument
from kvtier.domain.hashing import NamespaceDigest, PageKey
from kvtier.domain.tiers import Tier
from kvtier.tiers import copy as page_copy
from kvtier.tiers.checksum import page_checksums
from kvtier.tiers.dram import DramPool, aligned_host_tensor
from kvtier.tiers.link_emulation import EmulatedLinks, check_link_rates
from kvtier.tiers.nvme.format import DiskFull, NvmeIOError, SlotId
from kvtier.tiers.nvme.pool import NvmePool

log = logging.getLogger("kvtier.tiers.transfer")
# Credit a quiet background lane may build up: after idling, this many seconds of budget may
# move at once before pacing starts.
PACE_BURST_S = 0.05
# Bytes per copy-lane step between cancellation and pacing checks. On CUDA one run of
# consecutive pages per copy (the size measured on an H200). On the CPU one kernel call,
# which starts the helper copy thread anew: 8 MiB parts ran 2-5 % slower than 32 MiB ones
# with two threads (a 32 MiB part is ~2 ms, still a fine grain for cancelling and pacing).
CUDA_CHUNK_BYTES = 8 << 20
CPU_CHUNK_BYTES = 32 << 20

TransferId = NewType("TransferId", int)
TierPair = tuple[Tier, Tier]



class TransferReason(enum.Enum):
    EVICTION = "eviction"  # demote instead of drop when an allocation needs room
    WATERMARK = "watermark"  # background demotion above a tier's high watermark
    PREEMPTION = "preemption"  # swap out a preempted sequence
    PREFETCH = "prefetch"  # promote ahead of a predicted tool return
    PROMOTION_ON_HIT = "promotion_on_hit"  # a request matched pages in a lower tier
    DRAIN = "drain"  # operator drain of a worker or tier
    PARK = "park"  # the controller parks a paused session's pages (a Demote command)


class TransferStatus(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    CANCELLED = "cancelled"


class CancelOutcome(enum.Enum):
    BEFORE_START = "before_start"  # never ran; its TransferDone (CANCELLED) is already delivered
    IN_PROGRESS = "in_progress"  # stops at the next run boundary and reports CANCELLED
    NOT_PENDING = "not_pending"  # unknown or already completed: nothing to cancel


@dataclass(slots=True)
class Transfer:
    """One move of pages between two tiers. ``pairs[i] = (src, dst)`` are page ids in a
    pool tier or slot ids in the NVMe tier, held as a read-only int64 array ``[n, 2]`` (a
    transfer of thousands of small pages costs no Python object per page);
    ``keys``/``namespaces`` (and optionally ``parents``/``tokens``, so the index can be
    rebuilt after a restart) name the pages and are required when the destination is NVMe."""

    transfer_id: TransferId
    pairs: np.ndarray
    src_tier: Tier
    dst_tier: Tier
    reason: TransferReason
    priority: int = 0  # larger runs first
    keys: list[PageKey] | None = None
    namespaces: list[NamespaceDigest] | None = None
    parents: list[PageKey | None] | None = None
    tokens: list[tuple[int, ...]] | None = None
    submitted_at: float = 0.0  # time.monotonic()

    @property
    def num_pages(self) -> int:
        return len(self.pairs)

    @property
    def is_promotion(self) -> bool:
        return self.dst_tier.is_faster_than(self.src_tier)


@dataclass(slots=True)
class TransferDone:
    """Result of one transfer. Apply it only when ``is_ok``; with per-page failures
    (``bad_pairs``) the caller drops those pages (and what hangs below them) and recomputes.

    ``checksums[i]``: the checksum of pair i's page (taken on leaving HBM, or carried).
    ``verified[i]``: for reads from DRAM or NVMe, whether pair i's bytes matched it.
    ``dst_released``: the destinations are already free (a failed write to NVMe: the
    pool took its slots back); otherwise the caller releases them unless it applies.
    """

    transfer: Transfer
    status: TransferStatus
    checksums: list[int] = field(default_factory=list)
    verified: list[bool] | None = None
    num_bytes: int = 0
    queued_s: float = 0.0
    run_s: float = 0.0
    error: Exception | None = None
    dst_released: bool = False
    link_wait_s: float = 0.0  # of run_s, spent waiting on an emulated link after the real copy

    @property
    def latency_s(self) -> float:
        return self.queued_s + self.run_s

    @property
    def is_ok(self) -> bool:
        return self.status is TransferStatus.OK and (self.verified is None or all(self.verified))

    @property
    def bad_pairs(self) -> list[tuple[int, int]]:
        if self.verified is None:
            return []
        bad = self.transfer.pairs[~np.asarray(self.verified, dtype=bool)]
        return [(s, d) for s, d in bad.tolist()]


@dataclass(slots=True)
class TransferStats:
    """Running totals; ``num_submitted == num_ok + num_failed + num_cancelled + in flight``."""

    num_submitted: int = 0
    num_ok: int = 0
    num_failed: int = 0
    num_cancelled: int = 0
    num_checksum_failures: int = 0  # pages whose bytes did not match their checksum
    bytes_moved: dict[TierPair, int] = field(default_factory=dict)
    pages_moved: dict[TierPair, int] = field(default_factory=dict)
    latency_s_sum: dict[TierPair, float] = field(default_factory=dict)
    latency_s_max: float = 0.0

    @property
    def num_completed(self) -> int:
        return self.num_ok + self.num_failed + self.num_cancelled

    @property
    def num_in_flight(self) -> int:
        return self.num_submitted - self.num_completed

    def copy(self) -> TransferStats:
        return TransferStats(
            self.num_submitted,
            self.num_ok,
            self.num_failed,
            self.num_cancelled,
            self.num_checksum_failures,
            dict(self.bytes_moved),
            dict(self.pages_moved),
            dict(self.latency_s_sum),
            self.latency_s_max,
        )


def _pairs_array(pairs: Sequence[tuple[int, int]] | np.ndarray) -> np.ndarray:
    """``pairs`` as a read-only int64 array ``[n, 2]``, copied (the caller may reuse its list).
    Column-major: each column (all sources, all destinations) is contiguous, as the copy
    kernel takes its page ids."""
    if isinstance(pairs, np.ndarray):
        arr = np.array(pairs, dtype=np.int64, order="F")
        if arr.size == 0:
            arr = np.zeros((0, 2), dtype=np.int64, order="F")
        if arr.ndim != 2 or arr.shape[1] != 2:
            raise InvalidArgument(f"pairs must be [n, 2], got shape {arr.shape}", field="pairs")
    elif not len(pairs):
        arr = np.zeros((0, 2), dtype=np.int64, order="F")
    else:
        try:
            # No container per pair: zip(*pairs) made one iterator per pair, which set off the
            # garbage collector (a full pass over torch's objects: 5 ms per 8192 pairs).
            if set(map(len, pairs)) != {2}:
                raise ValueError("a pair that is not (source page, destination page)")
            flat = np.fromiter(itertools.chain.from_iterable(pairs), dtype=np.int64, count=2 * len(pairs))
            arr = np.asfortranarray(flat.reshape(-1, 2))
        except (TypeError, ValueError) as exc:
            message = f"pairs must be (source page, destination page) ints: {exc}"
            raise InvalidArgument(message, field="pairs") from None
    arr.flags.writeable = False
    return arr


class _Cancelled(Exception):
    """Raised inside a running transfer at a run boundary after ``cancel``."""


@dataclass(slots=True, eq=False)
class _Job:
    transfer: Transfer
    lane: _Lane
    ready_event: Any = None  # torch.cuda.Event recorded at submit (CUDA only)
    running: bool = False
    cancel_requested: bool = False
    done: bool = False
    moved_bytes: int = 0
    charged_bytes: int = 0  # of moved_bytes, already charged to the engine's budget
    dst_released: bool = False
    started_at: float = 0.0
    result: TransferDone | None = None  # held while the job waits on an emulated link
    # Set for a transfer its caller waits on (``run``, ``submit(awaited=True)``): its
    # TransferDone goes here instead of to ``poll_completed``.
    future: Future[TransferDone] | None = None

    @property
    def is_paced(self) -> bool:
        """Background work only: a promotion, or any transfer a caller waits on, is never paced."""
        return self.future is None and not self.transfer.is_promotion


class _Lane:
    """Priority queue + worker threads. Cancelled jobs are skipped when popped."""

    def __init__(
        self, name: str, num_threads: int, run: Callable[[_Job], None], intra_op_threads: int
    ) -> None:
        self.name = name
        self._intra_op_threads = intra_op_threads
        self._heap: list[tuple[int, int, _Job]] = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._run = run
        self.threads = [
            threading.Thread(target=self._loop, name=f"kvtier-{name}-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self.threads:
            t.start()

    def put(self, job: _Job) -> None:
        with self._cv:
            heapq.heappush(self._heap, (-job.transfer.priority, next(self._order), job))
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self.threads:
            t.join()

    def _loop(self) -> None:
        # Per-thread with the OpenMP backend. One core per lane thread leaves the rest to
        # decode, and avoids OpenMP barriers on a busy core: a 2 MiB copy_ split over 2
        # threads fell from 18 GB/s to 0.3 GB/s when another process held one of 2 cores.
        torch.set_num_threads(self._intra_op_threads)
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                _, _, job = heapq.heappop(self._heap)
            self._run(job)


class TransferEngine:
    """Runs transfers between an HBM pool and optional DRAM and NVMe tiers.

    Contract: the caller owns every page and slot named in a transfer from ``submit``
    until its ``TransferDone`` arrives: sources stay pinned (not written, not freed),
    destinations stay allocated. A destination may be the target of one pending
    transfer at a time (``submit`` raises otherwise). ``on_done`` runs on a worker
    thread and must not block; ``poll_completed`` is the engine-thread alternative, and
    a transfer the caller waits on (``run``, ``submit(awaited=True)``) reports through
    its own completion future (``result``) instead.
    """

    def __init__(
        self,
        hbm: PagePool,
        dram: DramPool | None = None,
        nvme: NvmePool | None = None,
        *,
        num_disk_threads: int = 2,
        chunk_bytes: int | None = None,
        intra_op_threads: int = 1,
        copy_threads: int = 2,
        on_done: Callable[[TransferDone], None] | None = None,
        budget_bytes_per_s: float | None = None,
        link_bytes_per_s: Mapping[TierPair, float] | None = None,
    ) -> None:
        self.budget_bytes_per_s = budget_bytes_per_s
        self.link_bytes_per_s = check_link_rates(link_bytes_per_s)
        self._links = EmulatedLinks(self.link_bytes_per_s, self._link_done) if self.link_bytes_per_s else None
        # One budget for the whole engine, shared by every background job on both lanes: the
        # time by which the bytes charged so far fit it (see _pace).
        self._pace_lock = threading.Lock()
        self._paced_until = 0.0
        self._pools: dict[Tier, PagePool | NvmePool] = {Tier.HBM: hbm}
        if dram is not None:
            self._pools[Tier.DRAM] = dram
        if nvme is not None:
            self._pools[Tier.NVME] = nvme
        page_bytes = {tier: pool.geometry.page_bytes for tier, pool in self._pools.items()}
        if len(set(page_bytes.values())) != 1:
            raise InvalidArgument(f"tiers disagree on the page size in bytes: {page_bytes}")
        self.page_bytes = hbm.geometry.page_bytes
        self.hbm, self.dram, self.nvme = hbm, dram, nvme
        self.is_cuda = hbm.tensor.is_cuda
        if chunk_bytes is None:
            chunk_bytes = CUDA_CHUNK_BYTES if self.is_cuda else CPU_CHUNK_BYTES
        self.chunk_pages = max(1, chunk_bytes // self.page_bytes)
        self.copy_threads = copy_threads
        self.on_done = on_done
        # One CUDA stream per lane, so a disk job never queues behind a device copy.
        self._streams: dict[str, Any] = (
            {lane: torch.cuda.Stream(device=hbm.tensor.device) for lane in ("copy", "disk")}
            if self.is_cuda
            else {}
        )
        self._staging = threading.local()
        self._lock = threading.Lock()
        # Notified on every completion: ``wait_idle`` and a blocking ``poll_completed`` wait on it.
        self._changed = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._jobs: dict[TransferId, _Job] = {}
        # Per destination tier, per page or slot id: a pending transfer writes it. A mask, not
        # a dict of ids, so marking and clearing 8192 destinations is one array operation.
        self._busy_dst: dict[Tier, np.ndarray] = {
            tier: np.zeros(pool.num_slots if isinstance(pool, NvmePool) else pool.num_pages, dtype=bool)
            for tier, pool in self._pools.items()
        }
        self._completed: collections.deque[TransferDone] = collections.deque()
        self._futures: dict[TransferId, Future[TransferDone]] = {}  # awaited transfers until ``result``
        self._stats = TransferStats()
        self._closed = False
        if not self.is_cuda:
            # Build or load the copy kernel now, not on the first transfer: a first build takes
            # seconds, and a commanded move would wait that long for its acknowledgement.
            page_copy.kernel_enabled()
        self._copy_lane = _Lane("copy", 1, self._execute, intra_op_threads)
        self._disk_lane = _Lane("disk", num_disk_threads, self._execute, intra_op_threads)

    # ---- submission -------------------------------------------------------------------
    def submit(
        self,
        src_tier: Tier,
        dst_tier: Tier,
        pairs: Sequence[tuple[int, int]] | np.ndarray,
        reason: TransferReason,
        *,
        priority: int = 0,
        keys: Sequence[PageKey] | None = None,
        namespaces: Sequence[NamespaceDigest] | None = None,
        parents: Sequence[PageKey | None] | None = None,
        tokens: Sequence[Sequence[int]] | None = None,
        awaited: bool = False,
    ) -> Transfer:
        """Queue a transfer and return its record; raises ``InvalidArgument`` for a
        malformed one (unknown tier, page out of range, a source without a checksum, a
        destination already targeted by a pending transfer). ``awaited``: the caller
        blocks on it with ``result``, which alone delivers its ``TransferDone``."""
        transfer = self._record(src_tier, dst_tier, pairs, reason, priority, keys, namespaces, parents, tokens)
        job = self._admit(transfer, awaited=awaited)
        job.lane.put(job)
        return transfer

    def run(
        self,
        src_tier: Tier,
        dst_tier: Tier,
        pairs: Sequence[tuple[int, int]] | np.ndarray,
        reason: TransferReason,
        *,
        keys: Sequence[PageKey] | None = None,
        namespaces: Sequence[NamespaceDigest] | None = None,
        parents: Sequence[PageKey | None] | None = None,
        tokens: Sequence[Sequence[int]] | None = None,
    ) -> TransferDone:
        """Run a transfer now, on the calling thread, and return its ``TransferDone`` once it is
        acknowledged: for a synchronous move (a spill) whose caller cannot go on without the room.

        It is checked, counted and checksummed as a submitted one, but never queued behind a
        lane's background jobs and never paced. With an emulated link the caller then waits on
        the transfer's completion future, which the link thread sets when the bytes are across.
        """
        transfer = self._record(src_tier, dst_tier, pairs, reason, 0, keys, namespaces, parents, tokens)
        job = self._admit(transfer, awaited=True)
        self._execute(job, inline=True)
        return self.result(transfer.transfer_id)

    def result(self, transfer_id: TransferId, timeout_s: float | None = None) -> TransferDone:
        """Block until an awaited transfer (``run``, ``submit(awaited=True)``) completes and
        return its ``TransferDone``, exactly once; ``TimeoutError`` after ``timeout_s``."""
        with self._lock:
            future = self._futures.pop(transfer_id, None)
        if future is None:
            raise InvalidArgument(f"transfer {transfer_id} is not awaited, or its result was taken", field="transfer_id")
        return future.result(timeout_s)

    def _record(
        self,
        src_tier: Tier,
        dst_tier: Tier,
        pairs: Sequence[tuple[int, int]] | np.ndarray,
        reason: TransferReason,
        priority: int,
        keys: Sequence[PageKey] | None,
        namespaces: Sequence[NamespaceDigest] | None,
        parents: Sequence[PageKey | None] | None,
        tokens: Sequence[Sequence[int]] | None,
    ) -> Transfer:
        transfer = Transfer(
            transfer_id=TransferId(0),
            pairs=_pairs_array(pairs),
            src_tier=src_tier,
            dst_tier=dst_tier,
            reason=reason,
            priority=priority,
            keys=list(keys) if keys is not None else None,
            namespaces=list(namespaces) if namespaces is not None else None,
            parents=list(parents) if parents is not None else None,
            tokens=[tuple(t) for t in tokens] if tokens is not None else None,
            submitted_at=time.monotonic(),
        )
        self._validate(transfer)
        return transfer

    def _admit(self, transfer: Transfer, *, awaited: bool) -> _Job:
        """Give a checked transfer its id and mark its destinations busy; its job, not yet run."""
        uses_disk = Tier.NVME in (transfer.src_tier, transfer.dst_tier)
        job = _Job(transfer, self._disk_lane if uses_disk else self._copy_lane)
        if awaited:
            job.future = Future()
        if self.is_cuda:
            job.ready_event = torch.cuda.Event()
            job.ready_event.record()
        dst_tier = transfer.dst_tier
        dsts = transfer.pairs[:, 1]
        with self._lock:
            if self._closed:
                raise InvalidArgument("submit after close()")
            busy = self._busy_dst[dst_tier]
            taken = busy[dsts]
            if taken.any():
                d = int(dsts[taken][0])
                other = next(
                    (
                        j.transfer.transfer_id
                        for j in self._jobs.values()
                        if j.transfer.dst_tier is dst_tier and (j.transfer.pairs[:, 1] == d).any()
                    ),
                    None,
                )
                raise InvalidArgument(
                    f"{dst_tier.label} page {d} is already the destination of pending transfer {other}"
                )
            transfer.transfer_id = TransferId(next(self._ids))
            busy[dsts] = True
            self._jobs[transfer.transfer_id] = job
            if job.future is not None:
                self._futures[transfer.transfer_id] = job.future
            self._stats.num_submitted += 1
        return job

    def _validate(self, t: Transfer) -> None:
        """Whole-array checks: a transfer of 8192 small pages must not cost 8192 Python calls."""
        for tier in (t.src_tier, t.dst_tier):
            if tier not in self._pools:
                raise InvalidArgument(f"transfer engine has no {tier.label} tier", field="tier")
        if t.src_tier == t.dst_tier:
            raise InvalidArgument(f"transfer from {t.src_tier.label} to itself", field="dst_tier")
        n = len(t.pairs)
        if not n:
            raise InvalidArgument("transfer with no pages", field="pairs")
        for side, tier in ((0, t.src_tier), (1, t.dst_tier)):
            pool = self._pools[tier]
            limit = pool.num_slots if isinstance(pool, NvmePool) else pool.num_pages
            ids = t.pairs[:, side]
            out_of_range = (ids < 0) | (ids >= limit)
            if out_of_range.any():
                bad = int(ids[out_of_range][0])
                raise InvalidArgument(f"{tier.label} page {bad} out of range [0, {limit})", field="pairs")
            ordered = ids if (np.diff(ids) > 0).all() else np.sort(ids)
            if (np.diff(ordered) == 0).any():
                raise InvalidArgument(f"a {tier.label} page appears twice in one transfer", field="pairs")
            if isinstance(pool, PagePool):
                free = pool.free_mask(ids)
                if free.any():
                    raise InvalidArgument(
                        f"{tier.label} page {int(ids[free][0])} is free; the caller holds every page it names "
                        "until the transfer completes",
                        field="pairs",
                    )
        if t.dst_tier is Tier.NVME:
            assert self.nvme is not None
            reserved = self.nvme.reserved_mask(t.pairs[:, 1])
            if not reserved.all():
                unreserved = int(t.pairs[~reserved, 1][0])
                raise InvalidArgument(
                    f"nvme slot {unreserved} is not reserved (allocate it first)", field="pairs"
                )
            for name, seq in (("keys", t.keys), ("namespaces", t.namespaces)):
                if seq is None or len(seq) != n:
                    raise InvalidArgument(f"a transfer to nvme needs {n} {name}", field=name)
            for name, seq in (("parents", t.parents), ("tokens", t.tokens)):
                if seq is not None and len(seq) != n:
                    raise InvalidArgument(f"{n} pages but {len(seq)} {name}", field=name)
        if t.src_tier is Tier.DRAM:
            assert self.dram is not None
            present = self.dram.checksum_array(t.pairs[:, 0])[1]
            if not present.all():
                missing = int(t.pairs[~present, 0][0])
                raise InvalidArgument(
                    f"dram page {missing} has no checksum; pages enter DRAM only through a transfer",
                    field="pairs",
                )
        if t.src_tier is Tier.NVME:
            assert self.nvme is not None
            stored = self.nvme.stored_mask(t.pairs[:, 0])
            if not stored.all():
                raise InvalidArgument(f"nvme slot {int(t.pairs[~stored, 0][0])} holds no page", field="pairs")

    # ---- cancellation, completion -----------------------------------------------------
    def cancel(self, transfer_id: TransferId) -> CancelOutcome:
        on_link = False
        with self._lock:
            job = self._jobs.get(transfer_id)
            if job is None or job.done:
                return CancelOutcome.NOT_PENDING
            if job.running:
                job.cancel_requested = True
                on_link = job.result is not None
            else:
                job.done = True  # the lane skips it when popped
        if job.running:
            if on_link and self._links is not None:  # the link thread reports it now
                self._links.wake()
            return CancelOutcome.IN_PROGRESS
        self._deliver(job, TransferDone(job.transfer, TransferStatus.CANCELLED, queued_s=self._age(job)))
        return CancelOutcome.BEFORE_START

    def poll_completed(self, max_items: int | None = None, *, timeout_s: float = 0.0) -> list[TransferDone]:
        """Completed transfers in completion order (each delivered once; awaited ones never).

        With ``timeout_s`` and none completed yet, block on the completion condition until one
        is, no transfer is pending any more, or ``timeout_s`` passed (an empty list)."""
        with self._changed:
            if timeout_s > 0 and not self._completed:
                self._changed.wait_for(lambda: self._completed or not self._jobs, timeout=timeout_s)
            n = len(self._completed) if max_items is None else min(max_items, len(self._completed))
            return [self._completed.popleft() for _ in range(n)]

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no transfer is pending; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._jobs, timeout=timeout_s)

    def stats(self) -> TransferStats:
        with self._lock:
            return self._stats.copy()

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._jobs)

    def close(self) -> None:
        """Cancel what has not started, let running transfers finish, stop the threads."""
        with self._lock:
            self._closed = True
            queued = [tid for tid, job in self._jobs.items() if not job.running]
        for tid in queued:
            self.cancel(tid)
        self._copy_lane.close()
        self._disk_lane.close()
        if self._links is not None:  # what still waits on an emulated link: CANCELLED now
            self._links.close()

    def check_integrity(self) -> None:
        with self._lock:
            problems: list[str] = []
            s = self._stats
            if s.num_in_flight != len(self._jobs):
                problems.append(f"stats say {s.num_in_flight} in flight, {len(self._jobs)} jobs pending")
            expected: dict[Tier, set[int]] = {tier: set() for tier in self._busy_dst}
            for j in self._jobs.values():
                expected[j.transfer.dst_tier].update(j.transfer.pairs[:, 1].tolist())
            for tier, busy in self._busy_dst.items():
                marked = set(np.flatnonzero(busy).tolist())
                if expected[tier] != marked:
                    problems.append(
                        f"{len(marked)} busy {tier.label} destinations, "
                        f"pending transfers name {len(expected[tier])}"
                    )
            if any(v < 0 for v in s.bytes_moved.values()):
                problems.append("negative byte count")
        if problems:
            raise IntegrityError("transfer engine integrity: " + "; ".join(problems))

    @staticmethod
    def _age(job: _Job) -> float:
        return time.monotonic() - job.transfer.submitted_at

    def _deliver(self, job: _Job, done: TransferDone) -> None:
        t = job.transfer
        pair = (t.src_tier, t.dst_tier)
        with self._lock:
            s = self._stats
            if done.status is TransferStatus.OK:
                s.num_ok += 1
            elif done.status is TransferStatus.FAILED:
                s.num_failed += 1
            else:
                s.num_cancelled += 1
            if done.verified is not None:
                s.num_checksum_failures += done.verified.count(False)
            if done.num_bytes:
                s.bytes_moved[pair] = s.bytes_moved.get(pair, 0) + done.num_bytes
                s.pages_moved[pair] = s.pages_moved.get(pair, 0) + done.num_bytes // self.page_bytes
            s.latency_s_sum[pair] = s.latency_s_sum.get(pair, 0.0) + done.latency_s
            s.latency_s_max = max(s.latency_s_max, done.latency_s)
            self._busy_dst[t.dst_tier][t.pairs[:, 1]] = False
            del self._jobs[t.transfer_id]
            if job.future is None:
                self._completed.append(done)
            self._changed.notify_all()
        if job.future is not None:
            job.future.set_result(done)
        if self.on_done is not None:
            try:
                self.on_done(done)
            except Exception:
                log.exception("transfer on_done callback raised", extra={"transfer_id": t.transfer_id})

    # ---- execution --------------------------------------------------------------------
    def _execute(self, job: _Job, *, inline: bool = False) -> None:
        """Run one job (on a lane thread, or ``inline`` on the caller's: ``run``) and report it."""
        with self._lock:
            if job.done:
                return
            job.running = True
        t = job.transfer
        if self.nvme is not None and job.lane is self._disk_lane and not inline:
            self.nvme.flush_frees()  # header rewrites of freed slots, off the engine thread
        started = job.started_at = time.monotonic()
        queued_s = started - t.submitted_at
        try:
            checksums, verified = self._run(job)
        except _Cancelled:
            done = TransferDone(t, TransferStatus.CANCELLED, num_bytes=job.moved_bytes)
        except Exception as exc:  # reported, never raised into a worker thread's void
            log.warning(
                "transfer failed",
                extra={
                    "transfer_id": t.transfer_id,
                    "src": t.src_tier.label,
                    "dst": t.dst_tier.label,
                    "error": type(exc).__name__,
                },
            )
            done = TransferDone(t, TransferStatus.FAILED, num_bytes=job.moved_bytes, error=exc)
            done.dst_released = job.dst_released
        else:
            done = TransferDone(t, TransferStatus.OK, checksums, verified, job.moved_bytes)
        self._pace(job, wait=False)  # the last run's bytes: the next background job pays
        done.queued_s = queued_s
        if done.status is TransferStatus.OK and self._wait_on_link(job, done):
            return  # the link thread finishes it
        self._finish(job, done)

    def _finish(self, job: _Job, done: TransferDone) -> None:
        done.run_s = time.monotonic() - job.started_at
        with self._lock:
            job.done = True
            # Decided under the lock: once cancel() has answered IN_PROGRESS, the result
            # is CANCELLED even if the bytes all arrived.
            if job.cancel_requested and done.status is TransferStatus.OK:
                done.status = TransferStatus.CANCELLED
        self._deliver(job, done)

    # ---- link emulation (module doc) --------------------------------------------------
    def _wait_on_link(self, job: _Job, done: TransferDone) -> bool:
        """Hand a copied job to the link thread until its emulated link has carried its
        bytes; False when it need not wait (no emulation, already slower, or cancelled)."""
        t = job.transfer
        pair = (t.src_tier, t.dst_tier)
        rate = self.link_bytes_per_s.get(pair)
        if self._links is None or rate is None or not job.moved_bytes:
            return False
        if time.monotonic() - job.started_at >= job.moved_bytes / rate:
            return False
        with self._lock:
            if job.cancel_requested:
                return False
            job.result = done
        if self._links.add(pair, job.moved_bytes, job.started_at, job=job):
            return True
        with self._lock:  # closed meanwhile
            job.result = None
            job.cancel_requested = True
        return False

    def _link_done(self, job: _Job, waited_s: float, closed: bool) -> None:
        with self._lock:
            done, job.result = job.result, None
            if closed:
                job.cancel_requested = True
        assert done is not None, "a job on an emulated link holds its result"
        done.link_wait_s = waited_s
        self._finish(job, done)

    @staticmethod
    def _runs(pairs: np.ndarray, limit: int, *, by: str = "both") -> list[np.ndarray]:
        """Positions into ``pairs`` grouped into runs of at most ``limit``: where src and dst
        both advance by one (``by="both"``), or dst alone (``by="dst"``)."""
        if by == "both" and len(pairs) > 1 and (np.diff(pairs, axis=0) == 1).all():
            # Already one run (the common case): no sort.
            whole = np.arange(len(pairs))
            return [whole[c : c + limit] for c in range(0, len(pairs), limit)]
        if by == "both":
            order = np.lexsort((pairs[:, 1], pairs[:, 0]))
            ordered = pairs[order]
            step = (np.diff(ordered[:, 0]) != 1) | (np.diff(ordered[:, 1]) != 1)
        else:
            order = np.argsort(pairs[:, 1], kind="stable")
            step = np.diff(pairs[order, 1]) != 1
        runs: list[np.ndarray] = []
        for segment in np.split(order, np.flatnonzero(step) + 1):
            runs.extend(segment[c : c + limit] for c in range(0, len(segment), limit))
        return runs

    def _check_cancel(self, job: _Job) -> None:
        """Called between runs: honours cancellation, and paces background transfers."""
        if job.cancel_requested:
            raise _Cancelled
        self._pace(job)

    def _pace(self, job: _Job, *, wait: bool = True) -> None:
        """Charge the bytes ``job`` moved since its last charge to the engine's budget
        (``budget_bytes_per_s``) and, with ``wait``, sleep while the engine is ahead of it.

        The budget is one virtual clock shared by all background jobs, so many small
        demotions are paced like one large one. Idle time earns at most ``PACE_BURST_S``
        of credit. Promotions and awaited transfers are never paced: a caller waits on them.
        """
        budget = self.budget_bytes_per_s
        if not budget or not job.is_paced:
            return
        delta = job.moved_bytes - job.charged_bytes
        job.charged_bytes = job.moved_bytes
        now = time.monotonic()
        with self._pace_lock:
            self._paced_until = max(self._paced_until, now - PACE_BURST_S) + delta / budget
            ahead_s = self._paced_until - now
        while wait and ahead_s > 0:
            time.sleep(min(ahead_s, 0.05))
            if job.cancel_requested:
                raise _Cancelled
            ahead_s = self._paced_until - time.monotonic()

    def _run(self, job: _Job) -> tuple[list[int], list[bool] | None]:
        if not self.is_cuda:
            return self._dispatch(job)
        stream = self._streams[job.lane.name]
        # Every device op of this job runs on the lane's stream, after the work the
        # caller had queued when it submitted (pages as of submission; a destination
        # page is not overwritten while earlier kernels still read it).
        stream.wait_event(job.ready_event)
        with torch.cuda.stream(stream):
            return self._dispatch(job)

    def _dispatch(self, job: _Job) -> tuple[list[int], list[bool] | None]:
        t = job.transfer
        pairs = t.pairs
        key = (t.src_tier, t.dst_tier)
        if key == (Tier.HBM, Tier.DRAM):
            return self._hbm_to_dram(job, pairs).tolist(), None
        if key == (Tier.DRAM, Tier.HBM):
            return self._dram_to_hbm(job, pairs)
        if t.dst_tier is Tier.NVME:
            return self._to_nvme(job, pairs).tolist(), None
        if t.src_tier is Tier.NVME:
            return self._from_nvme(job, pairs)
        raise InvalidArgument(f"no transfer path from {t.src_tier.label} to {t.dst_tier.label}")

    def _memcpy_runs(
        self, job: _Job, pairs: np.ndarray, src: torch.Tensor, dst: torch.Tensor, on: str
    ) -> np.ndarray:
        """Copy every run (one call each, checksummed on the way); return each pair's
        checksum (uint64) of the ``on`` side, "src" or "dst".

        On CUDA every run's copy and checksum is queued on the lane's stream and the thread
        waits once, at the end: waiting per run left the copy engine idle between runs
        (0.5x a single ``copy_`` on an H200). A cancelled or failed job still waits for what
        it queued, so no destination page is handed back while a copy may write it.
        """
        if not self.is_cuda:
            return self._memcpy_pages(job, pairs, src, dst)
        sums = np.zeros(len(pairs), dtype=np.uint64)
        queued: list[tuple[np.ndarray, torch.Tensor]] = []
        try:
            for run in self._runs(pairs, self.chunk_pages):
                self._check_cancel(job)
                s0, d0 = int(pairs[run[0], 0]), int(pairs[run[0], 1])
                k = len(run)
                queued.append((run, self._cuda_copy(src[s0 : s0 + k], dst[d0 : d0 + k], on)))
                job.moved_bytes += k * self.page_bytes
        finally:
            if queued:
                finished = torch.cuda.Event()
                finished.record()
                finished.synchronize()  # blocks this lane thread only
        if queued:
            values = torch.cat([v for _, v in queued]).cpu()
            sums[np.concatenate([r for r, _ in queued])] = values.numpy().view(np.uint64)
        return sums

    def _memcpy_pages(self, job: _Job, pairs: np.ndarray, src: torch.Tensor, dst: torch.Tensor) -> np.ndarray:
        """CPU: copy and checksum every pair in one ``page_copy`` call that walks the page ids
        in C++ (no sort into runs, no per-page Python), in parts of ``chunk_pages`` pairs
        between which the job honours cancellation and the pacing budget. Each word is
        stored and summed while it is in a register, so a sum is that of both sides."""

        def before_part(num_copied: int) -> None:
            job.moved_bytes = num_copied * self.page_bytes
            self._check_cancel(job)

        sums = page_copy.copy_pages_with_checksums(
            src,
            dst,
            pairs[:, 0],
            pairs[:, 1],
            part_pages=self.chunk_pages,
            before_part=before_part,
            num_threads=self.copy_threads,
        )
        job.moved_bytes = len(pairs) * self.page_bytes
        return sums

    @staticmethod
    def _cuda_copy(src: torch.Tensor, dst: torch.Tensor, on: str) -> torch.Tensor:
        """Queue one async copy between HBM and pinned DRAM on the current (lane) stream and
        the page checksums (a device tensor, valid once the stream reaches this point)."""
        # Sum where the bytes are in HBM: before they leave, after they arrive.
        if on == "src" and src.is_cuda:
            sums = page_checksums(src)
            dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src, non_blocking=True)
            sums = page_checksums(dst if dst.is_cuda else src)
        return sums

    def _hbm_to_dram(self, job: _Job, pairs: np.ndarray) -> np.ndarray:
        assert self.dram is not None
        sums = self._memcpy_runs(
            job, pairs, self.hbm.tensor, self.dram.tensor, "src" if self.is_cuda else "dst"
        )
        self.dram.set_checksums(pairs[:, 1], sums)
        return sums

    def _dram_to_hbm(self, job: _Job, pairs: np.ndarray) -> tuple[list[int], list[bool]]:
        assert self.dram is not None
        expected, present = self.dram.checksum_array(pairs[:, 0])
        got = self._memcpy_runs(job, pairs, self.dram.tensor, self.hbm.tensor, "dst")
        return expected.tolist(), ((got == expected) & present).tolist()

    def _host_pages(self, num_pages: int) -> torch.Tensor:
        """Per-thread aligned (pinned on CUDA) staging pages for NVMe <-> GPU HBM."""
        buf = getattr(self._staging, "pages", None)
        if buf is None or buf.shape[0] < num_pages:
            g = self.hbm.geometry
            raw = aligned_host_tensor(num_pages * self.page_bytes, pin_memory=True)
            shape = (num_pages, g.num_layers, 2, g.page_size, g.kv_heads, g.head_dim)
            buf = raw.view(g.dtype).view(shape)
            self._staging.pages = buf
        return buf[:num_pages]

    def _to_nvme(self, job: _Job, pairs: np.ndarray) -> np.ndarray:
        t = job.transfer
        nvme = self.nvme
        assert nvme is not None and t.keys is not None and t.namespaces is not None
        from_hbm = t.src_tier is Tier.HBM
        src = self.hbm.tensor if from_hbm else self.dram.tensor  # type: ignore[union-attr]
        if from_hbm:
            sums = np.zeros(len(pairs), dtype=np.uint64)
        else:
            assert self.dram is not None
            sums = self.dram.checksum_array(pairs[:, 0])[0]  # carried, not recomputed
        for group in self._runs(pairs, nvme.max_slots_per_io, by="dst"):
            self._check_cancel(job)
            ids = pairs[group, 0]
            if from_hbm:
                # Checksum per run of consecutive source pages, in HBM, before they leave.
                for part in np.split(np.arange(len(ids)), np.flatnonzero(np.diff(ids) != 1) + 1):
                    a = int(ids[part[0]])
                    values = page_copy.checksums(src[a : a + len(part)]).cpu()
                    sums[group[part]] = values.numpy().view(np.uint64)
            # Host pages go out straight from the pool (pages picked by row, no per-page
            # tensor); device pages through the staging buffer.
            pages, rows = src, ids
            if src.is_cuda:
                pages, rows = self._host_pages(len(ids)), None
                for j, i in enumerate(ids.tolist()):
                    pages[j].copy_(src[i])
            try:
                positions = group.tolist()
                nvme.write_pages(
                    pairs[group, 1],
                    pages,
                    [t.keys[i] for i in positions],
                    [t.namespaces[i] for i in positions],
                    sums[group],
                    parents=[t.parents[i] for i in positions] if t.parents else None,
                    tokens=[t.tokens[i] for i in positions] if t.tokens else None,
                    rows=rows,
                )
            except (DiskFull, NvmeIOError):
                # write_pages gave this group's slots back; give back the rest too, so a
                # failed transfer to NVMe leaves every destination slot free.
                failed = set(group.tolist())
                for i in range(len(pairs)):
                    if i not in failed:
                        nvme.free(SlotId(int(pairs[i, 1])))
                job.dst_released = True
                raise
            job.moved_bytes += len(group) * self.page_bytes
        return sums

    def _from_nvme(self, job: _Job, pairs: np.ndarray) -> tuple[list[int], list[bool]]:
        nvme = self.nvme
        assert nvme is not None
        t = job.transfer
        dst_pool = self.hbm if t.dst_tier is Tier.HBM else self.dram
        assert dst_pool is not None
        sums = np.zeros(len(pairs), dtype=np.uint64)
        ok = np.zeros(len(pairs), dtype=bool)
        for group in self._runs(pairs, nvme.max_slots_per_io, by="dst"):
            self._check_cancel(job)
            d0, k = int(pairs[group[0], 1]), len(group)
            slots = pairs[group, 0]
            target = dst_pool.tensor[d0 : d0 + k]
            staged = self._host_pages(k) if target.is_cuda else target
            verdicts = nvme.read_pages(slots, staged)
            if staged is not target:
                target.copy_(staged)
            sums[group] = nvme.stored_checksums(slots)
            ok[group] = [v.ok for v in verdicts]
            job.moved_bytes += k * self.page_bytes
        if isinstance(dst_pool, DramPool):
            dst_pool.set_checksums(pairs[ok, 1], sums[ok])
        return sums.tolist(), ok.tolist()
