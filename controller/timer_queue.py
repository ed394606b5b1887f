"""Callbacks due at wall-clock times, one per key: the orchestrator's prefetch and top-up timers."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable, Coroutine, Hashable
from typing import Any


def wall_clock_ms() -> float:
    return time.time() * 1000.0


class TimerQueue:
    """Callbacks due at wall-clock times (ms), one per key; a new schedule replaces the
    key's old one. ``run`` fires due callbacks every ``tick_s``; tests call ``fire_due``
    with a clock of their own."""

    def __init__(self, clock_ms: Callable[[], float] = wall_clock_ms) -> None:
        self.clock_ms = clock_ms
        self._heap: list[tuple[float, int, Hashable]] = []
        self._entries: dict[Hashable, tuple[int, Callable[[], Coroutine[Any, Any, None]]]] = {}
        self._seq = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def schedule(self, key: Hashable, at_ms: float, callback: Callable[[], Coroutine[Any, Any, None]]) -> None:
        seq = next(self._seq)
        self._entries[key] = (seq, callback)
        heapq.heappush(self._heap, (at_ms, seq, key))

    def cancel(self, key: Hashable) -> bool:
        return self._entries.pop(key, None) is not None

    def is_scheduled(self, key: Hashable) -> bool:
        return key in self._entries

    def pop_due(self, now_ms: float) -> list[Callable[[], Coroutine[Any, Any, None]]]:
        due = []
        while self._heap and self._heap[0][0] <= now_ms:
            _, seq, key = heapq.heappop(self._heap)
            entry = self._entries.get(key)
            if entry is not None and entry[0] == seq:  # not cancelled or replaced since
                del self._entries[key]
                due.append(entry[1])
        return due

    async def fire_due(self) -> int:
        callbacks = self.pop_due(self.clock_ms())
        for callback in callbacks:
            await callback()
        return len(callbacks)

    async def run(self, tick_s: float) -> None:
        while True:
            for callback in self.pop_due(self.clock_ms()):
                task = asyncio.create_task(callback())
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(tick_s)
