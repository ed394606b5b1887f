"""The global prefix directory in Redis: which worker holds which page, in which tiers.

Schema and the measurements behind it: ``docs/decisions/0001-directory-schema.md``.
Per namespace (hash tag = the digest in hex, so every script touches one Cluster slot)::

    kvt:{ns}:m           meta hash: epoch, reclaim_lo, reclaim_cursor, fence, rej:* counters
    kvt:{ns}:s           hash  worker id -> last applied batch seq
    kvt:{ns}:p:<E>       hash  page key (16 B) -> parent key (16 B) + 13 B per holder:
                               id u24 | tier mask u8 | held children by fastest tier 3 x u24
    kvt:{ns}:w:<E>:<id>  set   page keys with a record of one worker (drop_worker's index)
    kvt:{ns}:ws:<E>      set   worker ids with a non-empty index
    kvt:{ns}:c:<E>       hash  counters: per tier, entries, pages, w:<id>, orphans, inversions

Controller-wide, under the leader lease's ``{g}`` tag (``controller/leader.py``)::

    kvt:{g}:workers  name -> current id    kvt:{g}:wname  id -> name    kvt:{g}:next_wid
    kvt:{g}:lease:<id>  PX lease           kvt:{g}:retired  ids whose entries await purge
    kvt:{g}:wns:<id>  namespaces it wrote  kvt:{g}:namespaces     kvt:{g}:reclaim

Workers are interned to 24-bit ids; each registration is a new incarnation (new id). Leases
live in the ``{g}`` slot, which a namespace script may not read on Cluster, so liveness is
filtered here: this object keeps a deadline per id (``sent time + ttl`` of the last renewal
or lease read, never later than Redis expires the key) and lookups drop expired holders.

Lookups cost one round trip. While a namespace is "ordered" (no worker holds a page without
its parent, no child sits in a faster tier than its parent: two counters kept exact by every
write) the script bisects over depth, typically 2 reads for a whole chain; otherwise it reads
every page of the query. Both give the same answer.

Writes carry ``fence_token`` (the leader's fencing token; ``None`` = not leader, refused
without a round trip). Expected outcomes are ``Outcome`` values; broken contracts raise.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, NewType

import redis.asyncio as aredis
from redis.exceptions import NoScriptError

from kvtier.controller.directory_mirror import DirectoryMirror
from kvtier.controller.leader import GLOBAL_PREFIX
from kvtier.domain.errors import IntegrityError, InvalidArgument
from kvtier.domain.hashing import KEY_BYTES, NamespaceDigest, PageKey, root_key
from kvtier.domain.tiers import Tier

WorkerId = NewType("WorkerId", str)

MAX_BATCH_EVENTS = 4096
"""Events per ``apply_events`` call (the wire limit of ``PageEventBatch``)."""

_LUA_DIR = Path(__file__).with_name("lua")
_WORKERS_KEY = GLOBAL_PREFIX + "workers"
_EVENT = struct.Struct("<BBBBi16s16s")  # kind, tier, from_tier, flags, depth, key, parent
_FLAG_PARENT, _FLAG_BAD_KEY = 1, 2
_NO_KEY = bytes(KEY_BYTES)
_RECORD_BYTES = 13


def _monotonic_ms() -> float:
    return time.monotonic() * 1000.0


class EventKind(enum.IntEnum):
    INSERT = 1  # the page is now present in `tier`
    MOVE = 2  # the page is now in `tier` and no longer in `from_tier` (None: in no other tier)
    DROP = 3  # the page is no longer in `tier` (None: in no tier at all)


@dataclass(frozen=True, slots=True)
class PageEvent:
    """One change of a worker's inventory, as ``kvtier.v1.PageEvent`` describes it.

    ``depth`` is 1-based; a depth-1 page's parent is ``None`` or the namespace root key.
    """

    kind: EventKind
    namespace: NamespaceDigest
    key: PageKey
    tier: Tier | None = None
    parent: PageKey | None = None
    depth: int = 0
    from_tier: Tier | None = None

    @classmethod
    def insert(cls, namespace: NamespaceDigest, key: PageKey, parent: PageKey | None, depth: int,
               tier: Tier) -> PageEvent:
        return cls(EventKind.INSERT, namespace, key, tier, parent, depth)

    @classmethod
    def move(cls, namespace: NamespaceDigest, key: PageKey, tier: Tier,
             from_tier: Tier | None = None) -> PageEvent:
        return cls(EventKind.MOVE, namespace, key, tier, from_tier=from_tier)

    @classmethod
    def drop(cls, namespace: NamespaceDigest, key: PageKey, tier: Tier | None = None) -> PageEvent:
        return cls(EventKind.DROP, namespace, key, tier)


class Outcome(enum.Enum):
    OK = "ok"
    FENCED = "fenced"  # a newer leader exists: this controller must stop writing
    DUPLICATE = "duplicate"  # batch seq equals the last applied one: nothing changed
    REGRESSED = "regressed"  # batch seq below the last applied one: nothing changed
    UNKNOWN_WORKER = "unknown_worker"  # no registration for this worker: register first
    LEASE_EXPIRED = "lease_expired"  # the incarnation is retired: register again, resend inventory
    TOO_LARGE = "too_large"  # more than max_batch_events events: nothing changed


class RejectReason(enum.Enum):
    BAD_NAMESPACE = "bad_namespace"  # namespace digest is not 16 bytes
    BAD_KEY = "bad_key"  # page key or parent key is not 16 bytes
    BAD_KIND = "bad_kind"
    BAD_TIER = "bad_tier"
    BAD_DEPTH = "bad_depth"  # INSERT with depth < 1
    BAD_PARENT = "bad_parent"  # depth 1 with a parent other than the namespace root
    MISSING_PARENT = "missing_parent"  # depth > 1 and the same worker does not hold the parent
    NOT_HELD = "not_held"  # MOVE/DROP of a page the worker does not hold


class RejectedEvent(NamedTuple):
    index: int  # position in the batch
    reason: RejectReason


@dataclass(frozen=True, slots=True)
class ApplyResult:
    outcome: Outcome
    num_applied: int = 0
    rejected: tuple[RejectedEvent, ...] = ()


class Holder(NamedTuple):
    worker: WorkerId
    tier: Tier  # fastest tier holding the page


class WorkerMatch(NamedTuple):
    """The leading pages of a query one live worker holds, contiguously from depth 1.

    ``tiers[d - 1]`` is the fastest tier with a copy of the depth-``d`` page;
    ``num_hbm + num_dram + num_nvme == num_pages``.
    """

    worker: WorkerId
    tiers: bytes
    num_hbm: int
    num_dram: int
    num_nvme: int

    @classmethod
    def from_tiers(cls, worker: WorkerId, tiers: bytes) -> WorkerMatch:
        return cls(worker, tiers, tiers.count(1), tiers.count(2), tiers.count(3))

    @property
    def num_pages(self) -> int:
        return len(self.tiers)

    def num_in(self, tier: Tier) -> int:
        return (self.num_hbm, self.num_dram, self.num_nvme)[tier - 1]

    def tier_at(self, depth: int) -> Tier:
        return Tier(self.tiers[depth - 1])


class LookupResult(NamedTuple):
    num_query_pages: int
    matches: tuple[WorkerMatch, ...]  # live workers holding depth 1, longest first, then by name
    epoch: int

    @property
    def matched_depth(self) -> int:
        """Longest prefix one live worker holds (pages); 0 on a miss."""
        return self.matches[0].num_pages if self.matches else 0

    def holders_at(self, depth: int) -> tuple[Holder, ...]:
        return tuple(Holder(m.worker, m.tier_at(depth)) for m in self.matches if m.num_pages >= depth)

    @property
    def holders(self) -> tuple[Holder, ...]:
        """Holders of the deepest matched page."""
        return self.holders_at(self.matched_depth) if self.matches else ()

    @property
    def holders_per_depth(self) -> tuple[tuple[Holder, ...], ...]:
        return tuple(self.holders_at(d) for d in range(1, self.matched_depth + 1))


@dataclass(frozen=True, slots=True)
class Registration:
    outcome: Outcome
    worker: WorkerId
    replaced_previous: bool = False  # an older incarnation existed and was retired


@dataclass(frozen=True, slots=True)
class PurgeResult:
    outcome: Outcome
    num_removed: int = 0  # (page, holder) entries deleted
    retired: tuple[WorkerId, ...] = ()  # incarnations retired by this call
    is_done: bool = True  # False: the budget ran out, call again


@dataclass(frozen=True, slots=True)
class InvalidateResult:
    outcome: Outcome
    epoch: int = 0  # the namespace's new epoch


@dataclass(frozen=True, slots=True)
class ReclaimResult:
    outcome: Outcome
    num_deleted: int = 0
    num_pending_namespaces: int = 0


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    epoch: int
    num_pages: int  # distinct pages with at least one holder
    num_entries: int  # (page, holder) pairs
    entries_by_tier: dict[Tier, int]  # pairs with a copy in that tier (a pair may count in several)
    entries_by_worker: dict[WorkerId, int]
    num_orphans: int  # held pages whose parent the same worker dropped (unroutable, see lookup)
    num_inversions: int  # parent/child pairs of one worker where the child is in a faster tier
    num_pending_epochs: int  # invalidated epochs not yet reclaimed
    fence: int
    rejected: dict[str, int]  # reason -> events, since the namespace was created
    num_duplicate_batches: int
    num_regressed_batches: int

    @property
    def is_ordered(self) -> bool:
        """Lookups take the bisection fast path (no orphans, no inversions)."""
        return self.num_orphans == 0 and self.num_inversions == 0


def _script_source(name: str, preludes: Sequence[str]) -> str:
    body = (_LUA_DIR / f"{name}.lua").read_text()
    shared = "\n".join((_LUA_DIR / f"{p}.lua").read_text() for p in preludes)
    if body.startswith("#!"):  # flags must stay on the first line
        shebang, _, rest = body.partition("\n")
        return f"{shebang}\n{shared}\n{rest}"
    return f"{shared}\n{body}"


# Script name -> the shared files it is prepended with (read-only scripts get the short one).
_SCRIPTS = {
    **dict.fromkeys(("lookup", "stats"), ("namespace_keys",)),
    **dict.fromkeys(("apply_events", "drop_worker", "invalidate", "reclaim", "fence"),
                    ("namespace_keys", "namespace_write")),
    **dict.fromkeys(("register", "heartbeat", "retire", "sweep", "forget", "workers"), ("registry_common",)),
}


def _check_namespace(namespace: bytes) -> None:
    if len(namespace) != KEY_BYTES:
        raise InvalidArgument(f"namespace digest must be {KEY_BYTES} bytes, got {len(namespace)}",
                              field="namespace")


def _meta_key(namespace: bytes) -> str:
    return f"kvt:{{{namespace.hex()}}}:m"


def _ns_key(namespace: bytes, suffix: str) -> str:
    return f"kvt:{{{namespace.hex()}}}:{suffix}"


def _pack_keys(keys: Sequence[PageKey]) -> bytes:
    packed = b"".join(keys)
    if len(packed) != KEY_BYTES * len(keys):
        bad = next(i for i, k in enumerate(keys) if len(k) != KEY_BYTES)
        raise InvalidArgument(f"page key {bad} is {len(keys[bad])} bytes, expected {KEY_BYTES}",
                              field="page_keys")
    return packed


def _pack_events(events: Iterable[PageEvent]) -> bytes:
    out = bytearray()
    for e in events:
        flags = _FLAG_PARENT if e.parent is not None else 0
        key, parent = e.key, e.parent or _NO_KEY
        if len(key) != KEY_BYTES or len(parent) != KEY_BYTES:
            flags, key, parent = flags | _FLAG_BAD_KEY, _NO_KEY, _NO_KEY
        depth = e.depth if -(2**31) <= e.depth < 2**31 else -1
        kind = int(e.kind) if 0 <= int(e.kind) < 256 else 0
        tier = int(e.tier or 0) if 0 <= int(e.tier or 0) < 256 else 255
        from_tier = int(e.from_tier or 0) if 0 <= int(e.from_tier or 0) < 256 else 255
        out += _EVENT.pack(kind, tier, from_tier, flags, depth, key, parent)
    return bytes(out)


class Directory:
    """Async client of the directory. One per controller process; not shared across event loops.

    Lookups are valid at any time. Writes go through only while ``fence_token`` is at least the
    newest leader's token; set it from ``LeaderLease`` and call ``raise_fences`` after election.
    """

    def __init__(
        self,
        client: aredis.Redis,
        *,
        lookup_client: aredis.Redis | None = None,
        lease_ttl_ms: int = 3000,
        fence_token: int | None = 0,
        max_batch_events: int = MAX_BATCH_EVENTS,
        clock_ms: Callable[[], float] = _monotonic_ms,
    ) -> None:
        if lease_ttl_ms < 1:
            raise InvalidArgument(f"lease_ttl_ms must be >= 1, got {lease_ttl_ms}", field="lease_ttl_ms")
        self._redis = client
        # Route's lookups may use a client without a socket timeout: redis-py wraps every send
        # in asyncio.wait_for when one is set, and on Python 3.11 that is a Task per command,
        # the largest cost of Route after the round trip itself. The router bounds the lookup
        # with its own asyncio.timeout instead (Router._lookup).
        self._lookup_redis = lookup_client or client
        self.lease_ttl_ms = lease_ttl_ms
        self.fence_token = fence_token
        self.max_batch_events = max_batch_events
        self._clock_ms = clock_ms
        self._scripts = {name: client.register_script(_script_source(name, preludes))
                         for name, preludes in _SCRIPTS.items()}
        self._wid_by_name: dict[WorkerId, int] = {}
        self._name_by_wid: dict[int, WorkerId] = {}
        self._deadline_ms: dict[int, float] = {}  # incarnations not retired (expired ones until retired)
        self._indexed: set[tuple[int, bytes]] = set()  # (wid, namespace) already in wns / namespaces
        self._lookup_sha = self._scripts["lookup"].sha
        self._meta_keys: dict[bytes, str] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        # Route's copy of what this object wrote (controller/directory_mirror.py). It answers
        # only while every live incarnation is one whose every write it saw: registered here
        # and no write of it failed midway (then Redis may or may not hold the write).
        self.mirror = DirectoryMirror()
        self._mirrored: set[int] = set()
        self._unmirrored: set[int] = set()  # known incarnations the mirror cannot answer for
        # (op, seconds) of every round trip (op: the Lua script's name), for the controller's metrics.
        self.on_op: Callable[[str, float], None] | None = None

    # -- plumbing ---------------------------------------------------------------------------

    async def load_scripts(self) -> None:
        """Load every script now (they also load lazily on the first NOSCRIPT)."""
        for script in self._scripts.values():
            await self._redis.script_load(script.script)

    @contextlib.contextmanager
    def _timed(self, op: str) -> Iterator[None]:
        if self.on_op is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.on_op(op, time.perf_counter() - start)

    async def _eval(self, name: str, key: str, *args: object) -> list:
        script = self._scripts[name]
        with self._timed(name):
            try:
                return await self._redis.evalsha(script.sha, 1, key, *args)
            except NoScriptError:
                await self._redis.script_load(script.script)
                return await self._redis.evalsha(script.sha, 1, key, *args)

    async def _eval_many(self, calls: list[tuple[str, str, tuple]], extra: Sequence[tuple] = ()) -> list:
        """Runs extra commands then the scripts in one pipelined round trip; returns script replies."""
        with self._timed(calls[0][0] if calls else "pipeline"):
            for attempt in (0, 1):
                try:
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for command in extra:
                            pipe.execute_command(*command)
                        for name, key, args in calls:
                            pipe.evalsha(self._scripts[name].sha, 1, key, *args)
                        replies = await pipe.execute()
                    return replies[len(extra):]
                except NoScriptError:
                    if attempt:
                        raise
                    await self.load_scripts()
        raise AssertionError("unreachable")

    def _is_live(self, wid: int, now_ms: float) -> bool:
        return self._deadline_ms.get(wid, 0.0) > now_ms

    def _forget_locally(self, wid: int) -> None:
        self._deadline_ms.pop(wid, None)
        self._mirrored.discard(wid)
        self._unmirrored.discard(wid)
        self.mirror.forget_worker(wid)
        name = self._name_by_wid.get(wid)
        if name is not None and self._wid_by_name.get(name) == wid:
            del self._wid_by_name[name]

    async def _resolve(self, worker: WorkerId) -> int | None:
        wid = self._wid_by_name.get(worker)
        if wid is None:
            await self.refresh_workers()
            wid = self._wid_by_name.get(worker)
        return wid

    # -- workers and leases -----------------------------------------------------------------

    async def register_worker(self, worker: WorkerId) -> Registration:
        """Start a new incarnation of ``worker`` with a fresh lease; any previous one is retired."""
        if self.fence_token is None:
            return Registration(Outcome.FENCED, worker)
        sent_ms = self._clock_ms()
        reply = await self._eval("register", _WORKERS_KEY, self.fence_token, worker, self.lease_ttl_ms)
        if reply[0] == b"fenced":
            return Registration(Outcome.FENCED, worker)
        wid, previous = int(reply[1]), int(reply[2])
        if previous:
            self._forget_locally(previous)
        self._wid_by_name[worker] = wid
        self._name_by_wid[wid] = worker
        self._deadline_ms[wid] = sent_ms + self.lease_ttl_ms
        self._mirrored.add(wid)  # a new incarnation: every entry it will have is written here
        return Registration(Outcome.OK, worker, replaced_previous=bool(previous))

    async def heartbeat(self, worker: WorkerId) -> Outcome:
        """Renew the worker's lease: ``OK``, or ``LEASE_EXPIRED`` / ``UNKNOWN_WORKER`` (register again)."""
        if self.fence_token is None:
            return Outcome.FENCED
        wid = await self._resolve(worker)
        if wid is None:
            return Outcome.UNKNOWN_WORKER
        sent_ms = self._clock_ms()
        if not self._is_live(wid, sent_ms):
            # Lookups here stopped seeing it already; reviving it would resurrect stale entries.
            reply = await self._eval("retire", _WORKERS_KEY, self.fence_token, wid, worker)
            if reply[0] == b"fenced":
                return Outcome.FENCED
            self._forget_locally(wid)
            return Outcome.LEASE_EXPIRED
        reply = await self._eval("heartbeat", _WORKERS_KEY, self.fence_token, worker, wid, self.lease_ttl_ms)
        status = reply[0]
        if status == b"ok":
            self._deadline_ms[wid] = sent_ms + self.lease_ttl_ms
            return Outcome.OK
        if status == b"fenced":
            return Outcome.FENCED
        self._forget_locally(wid)
        return Outcome.LEASE_EXPIRED if status == b"expired" else Outcome.UNKNOWN_WORKER

    def is_live(self, worker: WorkerId) -> bool:
        wid = self._wid_by_name.get(worker)
        return wid is not None and self._is_live(wid, self._clock_ms())

    async def refresh_workers(self, *, revive: bool = False) -> int:
        """Learn incarnations registered elsewhere and forget those whose lease Redis dropped.

        Deadlines of incarnations this object already knows come from its own renewals, so an
        incarnation it saw expire stays dead (its entries may be stale). ``revive`` adopts
        Redis's remaining TTL for all of them instead: use it on a controller that does not
        renew the leases itself (a standby, every ~ttl/3; a leader right after its election).
        Returns the number of live leases in Redis.
        """
        sent_ms = self._clock_ms()
        reply = await self._eval("workers", _WORKERS_KEY)
        gone = set(self._deadline_ms)  # leases Redis no longer has
        num_live = 0
        for i in range(0, len(reply), 3):
            wid, name, pttl_ms = int(reply[i]), WorkerId(reply[i + 1].decode()), int(reply[i + 2])
            known = wid in self._name_by_wid
            self._name_by_wid[wid] = name  # retired ones too, so their entries never look unknown
            if pttl_ms <= 0:
                continue
            gone.discard(wid)
            num_live += 1
            if known and not revive:
                continue  # our own renewals are the authority for incarnations we know
            self._wid_by_name[name] = wid
            self._deadline_ms[wid] = sent_ms + pttl_ms
            if wid not in self._mirrored:
                self._unmirrored.add(wid)  # registered by another controller (or an earlier term)
        for wid in gone:
            self._forget_locally(wid)
        return num_live

    async def drop_worker(self, worker: WorkerId, *, batch_size: int = 1000) -> PurgeResult:
        """Retire the worker's incarnation (invisible at once) and delete all its entries."""
        if self.fence_token is None:
            return PurgeResult(Outcome.FENCED)
        wid = await self._resolve(worker)
        if wid is None:
            return PurgeResult(Outcome.UNKNOWN_WORKER)
        reply = await self._eval("retire", _WORKERS_KEY, self.fence_token, wid, worker)
        if reply[0] == b"fenced":
            return PurgeResult(Outcome.FENCED)
        self._forget_locally(wid)
        outcome, removed, done = await self._purge(wid, budget=None, batch_size=batch_size)
        return PurgeResult(outcome, removed, (worker,), done)

    async def sweep(self, max_items: int = 1000) -> PurgeResult:
        """Retire incarnations whose lease expired (here or in Redis); purge at most ~max_items entries."""
        if self.fence_token is None:
            return PurgeResult(Outcome.FENCED)
        now_ms = self._clock_ms()
        newly: list[WorkerId] = []
        for wid in [w for w, deadline in self._deadline_ms.items() if deadline <= now_ms]:
            name = self._name_by_wid.get(wid, WorkerId(""))
            reply = await self._eval("retire", _WORKERS_KEY, self.fence_token, wid, name)
            if reply[0] == b"fenced":
                return PurgeResult(Outcome.FENCED)
            self._forget_locally(wid)
            newly.append(name)
        reply = await self._eval("sweep", _WORKERS_KEY, self.fence_token)
        if reply[0] == b"fenced":
            return PurgeResult(Outcome.FENCED)
        removed, done = 0, True
        for wid in (int(w) for w in reply[1:]):
            if wid in self._deadline_ms:
                self._forget_locally(wid)
                newly.append(self._name_by_wid.get(wid, WorkerId("")))
            outcome, n, wid_done = await self._purge(wid, budget=max_items - removed, batch_size=max_items)
            if outcome is Outcome.FENCED:
                return PurgeResult(Outcome.FENCED, removed, tuple(newly), False)
            removed += n
            done = done and wid_done
            if removed >= max_items:
                done = False
                break
        return PurgeResult(Outcome.OK, removed, tuple(newly), done)

    async def _purge(self, wid: int, *, budget: int | None, batch_size: int) -> tuple[Outcome, int, bool]:
        """Deletes a retired incarnation's entries namespace by namespace, then its last records."""
        wns = f"{GLOBAL_PREFIX}wns:{wid}"
        removed = 0
        while True:
            namespaces = await self._redis.srandmember(wns, 64)
            if not namespaces:
                break
            for ns in namespaces:
                while True:
                    step = batch_size if budget is None else min(batch_size, budget - removed)
                    if step <= 0:
                        return Outcome.OK, removed, False
                    reply = await self._eval("drop_worker", _meta_key(ns), self.fence_token, wid, step)
                    if reply[0] == b"fenced":
                        return Outcome.FENCED, removed, False
                    removed += int(reply[1])
                    if int(reply[2]) == 0:
                        await self._redis.srem(wns, ns)
                        self._indexed.discard((wid, ns))
                        break
        reply = await self._eval("forget", _WORKERS_KEY, self.fence_token, wid)
        if reply[0] == b"fenced":
            return Outcome.FENCED, removed, False
        self._name_by_wid.pop(wid, None)
        return Outcome.OK, removed, bool(reply[1])

    # -- pages --------------------------------------------------------------------------------

    async def apply_events(self, worker: WorkerId, seq_no: int, events: Sequence[PageEvent]) -> ApplyResult:
        """Apply one batch of a worker's page events, in order, exactly once per namespace.

        Batches of one worker must arrive in ``seq_no`` order; a seq at or below the last one
        applied in a namespace changes nothing there (``DUPLICATE`` / ``REGRESSED``). Malformed
        events are skipped with a reason (``rejected``) and counted; the rest still apply.
        """
        if not 0 <= seq_no < 2**53:
            raise InvalidArgument(f"seq_no must be in [0, 2**53), got {seq_no}", field="seq_no")
        if len(events) > self.max_batch_events:
            self.counters["batch.too_large"] += 1
            return ApplyResult(Outcome.TOO_LARGE)
        if self.fence_token is None:
            return ApplyResult(Outcome.FENCED)
        wid = await self._resolve(worker)
        if wid is None:
            return ApplyResult(Outcome.UNKNOWN_WORKER)
        if not self._is_live(wid, self._clock_ms()):
            return ApplyResult(Outcome.LEASE_EXPIRED)

        parts: dict[bytes, list[int]] = {}
        rejected: list[RejectedEvent] = []
        for i, event in enumerate(events):
            if len(event.namespace) != KEY_BYTES:
                rejected.append(RejectedEvent(i, RejectReason.BAD_NAMESPACE))
            else:
                parts.setdefault(bytes(event.namespace), []).append(i)
        calls, extra, fresh = [], [], []
        for ns, indexes in parts.items():
            packed = _pack_events(events[i] for i in indexes)
            calls.append(("apply_events", _meta_key(ns), (self.fence_token, wid, seq_no, packed, root_key(ns))))
            if (wid, ns) not in self._indexed:
                extra.append(("SADD", f"{GLOBAL_PREFIX}wns:{wid}", ns))
                extra.append(("SADD", f"{GLOBAL_PREFIX}namespaces", ns))
                fresh.append((wid, ns))
        try:
            replies = await self._eval_many(calls, extra) if calls else []
        except BaseException:
            self._mirrored.discard(wid)  # the batch may or may not be in Redis now
            self._unmirrored.add(wid)
            raise
        self._indexed.update(fresh)

        applied, statuses = 0, set()
        for (ns, indexes), reply in zip(parts.items(), replies, strict=True):
            statuses.add(reply[0])
            if reply[0] == b"ok":
                applied += int(reply[2])
                refused = {int(reply[j]) for j in range(3, len(reply), 2)}
                for j in range(3, len(reply), 2):
                    rejected.append(RejectedEvent(indexes[int(reply[j])], RejectReason(reply[j + 1].decode())))
                self.mirror.apply(wid, ns, (
                    (int(e.kind), e.key, int(e.tier or 0), int(e.from_tier or 0))
                    for j, e in enumerate(events[i] for i in indexes) if j not in refused
                ))
        for r in rejected:
            self.counters[f"rejected.{r.reason.value}"] += 1
        rejected.sort()
        if b"fenced" in statuses:
            outcome = Outcome.FENCED
        elif b"ok" in statuses or not statuses:
            outcome = Outcome.OK
        elif b"regressed" in statuses:
            outcome = Outcome.REGRESSED
        else:
            outcome = Outcome.DUPLICATE
        self.counters[f"batch.{outcome.value}"] += 1
        return ApplyResult(outcome, applied, tuple(rejected))

    async def lookup(self, namespace: NamespaceDigest, keys: Sequence[PageKey]) -> LookupResult:
        """Which live workers hold the leading pages of ``keys`` (a chain, depth 1 first). One round trip.

        ``keys`` must be a chain (key i's parent is key i - 1, as ``page_keys`` makes them).
        """
        meta = self._meta_keys.get(namespace)
        if meta is None:
            _check_namespace(namespace)
            meta = self._meta_keys[namespace] = _meta_key(namespace)
        packed = _pack_keys(keys)
        with self._timed("lookup"):
            try:  # inlined _eval: this is the hot path
                reply = await self._lookup_redis.evalsha(self._lookup_sha, 1, meta, packed)
            except NoScriptError:
                reply = await self._eval("lookup", meta, packed)
        for w in reply[1::2]:
            if w not in self._name_by_wid:
                await self.refresh_workers()  # a worker registered by another controller
                break
        self.mirror.learn_epoch(namespace, reply[0])
        return self._result(keys, zip(reply[1::2], reply[2::2], strict=True), reply[0])

    def local_lookup(self, namespace: NamespaceDigest, keys: Sequence[PageKey]) -> LookupResult | None:
        """``lookup``'s answer from the mirror, without a round trip; None when it cannot answer.

        It can while the namespace's epoch is known here and every live incarnation is one whose
        every write went through this object (module docstring of ``directory_mirror``).
        """
        epoch = self.mirror.epoch(namespace)
        if epoch is None or self._unmirrored and self._any_live(self._unmirrored):
            return None
        if keys and len(keys[0]) != KEY_BYTES:
            _pack_keys(keys)  # the same InvalidArgument as a Redis lookup
        self.counters["lookup.local"] += 1
        return self._result(keys, self.mirror.lookup(namespace, keys), epoch)

    def _any_live(self, wids: Iterable[int]) -> bool:
        now_ms = self._clock_ms()
        return any(self._deadline_ms.get(w, 0.0) > now_ms for w in wids)

    def _result(self, keys: Sequence[PageKey], runs: Iterable[tuple[int, bytes]], epoch: int) -> LookupResult:
        """Live incarnations' runs as matches: longest first, then by worker name."""
        names, deadlines = self._name_by_wid, self._deadline_ms
        now_ms = self._clock_ms()
        matches = [
            WorkerMatch(names[w], tiers, tiers.count(1), tiers.count(2), tiers.count(3))
            for w, tiers in runs
            if deadlines.get(w, 0.0) > now_ms
        ]
        if len(matches) > 1:
            matches.sort(key=lambda m: (-len(m.tiers), m.worker))
        return LookupResult(len(keys), tuple(matches), epoch)

    # -- namespaces ---------------------------------------------------------------------------

    async def invalidate(self, namespace: NamespaceDigest) -> InvalidateResult:
        """Bump the namespace epoch: every entry is unreachable at once; ``reclaim_step`` frees them."""
        _check_namespace(namespace)
        if self.fence_token is None:
            return InvalidateResult(Outcome.FENCED)
        # Listed for reclaim first: a crash in between leaves a harmless extra entry, never a leak.
        (reply,) = await self._eval_many(
            [("invalidate", _meta_key(namespace), (self.fence_token,))],
            [("SADD", f"{GLOBAL_PREFIX}reclaim", namespace)],
        )
        if reply[0] == b"fenced":
            return InvalidateResult(Outcome.FENCED)
        self.mirror.invalidate(namespace, int(reply[1]))
        return InvalidateResult(Outcome.OK, int(reply[1]))

    async def reclaim_step(self, max_items: int = 1000) -> ReclaimResult:
        """Delete at most about ``max_items`` items of invalidated epochs. Background work."""
        if self.fence_token is None:
            return ReclaimResult(Outcome.FENCED)
        pending_key = f"{GLOBAL_PREFIX}reclaim"
        deleted = 0
        for ns in await self._redis.srandmember(pending_key, 16):
            reply = await self._eval("reclaim", _meta_key(ns), self.fence_token, max_items - deleted)
            if reply[0] == b"fenced":
                return ReclaimResult(Outcome.FENCED, deleted)
            deleted += int(reply[1])
            if int(reply[2]) == 0:
                await self._redis.srem(pending_key, ns)
            if deleted >= max_items:
                break
        return ReclaimResult(Outcome.OK, deleted, await self._redis.scard(pending_key))

    async def raise_fences(self, batch_size: int = 100) -> Outcome:
        """Raise every namespace's fence to ``fence_token`` (run once after winning an election)."""
        if self.fence_token is None:
            return Outcome.FENCED
        self.mirror.forget_epochs()
        cursor = 0
        while True:
            cursor, namespaces = await self._redis.sscan(f"{GLOBAL_PREFIX}namespaces", cursor, count=batch_size)
            calls = [("fence", _meta_key(ns), (self.fence_token,)) for ns in namespaces]
            if calls and any(r[0] == b"fenced" for r in await self._eval_many(calls)):
                return Outcome.FENCED
            if cursor == 0:
                return Outcome.OK

    async def stats(self, namespace: NamespaceDigest) -> NamespaceStats:
        _check_namespace(namespace)
        epoch, lo, fence, counts, meta = await self._eval("stats", _meta_key(namespace))
        counts = {k.decode(): int(v) for k, v in zip(counts[::2], counts[1::2], strict=True)}
        meta = dict(zip(meta[::2], meta[1::2], strict=True))
        by_wid = {int(k[2:]): v for k, v in counts.items() if k.startswith("w:")}
        if not self._name_by_wid.keys() >= by_wid.keys():
            await self.refresh_workers()
        return NamespaceStats(
            epoch=epoch,
            num_pages=counts.get("pages", 0),
            num_entries=counts.get("entries", 0),
            entries_by_tier={t: counts.get(str(int(t)), 0) for t in Tier},
            entries_by_worker={self._name_by_wid.get(w, WorkerId(f"#{w}")): n for w, n in by_wid.items() if n},
            num_orphans=int(meta.get(b"orphans", 0)),
            num_inversions=int(meta.get(b"inversions", 0)),
            num_pending_epochs=epoch - lo,
            fence=fence,
            rejected={k[4:].decode(): int(v) for k, v in meta.items() if k.startswith(b"rej:")},
            num_duplicate_batches=int(meta.get(b"duplicate", 0)),
            num_regressed_batches=int(meta.get(b"regressed", 0)),
        )

    async def _integrity_snapshot(
        self, namespace: NamespaceDigest
    ) -> tuple[int, dict[bytes, bytes], set[int], dict[int, set[bytes]], dict[bytes, bytes], list[bytes | None]]:
        """One consistent view of a namespace's current epoch for ``check_integrity``: (epoch, page
        values, holder set, each holder's and record owner's index, counters, structure counters).

        Read in one MULTI / EXEC, since the scripts change these keys together: read one by one,
        a worker's last records and its holder-set entry removed in between (``drop_worker``)
        look like records without a holder. The indexes to read are those of the holders and
        record owners seen by the previous attempt; a new one appearing meanwhile means another try.
        """
        meta = _meta_key(namespace)
        wids: set[int] = set()
        for _ in range(8):
            epoch = int(await self._redis.hget(meta, "epoch") or 1)
            order = sorted(wids)
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hget(meta, "epoch")
                pipe.hgetall(_ns_key(namespace, f"p:{epoch}"))
                pipe.smembers(_ns_key(namespace, f"ws:{epoch}"))
                pipe.hgetall(_ns_key(namespace, f"c:{epoch}"))
                pipe.hmget(meta, "orphans", "inversions")
                for wid in order:
                    pipe.smembers(_ns_key(namespace, f"w:{epoch}:{wid}"))
                now_epoch, values, listed, counters, structure, *stored = await pipe.execute()
            listed = {int(w) for w in listed}
            owners = {int.from_bytes(v[p:p + 3], "little")
                      for v in values.values() for p in range(16, len(v) - _RECORD_BYTES + 1, _RECORD_BYTES)}
            if int(now_epoch or 1) == epoch and listed | owners <= wids:
                return epoch, values, listed, dict(zip(order, stored, strict=True)), counters, structure
            wids |= listed | owners
        raise IntegrityError(f"namespace {namespace[:4].hex()} kept changing while its integrity was read")

    async def check_integrity(self, namespace: NamespaceDigest) -> None:
        """Recompute every record and counter of the current epoch from the page values and compare.

        O(namespace): for tests and the admin CLI, never on a request path. Raises
        ``IntegrityError`` with the numbers.
        """
        _check_namespace(namespace)
        epoch, values, listed, indexes, counters, structure = await self._integrity_snapshot(namespace)
        nodes: dict[bytes, tuple[bytes, dict[int, list[int]]]] = {}
        for key, value in values.items():
            if len(value) <= 16 or (len(value) - 16) % _RECORD_BYTES:
                raise IntegrityError(f"page {key[:4].hex()}: value of {len(value)} bytes")
            recs: dict[int, list[int]] = {}
            for p in range(16, len(value), _RECORD_BYTES):
                wid = int.from_bytes(value[p:p + 3], "little")
                if recs and wid <= max(recs):
                    raise IntegrityError(f"page {key[:4].hex()}: worker ids not ascending at {wid}")
                recs[wid] = [value[p + 3]] + [int.from_bytes(value[q:q + 3], "little")
                                              for q in (p + 4, p + 7, p + 10)]
            nodes[key] = (value[:16], recs)

        def fastest(mask: int) -> int:
            return 0 if not mask else 1 if mask & 1 else 2 if mask & 2 else 3

        want = collections.Counter()
        children: dict[tuple[bytes, int], list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        index: dict[int, set[bytes]] = collections.defaultdict(set)
        for key, (parent, recs) in nodes.items():
            held = [w for w, r in recs.items() if r[0]]
            want["pages"] += bool(held)
            for wid, (mask, *_counts) in recs.items():
                index[wid].add(key)
                if not 0 <= mask <= 7:
                    raise IntegrityError(f"page {key[:4].hex()}: worker {wid} has tier mask {mask}")
                if not mask:
                    continue
                want["entries"] += 1
                want[f"w:{wid}"] += 1
                for t in (1, 2, 3):
                    want[str(t)] += (mask >> (t - 1)) & 1
                if parent == bytes(16):
                    continue
                parent_rec = nodes.get(parent, (b"", {}))[1].get(wid)
                if parent_rec is not None:
                    children[(parent, wid)][fastest(mask) - 1] += 1
                if parent_rec is None or not parent_rec[0]:
                    want["orphans"] += 1
                elif fastest(mask) < fastest(parent_rec[0]):
                    want["inversions"] += 1
        for key, (_, recs) in nodes.items():
            for wid, (mask, *counts) in recs.items():
                if counts != children.get((key, wid), [0, 0, 0]):
                    raise IntegrityError(f"page {key[:4].hex()} worker {wid}: child counts {counts}, "
                                         f"actual {children.get((key, wid), [0, 0, 0])}")
                if not mask and not any(counts):
                    raise IntegrityError(f"page {key[:4].hex()} worker {wid}: empty record")
        if listed != set(index):
            raise IntegrityError(f"holder set {sorted(listed)} != workers with records {sorted(index)}")
        for wid, keys in index.items():
            stored = indexes.get(wid, set())
            if stored != keys:
                raise IntegrityError(f"worker {wid}: index has {len(stored)} keys, records {len(keys)} "
                                     f"({len(stored - keys)} extra, {len(keys - stored)} missing)")
        counts = {k.decode(): int(v) for k, v in counters.items()}
        counts |= {k: int(v or 0) for k, v in zip(("orphans", "inversions"), structure, strict=True)}
        have = {k: v for k, v in counts.items() if v}
        if have != {k: v for k, v in want.items() if v}:
            raise IntegrityError(f"counters {sorted(have.items())} != actual {sorted(want.items())}")
