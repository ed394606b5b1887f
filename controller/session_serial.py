"""Work on one session, one piece at a time: a lock per session in use, and the Route
bookkeeping each session has running in the background.

Route, Pause, Returning, End and timer work on a session hold its lock (``locked``). A Route
does not wait for the session's bookkeeping (``run_after_route`` starts it as a task); the
session's next Pause, Returning, End or prefetch waits for it first (``after_route``), so each
still sees the turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from kvtier.controller.session_tenancy import SessionKey
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.orchestrator")  # the orchestrator's sessions log as it does


@dataclass(slots=True)
class _SessionLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # holding or waiting


class SessionSerial:
    """Per-session locks and background Route bookkeeping, by (tenant, id) (module doc). One
    event loop."""

    def __init__(self) -> None:
        # One lock per session in use: gone once no one holds or waits for it.
        self._locks: dict[SessionKey, _SessionLock] = {}
        # Route bookkeeping running in the background, the latest per session.
        self._route_tasks: dict[SessionKey, asyncio.Task[None]] = {}

    @property
    def num_locks(self) -> int:
        return len(self._locks)

    @property
    def num_route_tasks(self) -> int:
        return len(self._route_tasks)

    @contextlib.asynccontextmanager
    async def locked(self, session: SessionKey) -> AsyncIterator[None]:
        """Hold ``session``'s lock. The lock exists while someone holds or waits for it, so
        sessions that are never ended leave no lock behind."""
        entry = self._locks.get(session)
        if entry is None:
            entry = self._locks[session] = _SessionLock()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if not entry.users:
                del self._locks[session]

    def run_after_route(self, session: SessionKey, bookkeeping: Awaitable[object]) -> None:
        """Run a Route's ``bookkeeping`` for ``session`` in the background; a failure is logged."""
        task = asyncio.create_task(self._logged(session, bookkeeping), name="kvtier-session-route")
        self._route_tasks[session] = task
        task.add_done_callback(functools.partial(self._route_task_done, session))

    def _route_task_done(self, session: SessionKey, task: asyncio.Task[None]) -> None:
        if self._route_tasks.get(session) is task:
            del self._route_tasks[session]

    @staticmethod
    async def _logged(session: SessionKey, bookkeeping: Awaitable[object]) -> None:
        try:
            await bookkeeping
        except Exception as exc:  # session bookkeeping must never fail a Route
            log.warning("session bookkeeping on Route failed", extra={
                "session_id": session.session_id, "reason": str(exc)})

    async def after_route(self, session: SessionKey) -> None:
        """Wait for the session's Route bookkeeping, if some is still running."""
        task = self._route_tasks.get(session)
        if task is not None:
            await asyncio.wait({task})

    async def settled(self) -> None:
        """Wait for all the Route bookkeeping still running in the background."""
        while self._route_tasks:
            await asyncio.wait(set(self._route_tasks.values()))
