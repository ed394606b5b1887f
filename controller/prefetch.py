"""Prefetch bookkeeping for the orchestrator: what each pause's prefetch achieved, the tier
moves it commanded per reason, and the promote time learnt from acknowledgements.

Each pause whose pages were parked below HBM gets one outcome when it closes (the next Route
of the session, or End):

    on time   the Prefetch was acknowledged before the session's next Route
    late      the Route came first (the prefetch was still scheduled or in flight), or the
              prefetch was acknowledged with none of the pages back (each in another move, or
              no room): the worker promotes the rest on hit, on the request path

Waste is counted apart from timeliness (a prefetch can be on time and still wasted):

    wasted    bytes prefetched into HBM that were not there when the session came back: it
              ended before its next turn (``ended``), or its next Route found some of those
              pages below HBM again or gone (``evicted``: the worker needed the room). Judged
              from the directory, which hears of a page that left HBM up to an event batch
              late: a lower bound. The worker counts it exactly when the session is back
              (``kvtier.session_prefetch_pages``, ``EngineLoop._settle_prefetched``)

    on_time_fraction = on_time / (on_time + late)
    wasted_fraction  = wasted bytes / prefetched bytes (acknowledged prefetches only)

``PromoteLatency`` answers "how long before the predicted return must a Prefetch leave?".
Bytes over bandwidth alone misses most of it on a busy worker: the command waits for the
engine step in progress (a long prefill), then the copy, then the ack's trip back. The
estimate is ``bytes / bandwidth + q(overheads)`` over the last ``window`` prefetches of that
worker, where an overhead is ``ack latency − bytes / bandwidth`` (``docs/decisions/0008``).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

from kvtier.domain.records import PredictionSource, SessionId, TokensByTier
from kvtier.domain.tiers import Tier


class Outcome:
    """How a parked session's prefetch ended (strings: they label metrics as-is)."""

    ON_TIME = "on_time"
    LATE = "late"
    KEPT = "kept"  # nothing was parked (kept in HBM, throttled, or the worker moved nothing)


class MoveReason:
    """Why the orchestrator commanded a tier move (metric label values)."""

    PARK = "park"  # Demote on Pause
    PREFETCH = "prefetch"  # Prefetch from the timer
    RETURNING = "returning"  # Prefetch pulled forward by Returning
    GUARD = "guard"  # Prefetch of a session kept in HBM: brings back what the worker demoted meanwhile
    END = "end"  # Drop of the session's private pages on End


@dataclass(frozen=True, slots=True)
class PauseOutcome:
    """One closed pause (a record for metrics and benchmarks; no token ids or text).

    ``lead_ms``: how long before the session came back its pages were in HBM again
    (negative: the prefetch was late by that much; None: no prefetch was acknowledged)."""

    session_id: SessionId
    tool: str
    tier: Tier  # where the pages waited (HBM: kept)
    num_pages: int
    num_bytes: int
    outcome: str
    wasted_bytes: int
    predicted_ms: float | None
    actual_ms: float | None
    source: PredictionSource | None
    lead_ms: float | None

    @property
    def abs_error_ms(self) -> float | None:
        if self.predicted_ms is None or self.actual_ms is None:
            return None
        return abs(self.actual_ms - self.predicted_ms)


@dataclass(slots=True)
class PrefetchStats:
    num_demoted: int = 0
    demoted_bytes: int = 0
    num_kept_in_hbm: int = 0
    num_throttled: int = 0
    num_prefetched: int = 0  # acknowledged prefetches
    prefetched_bytes: int = 0
    num_on_time: int = 0
    on_time_bytes: int = 0
    num_late: int = 0
    late_bytes: int = 0
    num_wasted: int = 0
    wasted_bytes: int = 0
    wasted_by_reason: dict[str, int] = field(default_factory=dict)  # bytes, "ended" / "evicted"
    wasted_count_by_reason: dict[str, int] = field(default_factory=dict)
    abs_error_ms_sum: float = 0.0
    num_errors: int = 0  # pauses whose prediction was scored
    # (reason, source tier label, destination tier label) -> [pages, bytes]
    moved: dict[tuple[str, str, str], list[int]] = field(default_factory=dict)
    # Commands a worker refused or did not answer, by "<command>:<error code>"
    refused: dict[str, int] = field(default_factory=dict)

    @property
    def on_time_fraction(self) -> float:
        scored = self.num_on_time + self.num_late
        return self.num_on_time / scored if scored else 0.0

    @property
    def wasted_fraction(self) -> float:
        return self.wasted_bytes / self.prefetched_bytes if self.prefetched_bytes else 0.0

    @property
    def mean_abs_error_ms(self) -> float:
        return self.abs_error_ms_sum / self.num_errors if self.num_errors else 0.0

    def count_move(self, reason: str, src: str, dst: str, num_pages: int, num_bytes: int) -> None:
        totals = self.moved.setdefault((reason, src, dst), [0, 0])
        totals[0] += num_pages
        totals[1] += num_bytes

    def count_waste(self, reason: str, num_bytes: int) -> None:
        if num_bytes <= 0:
            return
        self.num_wasted += 1
        self.wasted_bytes += num_bytes
        self.wasted_by_reason[reason] = self.wasted_by_reason.get(reason, 0) + num_bytes
        self.wasted_count_by_reason[reason] = self.wasted_count_by_reason.get(reason, 0) + 1

    def count_outcome(self, outcome: PauseOutcome) -> None:
        if outcome.outcome == Outcome.ON_TIME:
            self.num_on_time += 1
            self.on_time_bytes += outcome.num_bytes
        elif outcome.outcome == Outcome.LATE:
            self.num_late += 1
            self.late_bytes += outcome.num_bytes
        if outcome.abs_error_ms is not None:
            self.abs_error_ms_sum += outcome.abs_error_ms
            self.num_errors += 1


class PromoteLatency:
    """Milliseconds from sending a Prefetch to its ack on one worker (see the module doc)."""

    def __init__(self, initial_overhead_ms: float, *, quantile: float = 0.9, window: int = 64) -> None:
        if not 0 < quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        self.initial_overhead_ms = initial_overhead_ms
        self.quantile = quantile
        self._overheads: collections.deque[float] = collections.deque(maxlen=window)

    @property
    def num_samples(self) -> int:
        return len(self._overheads)

    def observe(self, latency_ms: float, num_bytes: int, bytes_per_s: float) -> None:
        self._overheads.append(max(0.0, latency_ms - num_bytes / bytes_per_s * 1000.0))

    def overhead_ms(self) -> float:
        """The ``quantile`` of recent overheads (nearest rank); the initial guess until one ack."""
        if not self._overheads:
            return self.initial_overhead_ms
        ordered = sorted(self._overheads)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(self.quantile * len(ordered)) - 1))]

    def estimate_ms(self, num_bytes: int, bytes_per_s: float) -> float:
        return num_bytes / bytes_per_s * 1000.0 + self.overhead_ms()


def evicted_since_prefetch(matched: TokensByTier, *, page_size: int, num_parked_pages: int, num_cached_tokens: int,
                           num_skipped: int, is_too_recent: bool) -> int:
    """Prefetched pages of a session the directory no longer has in HBM on its worker
    (``matched``: its next Route's prefix there): below HBM again (beyond the ``num_skipped``
    the prefetch left there), or gone (the prefix is shorter than the previous turn's). 0 while
    the directory cannot tell yet (``is_too_recent``: the prefetch landed within its lag)."""
    if is_too_recent:
        return 0
    below = max(0, (matched.dram_tokens + matched.nvme_tokens) // page_size - num_skipped)
    missing = max(0, num_cached_tokens // page_size - matched.total_tokens // page_size)
    return min(num_parked_pages, below + missing)
