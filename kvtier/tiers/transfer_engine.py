"""The transfer engine: runs ``Transfer`` records (``kvtier.tiers.transfer``, whose doc describes
lanes, checksums, CUDA streams, pacing and link emulation) off the engine thread, or on it for a
synchronous move (``run``), and reports each as a ``TransferDone``: to ``poll_completed``, to the
awaiting caller (``result``), and to ``on_done``."""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from kvtier.cache.page_pool import PagePool
from kvtier.domain.errors import IntegrityError, InvalidArgument
from kvtier.domain.hashing import NamespaceDigest, PageKey
from kvtier.domain.tiers import Tier
from kvtier.tiers import copy as page_copy
from kvtier.tiers.dram import DramPool
from kvtier.tiers.link_emulation import EmulatedLinks, check_link_rates
from kvtier.tiers.nvme.pool import NvmePool
from kvtier.tiers.page_codec import PageCodec
from kvtier.tiers.transfer import (
    CancelOutcome,
    TierPair,
    Transfer,
    TransferDone,
    TransferId,
    TransferReason,
    TransferStats,
    TransferStatus,
    pairs_array,
)
from kvtier.tiers.transfer_lanes import Cancelled, Job, Lane
from kvtier.tiers.transfer_paths import CopyPaths

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
# Disk-lane threads. A disk thread checksums each run it read before it issues its next read,
# so with two the device sat idle while both summed; four keep reads in flight meanwhile
# (decision 0019: NVMe reads 1.06-1.46x the speed of two threads, quiet and with a core burnt).
DISK_THREADS = 4


class TransferEngine(CopyPaths):
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
        num_disk_threads: int = DISK_THREADS,
        chunk_bytes: int | None = None,
        intra_op_threads: int = 1,
        copy_threads: int = 2,
        on_done: Callable[[TransferDone], None] | None = None,
        budget_bytes_per_s: float | None = None,
        link_bytes_per_s: Mapping[TierPair, float] | None = None,
        codec: PageCodec | None = None,
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
        # Below HBM pages are in the codec's format when there is one (kvtier.tiers.page_codec).
        self.codec = codec
        self.lower_geometry = hbm.geometry if codec is None else codec.lower_geometry
        page_bytes = {tier: pool.geometry.page_bytes for tier, pool in self._pools.items()}
        expected = dict.fromkeys(page_bytes, self.lower_geometry.page_bytes)
        expected[Tier.HBM] = hbm.geometry.page_bytes
        if page_bytes != expected:
            raise InvalidArgument(f"tiers disagree on the page size in bytes: {page_bytes}, expected {expected}")
        # Bytes of one page as it is stored below HBM: what every transfer moves and is paced by.
        self.page_bytes = self.lower_geometry.page_bytes
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
        self._jobs: dict[TransferId, Job] = {}
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
        self._copy_lane = Lane("copy", 1, self._execute, intra_op_threads)
        self._disk_lane = Lane("disk", num_disk_threads, self._execute, intra_op_threads)

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
            pairs=pairs_array(pairs),
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

    def _admit(self, transfer: Transfer, *, awaited: bool) -> Job:
        """Give a checked transfer its id and mark its destinations busy; its job, not yet run."""
        uses_disk = Tier.NVME in (transfer.src_tier, transfer.dst_tier)
        job = Job(transfer, self._disk_lane if uses_disk else self._copy_lane)
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
            for name, given in (("parents", t.parents), ("tokens", t.tokens)):
                if given is not None and len(given) != n:
                    raise InvalidArgument(f"{n} pages but {len(given)} {name}", field=name)
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
    def _age(job: Job) -> float:
        return time.monotonic() - job.transfer.submitted_at

    def _deliver(self, job: Job, done: TransferDone) -> None:
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
    def _execute(self, job: Job, *, inline: bool = False) -> None:
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
        except Cancelled:
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

    def _finish(self, job: Job, done: TransferDone) -> None:
        done.run_s = time.monotonic() - job.started_at
        with self._lock:
            job.done = True
            # Decided under the lock: once cancel() has answered IN_PROGRESS, the result
            # is CANCELLED even if the bytes all arrived.
            if job.cancel_requested and done.status is TransferStatus.OK:
                done.status = TransferStatus.CANCELLED
        self._deliver(job, done)

    # ---- link emulation (module doc) --------------------------------------------------
    def _wait_on_link(self, job: Job, done: TransferDone) -> bool:
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

    def _link_done(self, job: Job, waited_s: float, closed: bool) -> None:
        with self._lock:
            done, job.result = job.result, None
            if closed:
                job.cancel_requested = True
        assert done is not None, "a job on an emulated link holds its result"
        done.link_wait_s = waited_s
        self._finish(job, done)

    def _check_cancel(self, job: Job) -> None:
        """Called between runs: honours cancellation, and paces background transfers."""
        if job.cancel_requested:
            raise Cancelled
        self._pace(job)

    def _pace(self, job: Job, *, wait: bool = True) -> None:
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
                raise Cancelled
            ahead_s = self._paced_until - time.monotonic()

