"""A budget per second with a burst: the anti-thrash budget of one (worker, lower tier) link,
and a caller's allowance of calls and request bytes (``kvtier.controller.caller_limits``)."""

from __future__ import annotations

from collections.abc import Callable


class TokenBucket:
    """Bytes per second with a burst; ``try_take`` for optional moves (with hysteresis),
    ``take`` for moves that must happen (may go into debt)."""

    def __init__(self, rate: float, burst: float, resume_fraction: float, clock_s: Callable[[], float]) -> None:
        self.rate, self.burst, self.resume_fraction = rate, burst, resume_fraction
        self._clock_s = clock_s
        self.level = burst
        self.is_throttled = False
        self._at = clock_s()

    def _refill(self) -> None:
        now = self._clock_s()
        self.level = min(self.burst, self.level + (now - self._at) * self.rate)
        self._at = now

    def try_take(self, num_bytes: float) -> bool:
        self._refill()
        if self.is_throttled and self.level < self.resume_fraction * self.burst:
            return False
        if self.level >= num_bytes:
            self.is_throttled = False
            self.level -= num_bytes
            return True
        self.is_throttled = True
        return False

    def wait_s(self, amount: float) -> float:
        """Seconds until ``amount`` can be taken without debt (0: now)."""
        self._refill()
        if self.level >= amount:
            return 0.0
        return (amount - self.level) / self.rate if self.rate > 0 else float("inf")

    def take(self, num_bytes: float) -> None:
        self._refill()
        self.level -= num_bytes
        if self.level < 0:
            self.is_throttled = True
