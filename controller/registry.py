"""The controller's in-memory view of its workers and of session affinity.

One entry per worker id: what it registered (address, boot id, model, capacities), which
WorkerLink stream it is on, and its load as of the last heartbeat. The directory in Redis
says which pages a worker holds; this registry says whether a worker can take a request
right now, so routing keeps working while Redis is unreachable.

Liveness here is local: a worker is *live* while its stream is open and its last
registration or heartbeat is younger than the lease TTL. A closed stream removes the worker
from routing at once (its process or its link is gone; a healthy worker reconnects within
its backoff); its directory lease simply expires and the sweeper reclaims its entries.

Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.domain.hashing import NamespaceIdentity
from kvtier.domain.records import (
    Heartbeat,
    Registration,
    SessionId,
    TierOccupancy,
    WorkerCosts,
    WorkerId,
    WorkerInfo,
    WorkerState,
)
from kvtier.domain.tiers import Tier

MAX_SESSIONS = 100_000
"""Sessions remembered for affinity; the least recently routed are forgotten first."""
FORGET_AFTER_TTLS = 20
"""A disconnected worker's entry is dropped after this many lease TTLs (at least a minute)."""


@dataclass(slots=True)
class WorkerEntry:
    registration: Registration
    link_id: int | None  # the open stream; None once it closed
    last_seen_s: float  # monotonic time of the registration or the last heartbeat
    disconnected_at_s: float | None = None
    last_heartbeat_at_ms: int = 0  # wall clock, for operators
    tiers: tuple[TierOccupancy, ...] = ()
    queue_depth: int = 0
    num_running_seqs: int = 0
    # Routes that picked it first since its last heartbeat: requests on their way that its
    # queue does not show yet, and the prompt tokens they will prefill there (Route by
    # estimated TTFT counts that work as queued ahead).
    num_routed: int = 0
    routed_tokens: int = 0
    is_draining: bool = False
    costs: WorkerCosts | None = None  # measured by the worker, as of its last heartbeat that had them

    @property
    def worker_id(self) -> WorkerId:
        return self.registration.worker_id

    @property
    def address(self) -> str:
        return self.registration.address

    @property
    def is_connected(self) -> bool:
        return self.link_id is not None

    def occupancy(self, tier: Tier) -> TierOccupancy | None:
        return next((t for t in self.tiers if t.tier == tier), None)

    def serves(self, namespace: NamespaceIdentity) -> bool:
        """Whether the worker can run requests of ``namespace`` (the same rule as the worker's
        own ``check_serves``: tenant and tokenizer are free, everything that changes KV is not)."""
        model = self.registration.model
        return (
            namespace.model_id == model.model_id
            and namespace.weights_digest == model.weights_digest
            and namespace.rope_config == model.rope_config
            and namespace.kv_dtype == model.kv_dtype
            and namespace.page_size == self.registration.page_size
            and (not namespace.adapter or namespace.adapter in self.registration.adapters)
        )


class Registry:
    """Workers by id and session affinity by (tenant, session id). ``clock_s`` is monotonic seconds (tests pass their own)."""

    def __init__(self, lease_ttl_s: float, *, clock_s: Callable[[], float] = time.monotonic) -> None:
        self.lease_ttl_s = lease_ttl_s
        self._clock_s = clock_s
        self._workers: dict[WorkerId, WorkerEntry] = {}
        # By (tenant, session id): another tenant naming the same id has no affinity to learn.
        self._affinity: collections.OrderedDict[tuple[str, SessionId], WorkerId] = collections.OrderedDict()

    # -- workers --------------------------------------------------------------------------

    def connect(self, registration: Registration, link_id: int) -> WorkerEntry:
        """A stream registered ``registration``; it replaces whatever the worker had before.

        A drain outlives a reconnect of the same process (the worker still refuses requests);
        a restarted process (new boot id) starts admitting."""
        self._forget_departed()
        previous = self._workers.get(registration.worker_id)
        entry = WorkerEntry(registration, link_id, self._clock_s())
        entry.is_draining = (previous is not None and previous.is_draining
                             and previous.registration.boot_id == registration.boot_id)
        self._workers[registration.worker_id] = entry
        return entry

    def heartbeat(self, worker: WorkerId, link_id: int, heartbeat: Heartbeat) -> None:
        entry = self._workers.get(worker)
        if entry is None or entry.link_id != link_id:
            return  # a stream that was replaced by a newer one
        entry.last_seen_s = self._clock_s()
        entry.last_heartbeat_at_ms = int(time.time() * 1000)
        entry.tiers = heartbeat.tiers
        entry.queue_depth = heartbeat.queue_depth
        entry.num_running_seqs = heartbeat.num_running_seqs
        entry.num_routed = entry.routed_tokens = 0
        entry.costs = heartbeat.costs or entry.costs

    def routed(self, worker: WorkerId, num_tokens: int) -> None:
        """A Route picked ``worker`` first for a request that will prefill ``num_tokens`` there
        (``WorkerEntry.num_routed``)."""
        entry = self._workers.get(worker)
        if entry is not None:
            entry.num_routed += 1
            entry.routed_tokens += num_tokens

    def disconnect(self, worker: WorkerId, link_id: int) -> None:
        entry = self._workers.get(worker)
        if entry is not None and entry.link_id == link_id:
            entry.link_id = None
            entry.disconnected_at_s = self._clock_s()

    def get(self, worker: WorkerId) -> WorkerEntry | None:
        return self._workers.get(worker)

    def is_live(self, entry: WorkerEntry) -> bool:
        return entry.is_connected and self._clock_s() - entry.last_seen_s < self.lease_ttl_s

    def workers(self) -> list[WorkerEntry]:
        """Every known worker (connected or not, until forgotten), by id."""
        self._forget_departed()
        return [self._workers[w] for w in sorted(self._workers)]

    def live_workers(self) -> list[WorkerEntry]:
        return [e for e in self.workers() if self.is_live(e)]

    def candidates(self, namespace: NamespaceIdentity) -> list[WorkerEntry]:
        """Live, admitting workers that serve ``namespace``, by id."""
        return [e for e in self.live_workers() if not e.is_draining and e.serves(namespace)]

    def state_of(self, entry: WorkerEntry) -> WorkerState:
        if not self.is_live(entry):
            return WorkerState.EXPIRED
        return WorkerState.DRAINING if entry.is_draining else WorkerState.LIVE

    def worker_info(self, entry: WorkerEntry) -> WorkerInfo:
        reg = entry.registration
        return WorkerInfo(
            worker_id=reg.worker_id,
            address=reg.address,
            boot_id=reg.boot_id,
            state=self.state_of(entry),
            model=reg.model,
            page_size=reg.page_size,
            capacities=reg.capacities,
            tiers=entry.tiers,
            adapters=reg.adapters,
            queue_depth=entry.queue_depth,
            num_running_seqs=entry.num_running_seqs,
            last_heartbeat_at_ms=entry.last_heartbeat_at_ms,
        )

    def _forget_departed(self) -> None:
        horizon_s = max(60.0, FORGET_AFTER_TTLS * self.lease_ttl_s)
        now_s = self._clock_s()
        gone = [w for w, e in self._workers.items()
                if e.disconnected_at_s is not None and now_s - e.disconnected_at_s > horizon_s]
        for worker in gone:
            del self._workers[worker]

    # -- session affinity -----------------------------------------------------------------

    def affinity(self, session: tuple[str, SessionId]) -> WorkerId | None:
        """The worker of the session keyed (tenant, id), if any."""
        return self._affinity.get(session)

    def set_affinity(self, session: tuple[str, SessionId], worker: WorkerId) -> None:
        self._affinity[session] = worker
        self._affinity.move_to_end(session)
        while len(self._affinity) > MAX_SESSIONS:
            self._affinity.popitem(last=False)

    def forget_session(self, session: tuple[str, SessionId]) -> None:
        self._affinity.pop(session, None)

    @property
    def num_sessions(self) -> int:
        return len(self._affinity)
