"""Tier moves as records, executed off the engine thread, acknowledged then applied (DESIGN §5.5-6).

This module holds the records (``Transfer``, ``TransferDone``, ``TransferStats``); the engine
that runs them is ``kvtier.tiers.transfer_engine``, with its lanes in ``transfer_lanes`` and its
byte paths per tier pair in ``transfer_paths``. The engine thread ``submit``s a ``Transfer``
(pages it has already allocated in the destination tier), keeps going, and later receives a
``TransferDone`` through ``poll_completed()`` or the ``on_done`` callback; a synchronous move
(``run``) waits for its own. The transfer engine moves bytes and checksums only: it never
touches a radix index or a page's ref count. The caller applies an OK result (point the index
at the destination, release the source) or, for FAILED and CANCELLED results, releases the
destination pages it allocated.

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

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import numpy as np

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.hashing import NamespaceDigest, PageKey
from kvtier.domain.tiers import Tier

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


def pairs_array(pairs: Sequence[tuple[int, int]] | np.ndarray) -> np.ndarray:
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


