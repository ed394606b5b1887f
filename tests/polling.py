"""Bounded polling for tests against live processes: wait until a condition holds, failing
with what was awaited once the time is up (never a timing assertion, only a ceiling)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


async def wait_for(predicate: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll a plain ``predicate`` until it is truthy."""
    await eventually(predicate, timeout_s, what, interval_s=0.01)


async def eventually(
    check: Callable[[], Any | Awaitable[Any]],
    timeout_s: float = 10.0,
    what: str = "condition",
    *,
    interval_s: float = 0.02,
) -> Any:
    """Poll ``check`` (plain or async) until it returns something truthy; returns that."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(interval_s)
