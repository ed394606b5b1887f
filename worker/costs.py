"""What the worker measures about its own speed, for Route's cost model (``WorkerCosts``).

    prefill_ms_per_token     finished requests: prefill start → first token, per computed token
    ms_per_queued_request    requests that waited in the engine: added → prefill start, per request
                             ahead of it (queued or running: a continuous batch admits at once,
                             and the running sequences' steps are what a new request waits for);
                             a wait outside the engine (a peer fetch, room, promotion) is not in it
    {dram,nvme}_promote_bps  promotions into HBM: bytes / copy time (the transfer engine's records)
    fetch_bytes_per_s, fetch_setup_ms   peer fetches (``PeerRates``: a line through recent fetches)

Each rate is an exponential moving average of its samples; 0 until the first sample. The
engine thread and the transfer threads write, the WorkerLink reads a snapshot for each
heartbeat: single float stores, no lock needed.
"""

from __future__ import annotations

from collections import deque

from kvtier.domain.records import WorkerCosts
from kvtier.domain.tiers import Tier
from kvtier.tiers.transfer import TransferDone

SMOOTHING = 0.2  # weight of the newest sample


def _average(old: float, sample: float) -> float:
    return sample if old <= 0 else SMOOTHING * sample + (1 - SMOOTHING) * old


class PeerRates:
    """Peer fetch costs: a least-squares line ``elapsed = setup + bytes / bytes_per_s`` through
    the last ``MAX_SAMPLES`` fetches (with one size only, the set-up is taken as 0)."""

    MAX_SAMPLES = 32

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=self.MAX_SAMPLES)  # (bytes, seconds)
        self.bytes_per_s = 0.0  # 0: not measured yet
        self.setup_ms = 0.0

    def record(self, num_bytes: int, elapsed_s: float) -> None:
        if num_bytes <= 0 or elapsed_s <= 0:
            return
        self._samples.append((float(num_bytes), elapsed_s))
        n = len(self._samples)
        mean_b = sum(b for b, _ in self._samples) / n
        mean_t = sum(t for _, t in self._samples) / n
        var_b = sum((b - mean_b) ** 2 for b, _ in self._samples)
        slope = sum((b - mean_b) * (t - mean_t) for b, t in self._samples) / var_b if var_b else 0.0
        if slope > 0 and mean_t - slope * mean_b >= 0:
            self.bytes_per_s, self.setup_ms = 1.0 / slope, (mean_t - slope * mean_b) * 1000.0
        else:
            self.bytes_per_s, self.setup_ms = mean_b / mean_t, 0.0


class CostMeter:
    def __init__(self) -> None:
        self.prefill_ms_per_token = 0.0
        self.ms_per_queued_request = 0.0
        self.promote_bytes_per_s = {Tier.DRAM: 0.0, Tier.NVME: 0.0}
        self.fetch = PeerRates()

    def finished(self, *, submitted_at: float, prefill_started_at: float | None, first_token_at: float | None,
                 num_computed_tokens: int, num_queued_ahead: int) -> None:
        """One request reached its first token (times from ``time.perf_counter``; ``submitted_at``:
        when it was handed to the engine)."""
        if prefill_started_at is None:
            return
        if first_token_at is not None and num_computed_tokens > 0 and first_token_at > prefill_started_at:
            sample = (first_token_at - prefill_started_at) * 1000.0 / num_computed_tokens
            self.prefill_ms_per_token = _average(self.prefill_ms_per_token, sample)
        if num_queued_ahead > 0 and prefill_started_at > submitted_at:
            sample = (prefill_started_at - submitted_at) * 1000.0 / num_queued_ahead
            self.ms_per_queued_request = _average(self.ms_per_queued_request, sample)

    def transfer_done(self, done: TransferDone) -> None:
        """A transfer finished (a transfer thread): promotions into HBM give the promote rates."""
        transfer = done.transfer
        if transfer.dst_tier is not Tier.HBM or transfer.src_tier not in self.promote_bytes_per_s:
            return
        if done.is_ok and done.num_bytes > 0 and done.run_s > 0:
            rate = done.num_bytes / done.run_s
            self.promote_bytes_per_s[transfer.src_tier] = _average(self.promote_bytes_per_s[transfer.src_tier], rate)

    def snapshot(self) -> WorkerCosts:
        return WorkerCosts(
            prefill_ms_per_token=self.prefill_ms_per_token,
            fetch_bytes_per_s=self.fetch.bytes_per_s,
            fetch_setup_ms=self.fetch.setup_ms,
            dram_promote_bytes_per_s=self.promote_bytes_per_s[Tier.DRAM],
            nvme_promote_bytes_per_s=self.promote_bytes_per_s[Tier.NVME],
            ms_per_queued_request=self.ms_per_queued_request,
        )
