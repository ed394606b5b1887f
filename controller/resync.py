"""This controller's standing with Redis: reachability, leadership, and the Directory object.

Three roles::

    LEADER    holds the leader lease (set-up done: fences raised); writes the directory
    ORPHANED  held the lease, then lost Redis; keeps serving Route from its own registry
              (degraded) and keeps its worker links, writes nothing; becomes LEADER again
              when it wins the lease back, STANDBY when it sees another leader
    STANDBY   another controller leads (or none was ever won here); Router, Admin.Lookup
              and WorkerLink answer UNAVAILABLE naming the leader

Redis down → up (``run`` keeps a monitor that reads the server's ``run_id`` every
``REACHABLE_POLL_S``, every ``UNREACHABLE_POLL_S`` while it is down; on Redis Cluster the
``run_id`` of every primary, ``controller/redis_connect.py``, and "down" is any primary
unreachable):

- down: health ``kvtier.directory`` NOT_SERVING; Route ranks by affinity and load with
  ``degraded`` set; links keep heartbeats in the registry and drop page events, flagging
  themselves for a resync;
- up, same ``run_id`` (the data survived): health SERVING; flagged links resync;
- up, new ``run_id`` (a restart, or on a cluster a replica promoted in a failed primary's
  place: the data, or its latest writes, may be gone): the term ends (a restarted Redis
  may have reset the fencing counter, so the old token proves nothing; the next token and
  worker ids are drawn above the highest this controller saw), a fresh ``Directory``
  replaces the old one (its local caches describe the old data; it routes only to
  incarnations it registers itself, so entries that survived in Redis are not served
  before the worker's snapshot replaces them), and every link resyncs once the lease is
  won again. A controller about to campaign probes first, so a new term never starts on a
  Directory object of a Redis that has since restarted.

A resync (``WorkerLinks``) registers a new incarnation of the worker and asks it for a
full inventory snapshot, which rebuilds its entries: the directory converges to the
workers' inventories within about a lease period plus one snapshot after Redis returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from kvtier.controller.directory import Directory
from kvtier.controller.directory_records import Outcome
from kvtier.controller.leader import LeaderLease, Leadership
from kvtier.controller.redis_connect import REDIS_ERRORS, RedisClient, server_identity
from kvtier.domain.errors import Unavailable
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.controller.resync")

DIRECTORY_SERVICE = "kvtier.directory"
LEADER_SERVICE = "kvtier.leader"
REACHABLE_POLL_S = 0.5
UNREACHABLE_POLL_S = 0.1
PING_TIMEOUT_S = 1.0

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Role(enum.Enum):
    LEADER = "leader"
    ORPHANED = "orphaned"
    STANDBY = "standby"


def leader_address(owner: str) -> str:
    """Lease owners are ``<controller id>@<host:port>``."""
    return owner.rpartition("@")[2]


def describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


class DirectoryAccess:
    """Leadership, reachability and the current ``Directory``; one per controller process.

    ``on_resync(everything)`` runs (synchronously) when links must rebuild their entries:
    ``everything=True`` after an election or a Redis restart, ``False`` after an outage with
    the data intact (only links that dropped something). ``on_standby(leader)`` runs when
    another controller leads: links must close so workers find the leader.
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        controller_id: str,
        address: str,
        lease_ttl_ms: int,
        health: health_aio.HealthServicer,
        lookup_client: RedisClient | None = None,
    ) -> None:
        self.controller_id = controller_id
        self.address = address
        self.owner = f"{controller_id}@{address}"
        self.lease_ttl_ms = lease_ttl_ms
        self.lease = LeaderLease(client, self.owner, ttl_ms=lease_ttl_ms)
        self._client = client
        self._lookup_client = lookup_client
        self._health = health
        self._directory = Directory(client, lookup_client=lookup_client, lease_ttl_ms=lease_ttl_ms,
                                    fence_token=None)
        self._term: Leadership | None = None  # the term we act on (set-up may still be running)
        self._setup_done = False
        self._orphaned = False
        self._is_reachable = True
        self.last_error = ""
        self.leader_owner: str | None = None
        self._redis_run_id: str | None = None
        self._wake = asyncio.Event()
        self._closing = False
        self._tasks: list[asyncio.Task[None]] = []
        self._health_tasks: set[asyncio.Task[None]] = set()
        self.on_resync: Callable[[bool], None] = lambda everything: None
        self.on_standby: Callable[[str | None], None] = lambda leader: None

    # -- state ----------------------------------------------------------------------------

    @property
    def directory(self) -> Directory:
        """The current Directory (replaced after a Redis restart: fetch it for every operation)."""
        return self._directory

    @property
    def role(self) -> Role:
        if self._term is not None:
            return Role.LEADER if self._setup_done and self.lease.is_leader else Role.ORPHANED
        return Role.ORPHANED if self._orphaned else Role.STANDBY

    @property
    def is_leader(self) -> bool:
        return self.role is Role.LEADER

    @property
    def is_reachable(self) -> bool:
        return self._is_reachable

    @property
    def can_write(self) -> bool:
        return self._is_reachable and self.role is Role.LEADER

    @property
    def leader_address(self) -> str | None:
        if self.role is Role.LEADER:
            return self.address
        return leader_address(self.leader_owner) if self.leader_owner else None

    def check_serving(self) -> None:
        """Raise ``Unavailable`` on a standby (clients retry; the message names the leader)."""
        if self.role is not Role.STANDBY:
            return
        leader = self.leader_address
        if leader and leader != self.address:
            raise Unavailable(f"controller {self.controller_id} is a standby; the leader is {leader}")
        raise Unavailable(f"controller {self.controller_id} is a standby and no leader is elected yet; retry")

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Check Redis and campaign once (so ``role`` means something), then keep at it."""
        self._set_health(DIRECTORY_SERVICE, True)
        self._set_health(LEADER_SERVICE, False)
        await self.campaign_once()
        self._tasks = [
            asyncio.create_task(self._lease_loop(), name="kvtier-controller-lease"),
            asyncio.create_task(self._monitor_loop(), name="kvtier-controller-redis-monitor"),
        ]

    async def close(self) -> None:
        """Stop campaigning and give the lease up so a standby takes over at once."""
        self._closing = True
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._directory.fence_token = None
        self._term, self._setup_done = None, False
        with contextlib.suppress(*REDIS_ERRORS):
            await self.lease.release()
        await asyncio.gather(*self._health_tasks, return_exceptions=True)

    # -- leadership -----------------------------------------------------------------------

    async def campaign_once(self) -> None:
        try:
            if self._term is not None and self.lease.term is None:
                self._depose("the lease expired before it was renewed")
            if self.lease.term is None:
                # Before writing as a new leader, make sure the Directory object describes this
                # Redis: one that restarted since the last probe gets a fresh one first.
                await self._probe()
                if not self._is_reachable:
                    return
                if await self.lease.try_acquire() is None:
                    self._observe(await self.lease.current())
            elif not await self.lease.renew():
                self._depose("the lease was lost")
                self._observe(await self.lease.current())
            if self.lease.term is not None and not self._setup_done:
                await self._setup(self.lease.term)
        except REDIS_ERRORS as exc:
            self.report_failure(exc)
            if self._term is not None and self.lease.term is None:
                self._depose("Redis was unreachable for a whole lease period")

    async def _lease_loop(self) -> None:
        period_s = self.lease_ttl_ms / 3000.0
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), period_s)
            self._wake.clear()
            if self._closing:
                return
            try:
                await self.campaign_once()
            except Exception as exc:  # a bug: keep campaigning rather than lose the loop silently
                log.error("leader campaign failed", exc_info=exc)

    async def _setup(self, term: Leadership) -> None:
        self._term = term
        directory = self._directory
        directory.fence_token = term.token
        await directory.refresh_workers(revive=True)
        if await directory.raise_fences() is Outcome.FENCED:
            await self.fenced()
            return
        self._setup_done, self._orphaned = True, False
        self.leader_owner = self.owner
        self._set_health(LEADER_SERVICE, True)
        log.info("leader lease won", extra={"controller_id": self.controller_id, "fencing_token": term.token})
        self.on_resync(True)

    def _depose(self, reason: str) -> None:
        if self._term is None:
            return
        token, self._term, self._setup_done = self._term.token, None, False
        self._directory.fence_token = None
        self._orphaned = True  # until another leader shows up or we win again
        self._set_health(LEADER_SERVICE, False)
        log.warning("leader term ended", extra={"fencing_token": token, "reason": reason})

    def _observe(self, leadership: Leadership | None) -> None:
        self.leader_owner = leadership.owner if leadership else None
        if leadership is not None and leadership.owner != self.owner and self._orphaned:
            self._orphaned = False
            log.warning("another controller leads; standing by", extra={"leader": leadership.owner})
            self.on_standby(leader_address(leadership.owner))

    async def fenced(self) -> None:
        """A directory write was refused: a newer leader exists. Stop writing, stand by."""
        if self._term is None and not self._orphaned:
            return
        self._depose("a directory write was fenced by a newer leader")
        self._orphaned = False
        with contextlib.suppress(*REDIS_ERRORS):
            await self.lease.release()  # only deletes the key if it is still ours
        self.on_standby(None)
        self._wake.set()

    # -- reachability ---------------------------------------------------------------------

    def report_failure(self, exc: BaseException) -> None:
        """A Redis call failed for want of Redis. Idempotent; the monitor notices the return."""
        self.last_error = describe(exc)
        if not self._is_reachable:
            return
        self._is_reachable = False
        self._set_health(DIRECTORY_SERVICE, False)
        log.warning(
            "directory (Redis) unreachable (%s); routing degraded and page events dropped until it returns",
            self.last_error, extra={"error": self.last_error},
        )

    async def _probe(self) -> None:
        try:
            run_id = await asyncio.wait_for(server_identity(self._client), PING_TIMEOUT_S)
        except REDIS_ERRORS as exc:
            self.report_failure(exc)
            return
        restarted = self._redis_run_id is not None and run_id != self._redis_run_id
        self._redis_run_id = run_id
        if self._is_reachable and not restarted:
            return
        if restarted:
            log.warning("Redis restarted or failed over; rebuilding the directory from worker inventories")
            self._depose("Redis restarted or failed over")
            # Replaced before anything awaits, and before Route may read again: the old object's
            # mirror still lists what workers dropped while Redis was away. The fresh Directory
            # trusts only the incarnations it registers (a promoted replica may list pages a
            # worker dropped during the outage: they stay unrouted until the worker's snapshot
            # replaces them) and gives out ids above every one seen so far.
            old = self._directory
            self._directory = Directory(self._client, lookup_client=self._lookup_client,
                                        lease_ttl_ms=self.lease_ttl_ms, fence_token=None,
                                        adopt_existing=False, min_worker_id=old.max_worker_id)
            self._directory.on_op = old.on_op
            with contextlib.suppress(*REDIS_ERRORS):
                await self.lease.release()
        self._is_reachable = True
        self.last_error = ""
        self._set_health(DIRECTORY_SERVICE, True)
        log.info("directory (Redis) reachable again")
        self.on_resync(restarted)
        self._wake.set()

    async def _monitor_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(REACHABLE_POLL_S if self._is_reachable else UNREACHABLE_POLL_S)
            try:
                await self._probe()
            except Exception as exc:  # a bug: keep watching Redis
                log.error("Redis monitor failed", exc_info=exc)

    def _set_health(self, service: str, serving: bool) -> None:
        task = asyncio.get_running_loop().create_task(
            self._health.set(service, _SERVING if serving else _NOT_SERVING)
        )
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)
