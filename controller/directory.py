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
The answers' types are in ``controller/directory_records.py``, the scripts' sources and
byte layouts in ``controller/directory_scripts.py``, the integrity check in
``controller/directory_integrity.py``.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from redis.exceptions import NoScriptError
from redis.typing import EncodableT

from kvtier.controller.directory_integrity import check_integrity
from kvtier.controller.directory_mirror import DirectoryMirror
from kvtier.controller.directory_records import (
    ApplyResult,
    EpochBump,
    HeldPrefix,
    NamespaceStats,
    Outcome,
    PrefixLookup,
    PurgeResult,
    ReclaimResult,
    RegisterResult,
    RejectedEvent,
    RejectReason,
)
from kvtier.controller.directory_scripts import (
    SCRIPTS,
    check_namespace,
    meta_key,
    pack_events,
    pack_keys,
    script_source,
)
from kvtier.controller.leader import GLOBAL_PREFIX
from kvtier.controller.redis_connect import RedisClient
from kvtier.domain.errors import InvalidArgument
from kvtier.domain.hashing import KEY_BYTES, NamespaceDigest, PageKey, root_key
from kvtier.domain.records import PageEvent, WorkerId
from kvtier.domain.tiers import Tier

MAX_BATCH_EVENTS = 4096
"""Events per ``apply_events`` call (the wire limit of ``PageEventBatch``)."""

_WORKERS_KEY = GLOBAL_PREFIX + "workers"


def _monotonic_ms() -> float:
    return time.monotonic() * 1000.0


_UNTIMED = contextlib.nullcontext()


class _Timed:
    """Reports one round trip's seconds to ``Directory.on_op``, failed ones included."""

    __slots__ = ("_on_op", "_op", "_start")

    def __init__(self, on_op: Callable[[str, float], None], op: str) -> None:
        self._on_op, self._op = on_op, op

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._on_op(self._op, time.perf_counter() - self._start)


class Directory:
    """Async client of the directory. One per controller process; not shared across event loops.

    Lookups are valid at any time. Writes go through only while ``fence_token`` is at least the
    newest leader's token; set it from ``LeaderLease`` and call ``raise_fences`` after election.
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        lookup_client: RedisClient | None = None,
        lease_ttl_ms: int = 3000,
        fence_token: int | None = 0,
        max_batch_events: int = MAX_BATCH_EVENTS,
        clock_ms: Callable[[], float] = _monotonic_ms,
        adopt_existing: bool = True,
        min_worker_id: int = 0,
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
        # False: only incarnations registered through this object are live here, never ones
        # found in Redis (a Directory made after a failover, whose data may predate it).
        self.adopt_existing = adopt_existing
        self.max_worker_id = min_worker_id  # the highest incarnation id seen; new ids go above it
        self._scripts = {name: client.register_script(script_source(name, preludes))
                         for name, preludes in SCRIPTS.items()}
        self._wid_by_name: dict[WorkerId, int] = {}
        self._name_by_wid: dict[int, WorkerId] = {}
        self._deadline_ms: dict[int, float] = {}  # incarnations not retired (expired ones until retired)
        self._indexed: set[tuple[int, bytes]] = set()  # (wid, namespace) already in wns / namespaces
        # The lookup's command arguments as bytes, which redis-py sends without encoding them.
        self._lookup_sha = self._scripts["lookup"].sha.encode()
        self._meta_keys: dict[bytes, bytes] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        # Route's copy of what this object wrote (controller/directory_mirror.py). It answers
        # only while every live incarnation is one whose every write it saw: registered here
        # and no write of it failed midway (then Redis may or may not hold the write).
        self.mirror = DirectoryMirror()
        self._mirrored: set[int] = set()
        self._registered: set[int] = set()  # incarnations registered through this object
        self._unmirrored: set[int] = set()  # known incarnations the mirror cannot answer for
        # (op, seconds) of every round trip (op: the Lua script's name), for the controller's metrics.
        self.on_op: Callable[[str, float], None] | None = None

    # -- plumbing ---------------------------------------------------------------------------

    async def load_scripts(self) -> None:
        """Load every script now (they also load lazily on the first NOSCRIPT)."""
        for script in self._scripts.values():
            await self._redis.script_load(script.script)

    def _timed(self, op: str) -> contextlib.AbstractContextManager[object]:
        if self.on_op is None:
            return _UNTIMED
        return _Timed(self.on_op, op)

    async def _eval(self, name: str, key: str, *args: EncodableT) -> list[Any]:
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
        self._registered.discard(wid)
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

    async def register_worker(self, worker: WorkerId) -> RegisterResult:
        """Start a new incarnation of ``worker`` with a fresh lease; any previous one is retired."""
        if self.fence_token is None:
            return RegisterResult(Outcome.FENCED, worker)
        sent_ms = self._clock_ms()
        reply = await self._eval("register", _WORKERS_KEY, self.fence_token, worker, self.lease_ttl_ms,
                                 self.max_worker_id)
        if reply[0] == b"fenced":
            return RegisterResult(Outcome.FENCED, worker)
        wid, previous = int(reply[1]), int(reply[2])
        self.max_worker_id = max(self.max_worker_id, wid)
        if previous:
            self._forget_locally(previous)
        self._wid_by_name[worker] = wid
        self._name_by_wid[wid] = worker
        self._deadline_ms[wid] = sent_ms + self.lease_ttl_ms
        self._mirrored.add(wid)  # a new incarnation: every entry it will have is written here
        self._registered.add(wid)
        return RegisterResult(Outcome.OK, worker, replaced_previous=bool(previous))

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
        Returns the number of live leases in Redis. With ``adopt_existing`` off, only
        incarnations registered here come alive; the others re-register (``UNKNOWN_WORKER``).
        """
        sent_ms = self._clock_ms()
        reply = await self._eval("workers", _WORKERS_KEY)
        gone = set(self._deadline_ms)  # leases Redis no longer has
        num_live = 0
        for i in range(0, len(reply), 3):
            wid, name, pttl_ms = int(reply[i]), WorkerId(reply[i + 1].decode()), int(reply[i + 2])
            self.max_worker_id = max(self.max_worker_id, wid)
            known = wid in self._name_by_wid
            self._name_by_wid[wid] = name  # retired ones too, so their entries never look unknown
            if pttl_ms <= 0:
                continue
            gone.discard(wid)
            num_live += 1
            if known and not revive:
                continue  # our own renewals are the authority for incarnations we know
            if not self.adopt_existing and wid not in self._registered:
                continue  # registered before a failover, or elsewhere: its entries are not trusted
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
        outcome, removed, done = await self._purge(
            wid, fence=self.fence_token, budget=None, batch_size=batch_size
        )
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
            outcome, n, wid_done = await self._purge(
                wid, fence=self.fence_token, budget=max_items - removed, batch_size=max_items
            )
            if outcome is Outcome.FENCED:
                return PurgeResult(Outcome.FENCED, removed, tuple(newly), False)
            removed += n
            done = done and wid_done
            if removed >= max_items:
                done = False
                break
        return PurgeResult(Outcome.OK, removed, tuple(newly), done)

    async def _purge(
        self, wid: int, *, fence: int, budget: int | None, batch_size: int
    ) -> tuple[Outcome, int, bool]:
        """Deletes a retired incarnation's entries namespace by namespace, then its last records."""
        wns = f"{GLOBAL_PREFIX}wns:{wid}"
        removed = 0
        while True:
            # With a count the reply is a list; bytes, as the client leaves decode_responses off.
            namespaces = cast("list[bytes]", await self._redis.srandmember(wns, 64))
            if not namespaces:
                break
            for ns in namespaces:
                while True:
                    step = batch_size if budget is None else min(batch_size, budget - removed)
                    if step <= 0:
                        return Outcome.OK, removed, False
                    reply = await self._eval("drop_worker", meta_key(ns), fence, wid, step)
                    if reply[0] == b"fenced":
                        return Outcome.FENCED, removed, False
                    removed += int(reply[1])
                    if int(reply[2]) == 0:
                        await self._redis.srem(wns, ns)
                        self._indexed.discard((wid, ns))
                        break
        reply = await self._eval("forget", _WORKERS_KEY, fence, wid)
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
            if len(event.namespace_digest) != KEY_BYTES:
                rejected.append(RejectedEvent(i, RejectReason.BAD_NAMESPACE))
            else:
                parts.setdefault(bytes(event.namespace_digest), []).append(i)
        calls, extra, fresh, codes = [], [], [], []
        for ns, indexes in parts.items():
            packed, ns_codes = pack_events(events[i] for i in indexes)
            codes.append(ns_codes)
            calls.append(("apply_events", meta_key(ns), (self.fence_token, wid, seq_no, packed, root_key(ns))))
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
        for (ns, indexes), ns_codes, reply in zip(parts.items(), codes, replies, strict=True):
            statuses.add(reply[0])
            if reply[0] == b"ok":
                applied += int(reply[2])
                refused = {int(reply[j]) for j in range(3, len(reply), 2)}
                for j in range(3, len(reply), 2):
                    rejected.append(RejectedEvent(indexes[int(reply[j])], RejectReason(reply[j + 1].decode())))
                if refused:
                    ns_codes = [c for j, c in enumerate(ns_codes) if j not in refused]
                self.mirror.apply(wid, ns, ns_codes)
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

    async def lookup(self, namespace: NamespaceDigest, keys: Sequence[PageKey]) -> PrefixLookup:
        """Which live workers hold the leading pages of ``keys`` (a chain, depth 1 first). One round trip.

        ``keys`` must be a chain (key i's parent is key i - 1, as ``page_keys`` makes them).
        """
        meta = self._meta_keys.get(namespace)
        if meta is None:
            check_namespace(namespace)
            meta = self._meta_keys[namespace] = meta_key(namespace).encode()
        packed = pack_keys(keys)
        # The hot path: _eval inlined, and no timing context unless someone reads the times.
        on_op = self.on_op
        start = time.perf_counter() if on_op is not None else 0.0
        try:
            reply = await self._lookup_redis.execute_command("EVALSHA", self._lookup_sha, b"1", meta, packed)
        except NoScriptError:
            reply = await self._eval("lookup", meta.decode(), packed)
        finally:
            if on_op is not None:
                on_op("lookup", time.perf_counter() - start)
        wids = reply[1::2]
        names = self._name_by_wid
        for w in wids:
            if w not in names:
                await self.refresh_workers()  # a worker registered by another controller
                break
        self.mirror.learn_epoch(namespace, reply[0])
        return self._result(keys, zip(wids, reply[2::2], strict=True), reply[0])

    def local_lookup(self, namespace: NamespaceDigest, keys: Sequence[PageKey]) -> PrefixLookup | None:
        """``lookup``'s answer from the mirror, without a round trip; None when it cannot answer.

        It can while the namespace's epoch is known here and every live incarnation is one whose
        every write went through this object (module docstring of ``directory_mirror``).
        """
        epoch = self.mirror.epoch(namespace)
        if epoch is None or self._unmirrored and self._any_live(self._unmirrored):
            return None
        if keys and len(keys[0]) != KEY_BYTES:
            pack_keys(keys)  # the same InvalidArgument as a Redis lookup
        self.counters["lookup.local"] += 1
        return self._result(keys, self.mirror.lookup(namespace, keys), epoch)

    def _any_live(self, wids: Iterable[int]) -> bool:
        now_ms = self._clock_ms()
        return any(self._deadline_ms.get(w, 0.0) > now_ms for w in wids)

    def _result(self, keys: Sequence[PageKey], runs: Iterable[tuple[int, bytes]], epoch: int) -> PrefixLookup:
        """Live incarnations' runs as matches: longest first, then by worker name."""
        names, deadlines = self._name_by_wid, self._deadline_ms
        now_ms = self._clock_ms()
        # HeldPrefix.from_tiers, inlined (one call less per holder on the lookup's hot path).
        matches = [
            HeldPrefix(names[w], tiers, tiers.count(1), tiers.count(2), tiers.count(3))
            for w, tiers in runs
            if deadlines.get(w, 0.0) > now_ms
        ]
        if len(matches) > 1:
            matches.sort(key=lambda m: (-len(m.tiers), m.worker))
        return PrefixLookup(len(keys), tuple(matches), epoch)

    # -- namespaces ---------------------------------------------------------------------------

    async def invalidate(self, namespace: NamespaceDigest) -> EpochBump:
        """Bump the namespace epoch: every entry is unreachable at once; ``reclaim_step`` frees them."""
        check_namespace(namespace)
        if self.fence_token is None:
            return EpochBump(Outcome.FENCED)
        # Listed for reclaim first: a crash in between leaves a harmless extra entry, never a leak.
        (reply,) = await self._eval_many(
            [("invalidate", meta_key(namespace), (self.fence_token,))],
            [("SADD", f"{GLOBAL_PREFIX}reclaim", namespace)],
        )
        if reply[0] == b"fenced":
            return EpochBump(Outcome.FENCED)
        self.mirror.invalidate(namespace, int(reply[1]))
        return EpochBump(Outcome.OK, int(reply[1]))

    async def reclaim_step(self, max_items: int = 1000) -> ReclaimResult:
        """Delete at most about ``max_items`` items of invalidated epochs. Background work."""
        if self.fence_token is None:
            return ReclaimResult(Outcome.FENCED)
        pending_key = f"{GLOBAL_PREFIX}reclaim"
        deleted = 0
        # With a count the reply is a list; bytes, as the client leaves decode_responses off.
        pending = cast("list[bytes]", await self._redis.srandmember(pending_key, 16))
        for ns in pending:
            reply = await self._eval("reclaim", meta_key(ns), self.fence_token, max_items - deleted)
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
            cursor, members = await self._redis.sscan(f"{GLOBAL_PREFIX}namespaces", cursor, count=batch_size)
            namespaces = cast("list[bytes]", members)  # bytes: the client leaves decode_responses off
            calls = [("fence", meta_key(ns), (self.fence_token,)) for ns in namespaces]
            if calls and any(r[0] == b"fenced" for r in await self._eval_many(calls)):
                return Outcome.FENCED
            if cursor == 0:
                return Outcome.OK

    async def stats(self, namespace: NamespaceDigest) -> NamespaceStats:
        check_namespace(namespace)
        epoch, lo, fence, counts, meta = await self._eval("stats", meta_key(namespace))
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

    async def check_integrity(self, namespace: NamespaceDigest) -> None:
        """Recompute every record and counter of the current epoch from the page values and compare.

        O(namespace): for tests and the admin CLI, never on a request path. Raises
        ``IntegrityError`` with the numbers (``controller/directory_integrity.py``).
        """
        check_namespace(namespace)
        await check_integrity(self._redis, namespace)
