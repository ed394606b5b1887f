"""Radix pins the worker keeps: admin pins, session holds, and the sessions they are for.

Engine thread only, except the read-only views (``is_held``, ``view``, ``is_lapsed``,
``snapshot``), which read one dict entry or copy a dict and may run on any thread.

Sessions: when a generation with a ``session_id`` finishes (``remember``), the worker keeps
that session's namespace digest and the keys of the full pages it left cached (prompt plus
output, less the last sampled token, which is never fed back). Only the worker knows the
output pages, so the controller addresses a session's pages by namespace digest and session
id and they resolve here (``session_chain``): the longest prefix of those keys still cached.
Sessions are keyed by (namespace digest, session id) (``SessionRef``): the digest covers the
tenant, so another tenant's generation under the same id is another session and leaves this
one's pages, hold and tally alone. The newest ``MAX_SESSIONS`` sessions are kept.

Admin pins (``pin`` / ``release``, by pin id): radix pins on the listed pages the worker
holds in the pin's tier or a faster one, released exactly once: by ``release``, when
``expires_at_ms`` passes (``expire``), or when their namespace is invalidated
(``release_namespaces``). Pinning an id already held changes nothing (the controller sends
every pin again when the link reconnects).

Session holds (``take``): a prefetch lands ahead of the session's return; idle, and last
touched before everything that ran since, its pages would be the first an eviction takes.
One pin on the deepest HBM page holds the chain above it (leaves leave first), under the
session's hold id, until the session's next generation finishes, the session ends, or the
hold lapses. Holds together keep at most ``cap_pages``; the rules that rank, displace and
yield them are ``kvtier.policy.holds`` (decision 0008 has the measurements). A hold that
yielded, was displaced or was refused is remembered (lapsed) and taken again once HBM has
free room (``retake``), before its session is back.

Prefetch waste: pages brought up for a session due back are tallied by session
(``note_prefetched``) and settled when its next request arrives (``settle``): the page moves
count as ``session_prefetched_pages``, and those not in HBM when it arrived, or moved up more
than once, as ``session_prefetch_wasted_pages``.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from kvtier.cache.radix import RadixNode
from kvtier.domain.errors import FailedPrecondition, InvalidArgument, NotFound
from kvtier.domain.hashing import NamespaceDigest, PageKey, page_keys
from kvtier.domain.records import PinCommand, PinId, SessionId
from kvtier.domain.tiers import Tier
from kvtier.engine.engine import Engine
from kvtier.policy.holds import (
    ExpectedReturn,
    can_retake,
    fits_cap,
    hold_rank_ms,
    is_due_soon,
    num_held,
    plan_displacement,
    retake_order,
    weakest_hold,
)
from kvtier.runtime.log import get_logger
from kvtier.tiers.manager import TierManager
from kvtier.tiers.moves import MoveOutcome, MoveTicket
from kvtier.worker.session_ref import HOLD_PREFIX, SessionRef, hold_id, hold_ref

log = get_logger("kvtier.worker.holds")

# What became of session holds (``outcomes``, the ``kvtier.session_holds`` metric): taken; not
# taken because none of the session's pages was in HBM or the worker is draining (``unheld``), or
# holds were at their cap and all were due back sooner (``refused``); released early for a hold
# due back sooner (``displaced``) or for room needed now (``yielded``); taken again, its pages
# brought back up if they had left, once HBM had room (``retaken``).
HOLD_OUTCOMES = ("taken", "unheld", "refused", "displaced", "yielded", "retaken")
# The default of ``WorkerConfig.session_hold_fraction``.
MAX_HELD_FRACTION = 1.0
# Sessions whose last generation's pages are kept (least recently finished go first).
MAX_SESSIONS = 1 << 16


def is_in_range(value: object, most: float) -> bool:
    """``value`` is a number (not a bool) in (0, ``most``]; NaN is not."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= most


def _now_ms() -> float:
    return time.time() * 1000.0


@dataclass(slots=True, eq=False)
class _Pin:
    digest: NamespaceDigest
    nodes: list[RadixNode]  # the pinned nodes, one radix pin each
    expires_at_ms: int | None
    # Session holds: when the session is expected back (from the Prefetch), and how many of its
    # pages the prefetch behind it brought up.
    expected: ExpectedReturn | None = None
    num_moved: int = 0

    def rank(self, now_ms: float) -> float:
        return hold_rank_ms(self.expected, self.expires_at_ms, now_ms)


@dataclass(frozen=True, slots=True)
class SessionPages:
    """The pages a session's last finished generation left cached (root first)."""

    namespace_digest: NamespaceDigest
    page_keys: tuple[PageKey, ...]


@dataclass(frozen=True, slots=True)
class HoldView:
    """One session hold as of a moment: when it lapses, when its session is expected back, its
    rank then (``kvtier.policy.holds.hold_rank_ms``), and the pages the prefetch behind it moved."""

    expires_at_ms: int | None
    expected: ExpectedReturn | None
    rank_ms: float
    num_moved: int


@dataclass(frozen=True, slots=True)
class HoldsSnapshot:
    """Counts of what the holds component keeps (tests and metrics)."""

    pin_ids: frozenset[PinId]  # admin pins and session holds
    held: frozenset[SessionId]
    lapsed: frozenset[SessionId]
    num_sessions_prefetched: int  # sessions with page moves not yet settled
    num_awaited_pages: int  # pages brought up for sessions not yet settled


@dataclass(frozen=True, slots=True)
class DropOutcome:
    """Pages removed, and pages kept because a sequence holds them (or a descendant) or they are
    pinned, and keys asked for that were not cached."""

    num_dropped: int
    num_kept: int
    num_missing: int


@dataclass(frozen=True, slots=True)
class PageCounts:
    """Pages an operation handled now, and pages it left alone (``num_kept``)."""

    num_done: int
    num_kept: int


@dataclass(slots=True)
class _Prefetched:
    """Pages brought up for a session due back since its last generation finished: their keys,
    and how many page moves that took (a page that went down and came up again moved twice)."""

    keys: set[PageKey] = field(default_factory=set)
    num_moved: int = 0


def _chain_keys(node: RadixNode) -> frozenset[PageKey]:
    """``node``'s key and its ancestors': the pages a pin on ``node`` keeps."""
    keys: list[PageKey] = []
    current: RadixNode | None = node
    while current is not None:
        keys.append(current.key)
        current = current.parent
    return frozenset(keys)


class Holds:
    """The worker's radix pins on ``engine``'s index: admin pins and session holds, the
    sessions' pages, and the tally of pages brought up for them."""

    def __init__(self, engine: Engine, *, hold_fraction: float | None = None) -> None:
        if hold_fraction is not None and not is_in_range(hold_fraction, 1.0):
            raise InvalidArgument(
                f"session_hold_fraction must be in (0, 1], got {hold_fraction!r}", field="session_hold_fraction"
            )
        self._engine = engine
        self._hold_fraction = hold_fraction  # None: MAX_HELD_FRACTION
        self._pins: dict[PinId, _Pin] = {}
        self._lapsed: dict[SessionRef, _Pin] = {}  # holds gone before their session was back
        self._sessions: OrderedDict[SessionRef, SessionPages] = OrderedDict()
        self._prefetched: dict[SessionRef, _Prefetched] = {}
        self._awaited: dict[PageKey, SessionRef] = {}  # those pages, until their session settles
        self.is_draining = False
        # Counts per HOLD_OUTCOMES (engine thread writes; the keys never change, so a scrape may
        # read them from another thread).
        self.outcomes: dict[str, int] = dict.fromkeys(HOLD_OUTCOMES, 0)
        # Brought back up by ``retake``, and of those, pages a prefetch had brought up before
        # (they went down unused: prefetched bytes wasted once).
        self.retaken_pages = self.retaken_waste_pages = 0
        self.session_prefetched_pages = self.session_prefetch_wasted_pages = 0
        # Pages session holds keep in HBM as of the last ``count_held_pages``.
        self.num_held_pages = 0

    # ---- views (any thread) ----------------------------------------------------------
    @property
    def cap_pages(self) -> float:
        """HBM pages session holds may keep together (``WorkerConfig.session_hold_fraction``)."""
        fraction = MAX_HELD_FRACTION if self._hold_fraction is None else self._hold_fraction
        return fraction * self._engine.pool.num_pages

    def _held_pin(self, session: SessionId, digest: NamespaceDigest | None) -> _Pin | None:
        """The hold of ``session`` in namespace ``digest`` (None: in whichever holds one)."""
        if digest is not None:
            return self._pins.get(hold_id(SessionRef(digest, session)))
        return next((pin for pin_id, pin in list(self._pins.items())
                     if pin_id.startswith(HOLD_PREFIX) and hold_ref(pin_id).session_id == session), None)

    def is_held(self, session: SessionId, digest: NamespaceDigest | None = None) -> bool:
        """Whether ``session`` (in namespace ``digest``; None: in any) has a hold."""
        return self._held_pin(session, digest) is not None

    def is_lapsed(self, session: SessionId, digest: NamespaceDigest | None = None) -> bool:
        return any(ref.session_id == session and digest in (None, ref.digest) for ref in list(self._lapsed))

    def view(self, session: SessionId, digest: NamespaceDigest | None = None) -> HoldView | None:
        """The session's hold as of now; None when it holds nothing."""
        pin = self._held_pin(session, digest)
        if pin is None:
            return None
        return HoldView(pin.expires_at_ms, pin.expected, pin.rank(_now_ms()), pin.num_moved)

    def snapshot(self) -> HoldsSnapshot:
        pin_ids = frozenset(dict(self._pins))
        return HoldsSnapshot(
            pin_ids=pin_ids,
            held=frozenset(hold_ref(p).session_id for p in pin_ids if p.startswith(HOLD_PREFIX)),
            lapsed=frozenset(ref.session_id for ref in dict(self._lapsed)),
            num_sessions_prefetched=len(self._prefetched),
            num_awaited_pages=len(self._awaited),
        )

    # ---- engine thread ---------------------------------------------------------------
    def has_pins(self) -> bool:
        return bool(self._pins)

    def has_lapsed(self) -> bool:
        return bool(self._lapsed)

    def count_held_pages(self) -> int:
        """Pages session holds keep in HBM (their chains, shared ones once); kept as ``num_held_pages``."""
        self.num_held_pages = num_held(self._chains()) if self._pins else 0
        return self.num_held_pages

    def session_pages(self, session: SessionId, digest: NamespaceDigest) -> SessionPages | None:
        return self._sessions.get(SessionRef(digest, session))

    def session_chain(self, digest: NamespaceDigest, session: SessionId) -> list[RadixNode]:
        """The longest cached prefix of the session's last generation's pages (root first)."""
        pages = self._sessions.get(SessionRef(digest, session))
        if pages is None:
            raise NotFound(f"this worker finished no generation for session {session!r} in that namespace",
                           field="session_id")
        return self._engine.cached_chain(pages.page_keys)

    def arrived(self, digest: NamespaceDigest, session: SessionId) -> None:
        """The session's next request arrived: its own admission brings its pages up (nothing to
        retake), and the pages brought up for it are settled."""
        ref = SessionRef(digest, session)
        self._lapsed.pop(ref, None)
        self.settle(ref, "arrived")

    def remember(self, session: SessionId, digest: NamespaceDigest, prompt: list[int], output: list[int]) -> None:
        """The session's generation finished: release its hold (its pages cache as usual) and keep
        the pages it left cached."""
        ref = SessionRef(digest, session)
        self._lapsed.pop(ref, None)
        self.release(hold_id(ref))
        fed = [*prompt, *output[:-1]]  # the last sampled token is never fed back: no K/V
        keys = tuple(page_keys(digest, fed, self._engine.pool.page_size))
        self.settle(ref, "finished")
        self._sessions[ref] = SessionPages(digest, keys)
        self._sessions.move_to_end(ref)
        while len(self._sessions) > MAX_SESSIONS:
            forgotten, _ = self._sessions.popitem(last=False)
            self.settle(forgotten, "gone")

    def has_session(self, session: SessionId, digest: NamespaceDigest) -> bool:
        return SessionRef(digest, session) in self._sessions

    # ---- admin pins ------------------------------------------------------------------
    def pin(self, command: PinCommand, digest_of: Mapping[PageKey, NamespaceDigest], *, is_stale: bool) -> PageCounts:
        """Pin ``command``'s pages that are cached in its namespace (``digest_of``) in its tier or
        faster; none when the namespace is stale (invalidated: nothing may keep its pages). A pin
        sent again (a fetch brought its pages here) also pins the pages cached since."""
        if is_stale:
            return PageCounts(num_done=0, num_kept=len(command.page_keys))
        existing = self._pins.get(command.pin_id)
        index = self._engine.index
        nodes: list[RadixNode] = existing.nodes if existing is not None else []
        pinned = {n.key for n in nodes}
        for key in command.page_keys:
            node = index.get(key)
            if (node is None or key in pinned or digest_of.get(key) != command.namespace_digest
                    or node.tier > command.tier):
                continue
            # A page on its way to a slower tier is pinned too: its demotion, once it lands,
            # leaves a pinned page where it was (``Demotions.apply``).
            index.pin(key)
            nodes.append(node)
        if existing is None:
            self._pins[command.pin_id] = _Pin(command.namespace_digest, nodes, command.expires_at_ms)
        return PageCounts(num_done=len(nodes), num_kept=len(command.page_keys) - len(nodes))

    def release(self, pin_id: PinId) -> int:
        """Release a pin (admin or hold); the number of pages released (0: unknown or gone)."""
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return 0
        index = self._engine.index
        released = 0
        for node in pin.nodes:
            if index.get(node.key) is node and node.pins > 0:  # gone with a failed checksum: nothing to release
                index.unpin(node.key)
                released += 1
        return released

    def expire(self) -> None:
        """Release the pins whose time has passed."""
        now_ms = _now_ms()
        for pin_id in [p for p, pin in self._pins.items()
                       if pin.expires_at_ms is not None and pin.expires_at_ms <= now_ms]:
            released = self.release(pin_id)
            log.info("pin expired", extra={"pin_id": pin_id, "num_released": released})

    def wait_s(self) -> float | None:
        """Seconds until the next pin lapses (None: no timed pin), so the idle thread wakes for it."""
        deadlines = [p.expires_at_ms for p in self._pins.values() if p.expires_at_ms is not None]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) / 1000.0 - time.time())

    def release_namespaces(self, stale: set[NamespaceDigest]) -> None:
        """Release every pin and forget every lapsed hold of the ``stale`` namespaces: a stale
        page is worth nothing, nothing may keep it."""
        for pin_id in [p for p, pin in self._pins.items() if pin.digest in stale]:
            self.release(pin_id)
        for session in [s for s, pin in self._lapsed.items() if pin.digest in stale]:
            del self._lapsed[session]

    def release_for_drain(self) -> int:
        """Release every session hold and forget the lapsed ones; the holds released."""
        holds = [pin_id for pin_id, _ in self._holds()]
        for pin_id in holds:
            self.release(pin_id)
        self._lapsed.clear()
        if holds:
            log.info("session holds released for a drain", extra={"num_holds": len(holds)})
        return len(holds)

    # ---- session holds ---------------------------------------------------------------
    def take(
        self, digest: NamespaceDigest, session: SessionId, chain: list[RadixNode], hold_s: float,
        *, num_moved: int = 0, expected: ExpectedReturn | None = None,
    ) -> None:
        """Keep a prefetched session's pages in HBM until it is back (at most ``hold_s``;
        ``expected``: when it is expected back, which ranks the hold). Within the cap, holds of
        sessions due back later are displaced until it fits, or it is refused
        (``kvtier.policy.holds.plan_displacement``). A guard's hold (``num_moved`` 0: its pages
        never left) ranks like a prefetch's: a page that leaves HBM goes back onto its copy
        below without a write (decision 0012)."""
        ref = SessionRef(digest, session)
        self.release(hold_id(ref))
        if self.is_draining:  # a prefetch sent before the drain landed after it
            self.outcomes["unheld"] += 1
            log.info("session not held: the worker is draining", extra={"session_id": session})
            return
        index = self._engine.index
        # The deepest page in HBM, on its way down or not: the pin recalls a demotion in flight
        # (a watermark demotion that took the session's idle pages just before its Pause).
        held = next((n for n in reversed(chain) if index.get(n.key) is n and n.tier is Tier.HBM), None)
        if held is None:
            self.outcomes["unheld"] += 1
            log.info("session not held: none of its pages is in HBM", extra={"session_id": session})
            return
        now_ms = _now_ms()
        pin = _Pin(digest, [held], round(now_ms + hold_s * 1000.0), expected=expected, num_moved=num_moved)
        # One rank per hold for this decision: an overdue hold's rank moves with the clock.
        holds = {pin_id: (h.rank(now_ms), _chain_keys(h.nodes[0])) for pin_id, h in self._holds()}
        plan = plan_displacement(pin.rank(now_ms), _chain_keys(held), holds, self.cap_pages)
        if not plan.is_taken:
            self.outcomes["refused"] += 1
            self._lapsed[ref] = pin
            log.info("session not held: holds are at their cap", extra={
                "session_id": session, "num_pages": held.depth, "num_held": num_held(c for _, c in holds.values()),
                "num_moved": num_moved})
            return
        for pin_id in plan.displaced:
            self._lapse(PinId(str(pin_id)))
            log.info("session hold displaced", extra={
                "session_id": hold_ref(PinId(str(pin_id))).session_id, "by_session_id": session})
        self.outcomes["displaced"] += len(plan.displaced)
        self.outcomes["taken"] += 1
        self._lapsed.pop(ref, None)  # held anew: nothing to retake
        index.pin(held.key)
        self._pins[hold_id(ref)] = pin
        log.info("session held", extra={"session_id": session, "num_pages": held.depth,
                                        "num_held": num_held(self._chains()),
                                        "hold_ms": round(hold_s * 1000.0), "num_moved": num_moved})

    def yield_weakest(self, weaker_than_ms: float | None = None, *, sparing: SessionRef | None = None) -> bool:
        """Release the weakest session hold (only one ranked after ``weaker_than_ms`` when given,
        and never ``sparing``'s); False when none may yield. A hold is a prediction; room asked
        for now (a waiting request, a preemption) is certain."""
        now_ms = _now_ms()
        ranks = {pin_id: pin.rank(now_ms) for pin_id, pin in self._holds()}
        pin_id = weakest_hold(ranks, weaker_than_ms=weaker_than_ms,
                              sparing=None if sparing is None else hold_id(sparing))
        if pin_id is None:
            return False
        self._lapse(pin_id)
        self.outcomes["yielded"] += 1
        log.info("session hold yielded", extra={"session_id": hold_ref(pin_id).session_id})
        return True

    def is_due_soon(self, before_ms: float, *, excluding: set[SessionRef]) -> bool:
        """Whether a hold ranks at or before ``before_ms`` for a session other than ``excluding``
        (sessions whose own request waits for room: it would wait for itself)."""
        now_ms = _now_ms()
        own = {hold_id(s) for s in excluding}
        return is_due_soon((pin.rank(now_ms) for pin_id, pin in self._holds() if pin_id not in own), before_ms)

    def drop_session(self, digest: NamespaceDigest, session: SessionId, *, drop: bool = True) -> DropOutcome:
        """Forget the session and release its hold; with ``drop``, also remove its private pages,
        deepest first (a shared prefix stays cached). Without, they stay as ordinary cache entries."""
        ref = SessionRef(digest, session)
        self._lapsed.pop(ref, None)
        self.release(hold_id(ref))
        chain = self.session_chain(digest, session)
        # A prefetch in flight owns its pages (moving: kept); cancelled and applied now, what
        # it brought up is held again, and is released below with the rest.
        tiers = self._engine.tiers
        if tiers is not None and tiers.cancel_prefetches(chain):
            self.release(hold_id(ref))
            chain = self.session_chain(digest, session)
        num_missing = len(self._sessions[ref].page_keys) - len(chain)
        index = self._engine.index
        num_dropped = 0
        if not drop:  # ordinary cache entries now, the first to go under pressure
            index.mark_expendable(_private_suffix(chain))
        for node in reversed(chain if drop else ()):
            # Stop at a shared page (another sequence's pages hang below) or a held one.
            if not node.is_leaf or not index.is_evictable(node):
                break
            index.remove(node.key)
            num_dropped += 1
        del self._sessions[ref]
        self.settle(ref, "gone")
        return DropOutcome(num_dropped=num_dropped, num_kept=len(chain) - num_dropped, num_missing=num_missing)

    def retake(self) -> None:
        """Hold again the sessions whose holds went before they were back, the one due back first
        first, bringing their pages back up if they left, while HBM has free room.

        Bounded on every side, so it cannot thrash: the caller runs it only while nothing waits
        for room or admission; it uses free pages only, and leaves the HBM watermark's low mark
        free (``kvtier.policy.holds.can_retake``); it stays within the cap; and it stops at the
        time the hold would have lapsed (the session is overdue then: no longer a prediction).
        The pages it moves are counted (``retaken_pages``), and apart those a prefetch had
        brought up before (``retaken_waste_pages``): the controller, which sees the pages in HBM
        at the session's next Route, cannot tell that they went down unused in between."""
        tiers = self._engine.tiers
        if tiers is None:  # no tier to bring pages back from (holds need one: none can be here)
            self._lapsed.clear()
            return
        pool = self._engine.pool
        reserve = (1.0 - tiers.config.hbm_watermark.low) * pool.num_pages
        if pool.num_free < reserve:
            return  # the common case while HBM is crowded: nothing to look at
        held: set[PageKey] = set().union(*self._chains())
        now_ms = _now_ms()
        for session in retake_order({s: pin.rank(now_ms) for s, pin in self._lapsed.items()}):
            pin = self._lapsed[session]
            pages = self._sessions.get(session)
            if pages is None or pages.namespace_digest != pin.digest or (pin.expires_at_ms or 0) <= now_ms:
                del self._lapsed[session]
                continue
            chain = self._engine.cached_chain(pages.page_keys)
            if any(n.moving and n.tier is not Tier.HBM for n in chain):
                continue  # on a move between lower tiers or up already: looked at again once it lands
            if chain and not fits_cap(_chain_keys(chain[-1]), [frozenset(held)], self.cap_pages):
                continue  # a smaller one may fit
            if not can_retake(pool.num_free, sum(n.tier is not Tier.HBM for n in chain), reserve):
                return  # no later session takes the room before this one
            del self._lapsed[session]
            held.update(n.key for n in chain)  # its hold comes once the pages land
            ticket = tiers.start_prefetch(chain)
            self.outcomes["retaken"] += 1
            log.info("session hold retaken", extra={"session_id": session.session_id, "num_pages": len(chain)})
            if ticket.is_done:
                self._hold_retaken(session, pages, pin, ticket)
            else:
                ticket.on_done = functools.partial(self._hold_retaken, session, pages, pin, ticket)

    def _hold_retaken(
        self, session: SessionRef, pages: SessionPages, pin: _Pin, ticket: MoveTicket, _: MoveOutcome | None = None
    ) -> None:
        outcome = ticket.outcome
        self.retaken_pages += outcome.num_moved
        self.retaken_waste_pages += min(outcome.num_moved, pin.num_moved)
        if self._sessions.get(session) is pages:
            self.note_prefetched(session, ticket.promoted)
        hold_s = ((pin.expires_at_ms or 0) - _now_ms()) / 1000.0
        # Not once its next generation has finished or the session ended meanwhile, nor over a
        # newer hold (a prefetch the controller sent meanwhile). Pages up for the session and not
        # yet counted as wasted: those just moved, and those of the last prefetch that never went down.
        if self._sessions.get(session) is pages and hold_s > 0 and hold_id(session) not in self._pins:
            self.take(pin.digest, session.session_id, self._engine.cached_chain(pages.page_keys), hold_s,
                      num_moved=max(outcome.num_moved, pin.num_moved), expected=pin.expected)

    # ---- pages brought up for sessions ----------------------------------------------
    def note_prefetched(self, session: SessionRef, promoted: list[PageKey]) -> None:
        """Count the pages a move up for ``session`` promoted (``MoveTicket.promoted``) as
        brought up for it."""
        if promoted:
            tally = self._prefetched.setdefault(session, _Prefetched())
            tally.keys.update(promoted)
            tally.num_moved += len(promoted)
            self._awaited.update(dict.fromkeys(promoted, session))

    def spared(self, rank: float | None) -> frozenset[PageKey]:
        """Pages brought up for a session due back no later than hold rank ``rank`` (lower is
        sooner) and not used yet: a prefetch for a session of that rank must not take their room
        (``TierManager.start_prefetch(spared=...)``). A session's rank is its hold's, held or
        lapsed; +inf without one (a prefetch that held nothing, or a hold past its end). None:
        spares nothing."""
        if rank is None:
            return frozenset()
        now_ms = _now_ms()
        ranks: dict[SessionRef, float] = {}
        for session in set(self._awaited.values()):
            pin = self._pins.get(hold_id(session)) or self._lapsed.get(session)
            ranks[session] = float("inf") if pin is None else pin.rank(now_ms)
        return frozenset(key for key, session in self._awaited.items() if ranks[session] <= rank)

    def settle(self, session: SessionRef, why: Literal["arrived", "finished", "gone"] = "arrived") -> None:
        """Count the page moves that brought pages up for ``session`` since its last generation,
        and those wasted, as of ``why``:

        arrived   its next request: a page in HBM now is used, once; every other move (pages
                  below HBM again or gone, or brought up more than once) was wasted
        finished  its generation: pages that landed after its request arrived (a late
                  prefetch, which the request waited for): none wasted
        gone      the session ended, or was forgotten: all wasted
        """
        tally = self._prefetched.pop(session, None)
        if tally is None:
            return
        for key in tally.keys:
            if self._awaited.get(key) == session:
                del self._awaited[key]
        self.session_prefetched_pages += tally.num_moved
        if why == "arrived":
            index = self._engine.index
            used = sum((node := index.get(k)) is not None and node.tier is Tier.HBM for k in tally.keys)
            self.session_prefetch_wasted_pages += tally.num_moved - used
        elif why == "gone":
            self.session_prefetch_wasted_pages += tally.num_moved

    # ---- internals -------------------------------------------------------------------
    def _holds(self) -> Iterator[tuple[PinId, _Pin]]:
        """The session holds that pin a page (admin pins aside)."""
        return ((pin_id, pin) for pin_id, pin in self._pins.items() if pin_id.startswith(HOLD_PREFIX) and pin.nodes)

    def _chains(self) -> list[frozenset[PageKey]]:
        return [_chain_keys(pin.nodes[0]) for _, pin in self._holds()]

    def _lapse(self, pin_id: PinId) -> None:
        """Release a session hold before its session is back, remembering it for ``retake``."""
        pin = self._pins.get(pin_id)
        if pin is not None:
            self._lapsed[hold_ref(pin_id)] = pin
            self.release(pin_id)


def require_tiers(engine: Engine) -> TierManager:
    """The engine's tier manager; a worker without a lower tier cannot demote or prefetch."""
    if engine.tiers is None:
        raise FailedPrecondition("this worker has no DRAM or NVMe tier; configure one to demote or prefetch")
    return engine.tiers


def _private_suffix(chain: list[RadixNode]) -> list[RadixNode]:
    """The pages of a session's chain below its deepest branch point: a page with a child
    outside the chain is a prefix other sequences cached too, and so is every page above it."""
    on_chain = {node.key for node in chain}
    start = 0
    for i, node in enumerate(chain):
        if any(key not in on_chain for key in node.children):
            start = i + 1
    return chain[start:]
