"""The controller's and the operator's commands on cached pages: Demote, Prefetch, Drop, and
invalidation (engine thread).

Moves resolve an ``asyncio`` future once their transfers are applied to the index (the engine
thread polls transfers at every step and while idle). A commanded Prefetch waits for room made
in the background before its pages come up (at most ``MAX_PREFETCH_ROOM_WAIT_S``); a Demote
waits for the pages it asks for that are already on their way down (at most
``MAX_DEMOTE_WAIT_S``). Neither a prefetch nor a request takes its room from its own
session's hold.

Invalidation (DESIGN §5.3): ``invalidate`` marks the admitted namespaces a new epoch makes stale
and drops their idle pages at once (leaves first; each drop is a DROP page event, which is what
removes the directory's entries). Pages a running sequence holds, and the pages such a sequence
caches when it finishes, go in background passes (``reclaim``) until no page and no sequence of
a stale namespace is left.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kvtier.cache.radix import RadixNode
from kvtier.domain.errors import KvtierError
from kvtier.domain.hashing import NamespaceDigest, PageKey
from kvtier.domain.records import InvalidationScope, SessionId
from kvtier.domain.tiers import Tier
from kvtier.engine.engine import Engine
from kvtier.policy.holds import ExpectedReturn, hold_rank_ms
from kvtier.runtime.log import get_logger
from kvtier.tiers.moves import MoveOutcome, MoveTicket
from kvtier.worker.holds import DropOutcome, Holds, PageCounts, require_tiers
from kvtier.worker.page_events import PageEvents
from kvtier.worker.room import Room
from kvtier.worker.session_ref import SessionRef

log = get_logger("kvtier.worker.commands")

# A commanded prefetch waits at most this long for room made in the background; then it makes
# room on the engine thread.
MAX_PREFETCH_ROOM_WAIT_S = 1.0
# A commanded demotion waits at most this long for the pages it asks for that are already on
# their way down; then the rest go as they can.
MAX_DEMOTE_WAIT_S = 0.5


def deliver(aloop: asyncio.AbstractEventLoop, setter: Callable[..., None], *args: Any) -> None:
    """Call ``setter(*args)`` on ``aloop`` from any thread; nothing when the loop is closed."""
    try:
        aloop.call_soon_threadsafe(setter, *args)
    except RuntimeError:  # the awaiting loop is closed; nobody is waiting any more
        pass


def set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class Commands:
    """Commanded moves in flight, those deferred, and the stale namespaces left to reclaim."""

    def __init__(self, engine: Engine, holds: Holds, room: Room, events: PageEvents, *,
                 wait_scale: float = 1.0) -> None:
        self._engine = engine
        self._holds = holds
        self._room = room
        self._events = events
        self._wait_scale = wait_scale
        self._moves: set[asyncio.Future[MoveOutcome]] = set()
        # Prefetches waiting for room and demotions waiting for pages on their way down: a retry
        # and the caller's future.
        self._deferred: list[tuple[Callable[[], None], asyncio.Future[MoveOutcome]]] = []
        self._stale: set[NamespaceDigest] = set()  # invalidated, pages or sequences left
        self.is_reclaim_due = False  # a stale namespace's sequence ended, or pages were in transit

    @property
    def has_deferred(self) -> bool:
        return bool(self._deferred)

    @property
    def has_stale(self) -> bool:
        return bool(self._stale)

    def is_stale(self, digest: NamespaceDigest) -> bool:
        return digest in self._stale

    # ---- moves ----------------------------------------------------------------------
    def demote(
        self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None, dst: Tier,
        whole_namespace: bool, done: asyncio.Future[MoveOutcome], since: float | None = None,
        leaving: frozenset[PageKey] = frozenset(),
    ) -> None:
        """Move idle pages down to ``dst``; ``done`` resolves once they are there. Pages already
        on their way down (a watermark demotion that took them a moment before: a session's turn
        just finished, its Pause's Demote comes next) are waited for and counted as moved once
        they are there: they went where the command sends them. Demoted at once, they would be
        skipped, and so would every page above them (a page leaves HBM only after its children)."""
        nodes = self._demote_targets(digest, keys, session, whole_namespace)
        now = time.monotonic()
        since = now if since is None else since
        going = frozenset(n.key for n in nodes if n.tier is Tier.HBM and n.moving)
        if going and now - since < MAX_DEMOTE_WAIT_S * self._wait_scale:
            self._defer(lambda: self.demote(
                digest, keys, session, dst, whole_namespace, done, since, leaving | going), done)
            return
        ticket = require_tiers(self._engine).start_demotion(nodes, dst)
        ticket.num_moved += sum(n.key in leaving and n.tier >= dst for n in nodes)  # landed meanwhile
        self._track(ticket, done)

    def prefetch(
        self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None, hold_s: float | None,
        done: asyncio.Future[MoveOutcome], since: float | None = None, *, expected: ExpectedReturn | None = None,
    ) -> None:
        """Promote the pages into HBM, room first; a session's are held there up to ``hold_s``
        once they land (``Holds.take``)."""
        chain = self._resolve(digest, keys, session)
        # Room first, in the background: the pages coming up need free HBM pages, and taking
        # them by spilling would hold the engine thread on the link.
        now = time.monotonic()
        since = now if since is None else since
        rank = None  # the hold the pages will have: only weaker holds yield to them
        if session is not None and hold_s:
            rank = hold_rank_ms(expected, time.time() * 1000.0 + hold_s * 1000.0, time.time() * 1000.0)
        if now - since < MAX_PREFETCH_ROOM_WAIT_S * self._wait_scale and self._room.needs(
            sum(n.tier is not Tier.HBM for n in chain), rank=rank,
            session=None if session is None else SessionRef(digest, session)
        ):
            self._defer(lambda: self.prefetch(digest, keys, session, hold_s, done, since, expected=expected), done)
            return
        ticket = require_tiers(self._engine).start_prefetch(chain, spared=self._holds.spared(rank))
        if session is None:
            self._track(ticket, done)
            return
        pages = self._holds.session_pages(session, digest)

        def landed() -> None:
            # Not once the session's next generation has finished (it released the hold and
            # cached its pages as usual) or the session ended meanwhile.
            if self._holds.session_pages(session, digest) is not pages:
                return
            self._holds.note_prefetched(SessionRef(digest, session), ticket.promoted)
            if hold_s:
                self._holds.take(digest, session, chain, hold_s, num_moved=ticket.outcome.num_moved,
                                 expected=expected)

        self._track(ticket, done, landed)

    def retry_deferred(self) -> None:
        """Prefetches waiting for room and demotions waiting for pages on their way down, in order."""
        deferred, self._deferred = self._deferred, []
        for retry, done in deferred:
            try:
                retry()
            except KvtierError as exc:  # the session or its pages went meanwhile: the caller hears
                self._moves.discard(done)
                deliver(done.get_loop(), set_exception, done, exc)

    def fail_moves(self, error: KvtierError) -> None:
        """Moves still in flight are never applied (the thread stops): their callers hear."""
        for future in list(self._moves):
            deliver(future.get_loop(), set_exception, future, error)
        self._moves.clear()

    # ---- drops ----------------------------------------------------------------------
    def drop_pages(self, digest: NamespaceDigest, keys: tuple[PageKey, ...], whole_namespace: bool) -> DropOutcome:
        """Remove ``keys`` and their descendants (or every page of the namespace) where no
        sequence holds them and no pin keeps them."""
        index = self._engine.index
        digests = self._events.digests
        targets: set[PageKey] = set()
        num_missing = 0
        if whole_namespace:
            targets = {key for key, d in digests.items() if d == digest}
        for key in keys:
            if key in index and digests.get(key) == digest:
                targets.add(key)
            else:
                num_missing += 1
        if not targets:
            return DropOutcome(num_dropped=0, num_kept=0, num_missing=num_missing)
        # Descendants of a target go too; one pass in depth order finds them.
        subtree: list[RadixNode] = []
        for node in sorted(index.nodes(), key=lambda n: n.depth):
            if node.key in targets or (node.parent is not None and node.parent.key in targets):
                targets.add(node.key)
                subtree.append(node)
        num_dropped = 0
        for node in reversed(subtree):  # leaves before their parents
            if index.is_evictable(node):
                index.remove(node.key)
                num_dropped += 1
        return DropOutcome(num_dropped=num_dropped, num_kept=len(subtree) - num_dropped, num_missing=num_missing)

    # ---- invalidation ---------------------------------------------------------------
    def invalidate(self, scope: InvalidationScope, epoch: int, busy: set[NamespaceDigest]) -> PageCounts:
        """Mark the admitted namespaces ``scope`` makes stale at ``epoch``, release their pins and
        drop their idle pages (``busy``: namespaces with a request waiting or in the engine)."""
        for digest, identity in self._events.identities().items():
            if identity.policy_epoch < epoch and scope.matches(identity):
                self._stale.add(digest)
        self._holds.release_namespaces(self._stale)
        num_dropped, num_kept = self.reclaim(busy)
        log.info("namespaces invalidated", extra={
            "policy_epoch": epoch, "num_stale_namespaces": len(self._stale),
            "num_dropped": num_dropped, "num_kept": num_kept})
        return PageCounts(num_done=num_dropped, num_kept=num_kept)

    def run_ended(self, digest: NamespaceDigest | None) -> None:
        if digest in self._stale:
            self.is_reclaim_due = True  # its pages are idle now (and cached, if it finished)

    def reclaim(self, busy: set[NamespaceDigest]) -> tuple[int, int]:
        """Drop the idle pages of stale namespaces, leaves first; (dropped, left for later).

        A stale namespace is forgotten once it has no page and no sequence left (``busy``: the
        namespaces with a request waiting or in the engine; a running sequence caches its pages
        when it finishes, and a later pass drops them)."""
        index = self._engine.index
        doomed = self._events.nodes_of(self._stale)
        doomed.sort(key=lambda n: -n.depth)  # children before their parents
        num_dropped = 0
        for node in doomed:
            if node.is_leaf and index.is_evictable(node):
                index.remove(node.key)
                num_dropped += 1
        running = busy & self._stale
        digests = self._events.digests
        left = {digests[n.key] for n in doomed if n.key in digests}
        # Pages no stale sequence explains (in transit): look again soon. Otherwise the next
        # pass comes when a stale sequence ends (``run_ended``) or the engine goes idle.
        self.is_reclaim_due = bool(left - running)
        for digest in self._stale - running - left:
            self._stale.discard(digest)
            self._events.forget(digest)
            self._engine.forget_namespace(digest)
        return num_dropped, len(doomed) - num_dropped

    # ---- internals ------------------------------------------------------------------
    def _resolve(
        self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None
    ) -> list[RadixNode]:
        """Cached nodes of ``keys`` in the namespace; for a session, the longest cached prefix
        of its last generation's pages (root first)."""
        if session is not None:
            return self._holds.session_chain(digest, session)
        index, digests = self._engine.index, self._events.digests
        nodes = [index.get(k) for k in keys if digests.get(k) == digest]
        return [n for n in nodes if n is not None]

    def _demote_targets(
        self, digest: NamespaceDigest, keys: tuple[PageKey, ...], session: SessionId | None, whole_namespace: bool
    ) -> list[RadixNode]:
        if whole_namespace:
            return self._events.nodes_of({digest})
        nodes = self._resolve(digest, keys, session)
        if session is not None:
            return nodes
        # A page leaves its tier only after everything below it: the descendants go too.
        seen = {n.key for n in nodes}
        stack = list(nodes)
        while stack:
            for child in stack.pop().children.values():
                if child.key not in seen:
                    seen.add(child.key)
                    nodes.append(child)
                    stack.append(child)
        return nodes

    def _track(
        self, ticket: MoveTicket, done: asyncio.Future[MoveOutcome], then: Callable[[], None] | None = None
    ) -> None:
        """Resolve ``done`` with ``ticket``'s outcome once it is applied, after running ``then``."""
        def finish(outcome: MoveOutcome) -> None:
            self._moves.discard(done)
            if then is not None:
                then()
            deliver(done.get_loop(), set_result, done, outcome)

        if ticket.is_done:
            finish(ticket.outcome)
        else:
            self._moves.add(done)
            ticket.on_done = finish

    def _defer(self, retry: Callable[[], None], done: asyncio.Future[MoveOutcome]) -> None:
        """Run ``retry`` again on the loop's next pass; ``done`` stays a move in flight meanwhile
        (failed if the loop closes)."""
        self._moves.add(done)
        self._deferred.append((retry, done))
