"""What the engine thread does around each step, besides stepping: the worker's upkeep.

Before a step: retry deferred commands, add the requests whose room and pages are ready,
expire timed pins, and, while idle, enforce quotas and TTLs and apply finished transfers.
After it: retake lapsed session holds, reclaim stale namespaces' pages, and publish the load
heartbeats read. ``idle_wait_s`` tells the thread how long it may sleep with nothing to do.
Everything here runs on the engine thread (``worker.engine_loop``).
"""

from __future__ import annotations

import time

from kvtier.domain.hashing import NamespaceDigest
from kvtier.engine.engine import Engine
from kvtier.worker.admission import Admission
from kvtier.worker.commands import Commands
from kvtier.worker.holds import Holds
from kvtier.worker.load import EngineLoad, measure_load
from kvtier.worker.room import Room
from kvtier.worker.runs import Run, Runs

# Counting pinned pages is O(pool); publish the load for heartbeats at most this often while
# busy (and always when the engine goes idle).
LOAD_PUBLISH_INTERVAL_S = 0.05
# While stale namespaces still have pages and the engine is busy, look for idle ones this often.
RECLAIM_INTERVAL_S = 0.05


class Upkeep:
    def __init__(self, engine: Engine, holds: Holds, room: Room, admission: Admission[Run], commands: Commands,
                 runs: Runs) -> None:
        self._engine = engine
        self._holds = holds
        self._room = room
        self._admission = admission
        self._commands = commands
        self._runs = runs
        self._reclaimed_at = 0.0
        self.latest_load = self.measure_load()  # as of at most LOAD_PUBLISH_INTERVAL_S ago
        self._load_at = time.monotonic()

    def has_background_work(self) -> bool:
        """Transfers pending, requests waiting outside the engine, or commands deferred."""
        tiers = self._engine.tiers
        return (tiers is not None and tiers.has_pending()) or bool(self._admission) or self._commands.has_deferred

    def before_step(self) -> bool:
        """The upkeep due before a step; True when the engine is idle with background work
        only (the thread then waits briefly for news instead of spinning)."""
        if self._commands.has_deferred:
            self._commands.retry_deferred()
        if self._admission:
            self._runs.admit_ready()
        if self._holds.has_pins():
            self._holds.expire()
        if self._engine.has_unfinished():
            return False
        self._engine.enforce_limits()  # quotas and TTLs while idle (step() runs them when busy)
        if not self.has_background_work():
            return False
        # Idle, but transfers finished or are due: apply them without a request.
        if self._engine.tiers is not None:
            self._engine.tiers.maintain()
        return True

    def after_step(self) -> None:
        if self._holds.has_lapsed() and not (self._admission or self._commands.has_deferred
                                             or self._engine.num_queued):
            self._holds.retake()  # after the step and the transfers it applied: room may be back
        now = time.monotonic()
        is_busy = self._engine.has_unfinished()
        if self._commands.has_stale and (not is_busy or (
                self._commands.is_reclaim_due and now - self._reclaimed_at >= RECLAIM_INTERVAL_S)):
            self._commands.reclaim(self.busy_namespaces())
            self._reclaimed_at = now
        if now - self._load_at >= LOAD_PUBLISH_INTERVAL_S or not is_busy:
            self.latest_load, self._load_at = self.measure_load(), now

    def idle_wait_s(self) -> float | None:
        """Seconds until a timed pin lapses or quota / TTL work is due (None: nothing timed)."""
        waits = [w for w in (self._holds.wait_s(), self._engine.limits_wait_s()) if w is not None]
        return min(waits) if waits else None

    def busy_namespaces(self) -> set[NamespaceDigest]:
        """Namespaces with a request waiting outside the engine or in it."""
        return self._engine.busy_namespaces() | self._admission.digests()

    def measure_load(self) -> EngineLoad:
        self._holds.count_held_pages()
        return measure_load(self._engine, self._room.free_hbm())
