"""Emulated GPU links for benchmarks on machines without a GPU (decision 0011).

Here "HBM" is host memory, so HBM <-> DRAM is a memcpy as fast as attention reads and
NVMe -> HBM costs what the disk costs; on a GPU both cross PCIe (~25 GB/s) or the NVMe
(~7 GB/s), 100-400x slower than the 3 TB/s that attention reads. ``EmulatedLinks`` holds a
transfer's acknowledgement until its bytes would have crossed such a link: one link per tier
pair (direction) that touches HBM, its rate split evenly among the transfers on it (processor
sharing, as concurrent DMA streams share PCIe). Off by default; the transfer engine
(``kvtier.tiers.transfer``) uses it when ``link_bytes_per_s`` is set. Like a tool that sleeps, it
stands in for hardware outside the system; nothing in serving depends on it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.tiers import Tier

TierPair = tuple[Tier, Tier]
# The pairs a link emulation may slow down: those that cross a GPU's PCIe or read its NVMe.
EMULATED_PAIRS: frozenset[TierPair] = frozenset(
    {(Tier.HBM, Tier.DRAM), (Tier.DRAM, Tier.HBM), (Tier.HBM, Tier.NVME), (Tier.NVME, Tier.HBM)}
)


def check_link_rates(rates: Mapping[TierPair, float] | None) -> dict[TierPair, float]:
    """Validated emulated link rates (bytes/s per pair that touches HBM); {} for none."""
    checked: dict[TierPair, float] = {}
    for pair, rate in (rates or {}).items():
        if pair not in EMULATED_PAIRS:
            src, dst = (getattr(t, "label", t) for t in pair)
            raise InvalidArgument(
                f"link emulation covers transfers to or from HBM only, not {src} -> {dst}", field="link_bytes_per_s"
            )
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0:
            raise InvalidArgument(
                f"emulated {pair[0].label} -> {pair[1].label} link rate must be a positive number of bytes/s, "
                f"got {rate!r}",
                field="link_bytes_per_s",
            )
        checked[pair] = float(rate)
    return checked


@dataclass(slots=True, eq=False)
class Flow:
    """Bytes of a transfer still to cross an emulated link."""

    remaining_bytes: float
    entered_at: float
    job: Any  # the transfer engine's job: has ``cancel_requested``


class EmulatedLinks:
    """Emulated links (module doc), one per tier pair: each pair's rate is split evenly among
    the flows on it. One thread, started on the first flow, reports each flow when its bytes
    are across, its job is cancelled, or the links close: ``on_done(job, waited_s, closed)``
    (outside the lock)."""

    def __init__(self, rates: dict[TierPair, float], on_done: Callable[[Any, float, bool], None]) -> None:
        self.rates = rates
        self._on_done = on_done
        self._cv = threading.Condition()
        self._flows: dict[TierPair, list[Flow]] = {pair: [] for pair in rates}
        self._updated_at: dict[TierPair, float] = dict.fromkeys(rates, 0.0)
        self._thread: threading.Thread | None = None
        self._closed = False

    def _advance(self, now: float) -> None:
        """Every flow has moved its share of its link since the last update (under the lock;
        the thread wakes at each finish, so the share is constant in between)."""
        for pair, flows in self._flows.items():
            if flows:
                moved = self.rates[pair] / len(flows) * (now - self._updated_at[pair])
                for flow in flows:
                    flow.remaining_bytes -= moved
            self._updated_at[pair] = now

    def add(self, pair: TierPair, num_bytes: int, started_at: float, *, job: Any) -> bool:
        """Put a flow on ``pair``'s link; False after ``close``. The time since ``started_at``
        (its real copy) counts at the share the flow gets now."""
        with self._cv:
            if self._closed:
                return False
            now = time.monotonic()
            self._advance(now)
            flows = self._flows[pair]
            credit = max(0.0, now - started_at) * self.rates[pair] / (len(flows) + 1)
            flows.append(Flow(num_bytes - credit, now, job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvtier-link", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return True

    def wake(self) -> None:
        """A job may have been cancelled: report it now."""
        with self._cv:
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    now = time.monotonic()
                    self._advance(now)
                    finished: list[Flow] = []
                    next_s: float | None = None
                    for pair, flows in self._flows.items():
                        keep: list[Flow] = []
                        for flow in flows:
                            cancelled = flow.job.cancel_requested
                            (finished if flow.remaining_bytes <= 0 or cancelled or self._closed else keep).append(flow)
                        flows[:] = keep
                        if keep:
                            due_s = min(f.remaining_bytes for f in keep) * len(keep) / self.rates[pair]
                            next_s = due_s if next_s is None else min(next_s, due_s)
                    if finished:
                        break
                    if self._closed:
                        return
                    self._cv.wait(next_s)
                closed = self._closed
            for flow in finished:
                self._on_done(flow.job, now - flow.entered_at, closed)
