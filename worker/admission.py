"""Requests that wait outside the engine for their room and their pages before admission.

A request whose cached prefix lies partly below HBM, or whose admission would find too few
free HBM pages, waits here while room is made in the background (``Room.make``: a demotion of
the coldest idle pages, the request's own pinned meanwhile) and its pages come up
(``TierManager.start_prefetch``, or the controller's prefetch already bringing them). It is
handed to the engine once both are done (at most ``MAX_ADMISSION_WAIT_S``; after that, or when
nothing can leave HBM, the engine makes room and promotes on admission). The engine thread
never waits on those copies, so running sequences keep decoding and other requests keep being
admitted: a transfer on the request path costs its own request, not every request behind it.
With an emulated GPU link (decision 0011) a 13 MiB NVMe promotion takes ~200 ms and a spill
~16 ms a page; on the engine thread they would stall every resume behind them.

One request's room-making or promotion runs at a time, in arrival order: concurrent ones would
share the link and all finish late. Its pages are reported as promoted tokens (and its wait as
promotion wait), as a promotion on admission would be.

When the coldest idle pages cannot make the room, session holds yield it, the weakest first,
except a hold whose session is due back within ``HOLD_DUE_SOON_S``: the request waits for that
session's turn to come and go (at most ``HOLD_DEFER_S``), since its whole context would
otherwise come back up on the request path. A request counts the pages promised to the
requests the engine has yet to admit (``Room.backlog_pages``). These waits are fixed in
seconds; ``wait_scale`` (``WorkerConfig.wait_scale``) multiplies them all, for an engine whose
turns take that much longer than the ones they were tuned on. A request never takes its room
from its own session's hold.

A request whose Route planned a peer fetch waits here too while the peer's pages arrive
(``wait_for_fetch``), also on an engine without tiers; the fetch runs on the asyncio side and
installs each page group as it is verified, and once it ends the request waits as any other.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvtier.cache.radix import RadixNode
from kvtier.domain.errors import InvalidArgument
from kvtier.domain.hashing import NamespaceDigest, PageKey, page_keys
from kvtier.domain.records import GenerateRequest
from kvtier.domain.tiers import Tier
from kvtier.engine.engine import Engine
from kvtier.policy.holds import DeferralOutcome, deferral_outcome
from kvtier.runtime.config import MAX_WAIT_SCALE
from kvtier.tiers.moves import MoveOutcome, MoveTicket
from kvtier.worker.holds import Holds, is_in_range, require_tiers
from kvtier.worker.room import Room
from kvtier.worker.session_ref import SessionRef

R = TypeVar("R")

# A request waiting outside the engine for its pages is added anyway after this long; what is
# still below is then promoted on admission.
MAX_ADMISSION_WAIT_S = 5.0
# A request waiting for room does not take it from a session hold due back within
# HOLD_DUE_SOON_S: it waits (at most HOLD_DEFER_S) for that session's turn to come and go.
HOLD_DUE_SOON_S = 1.0
HOLD_DEFER_S = 2.0
# How such a wait ended (``deferrals``; the ``outcome`` of the ``kvtier.hold_deferral_wait``
# metric): the room came without displacing those holds (``room``), or HOLD_DEFER_S ran out
# and a hold yielded (``timed_out``).
HOLD_DEFERRAL_OUTCOMES: tuple[DeferralOutcome, ...] = ("room", "timed_out")


@dataclass(frozen=True, slots=True)
class Admitted(Generic[R]):
    """A request ready for the engine, and what its wait outside cost it."""

    run: R
    promoted_tokens_by_tier: dict[Tier, int]  # brought up before admission
    promotion_wait_s: float  # waited for them
    admission_wait_s: float  # waited outside the engine, for pages or room
    hold_wait_s: float  # of admission_wait_s, waited for holds due back soon


@dataclass(slots=True, eq=False)
class _Waiting(Generic[R]):
    run: R
    request: GenerateRequest
    digest: NamespaceDigest
    page_keys: list[PageKey]
    waiting_since: float
    promotion: MoveTicket | None = None  # our own prefetch for it
    below_hbm: dict[PageKey, Tier] = field(default_factory=dict)  # its pages' tier when seen below
    deferred_at: float | None = None  # began waiting for holds due back soon
    hold_wait_s: float = 0.0
    is_fetching: bool = False  # its pages are on their way from a peer (``wait_for_fetch``)


class Admission(Generic[R]):
    """Requests waiting for room or pages, by run id; the pins that keep a waiting (or just
    admitted, not yet stepped) request's pages in HBM."""

    def __init__(self, engine: Engine, holds: Holds, room: Room, *, wait_scale: float = 1.0) -> None:
        if not is_in_range(wait_scale, MAX_WAIT_SCALE):
            raise InvalidArgument(
                f"wait_scale must be in (0, {MAX_WAIT_SCALE:g}], got {wait_scale!r}", field="wait_scale"
            )
        self._engine = engine
        self._holds = holds
        self._room = room
        self.wait_scale = float(wait_scale)  # multiplies the waits below (WorkerConfig.wait_scale)
        self._waiting: dict[str, _Waiting[R]] = {}
        self._pinned: dict[str, RadixNode] = {}  # run id -> its deepest HBM page, pinned
        # Requests that waited for holds due back soon, by HOLD_DEFERRAL_OUTCOMES, their waits in
        # all, and each wait as it ended, until the caller takes them (``take_deferrals``).
        self.deferrals: dict[str, int] = dict.fromkeys(HOLD_DEFERRAL_OUTCOMES, 0)
        self.deferral_wait_s = 0.0
        self._ended: list[tuple[float, DeferralOutcome]] = []

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def runs(self) -> list[R]:
        return [w.run for w in self._waiting.values()]

    def digests(self) -> set[NamespaceDigest]:
        """Namespaces of the waiting requests."""
        return {w.digest for w in self._waiting.values()}

    def take_deferrals(self) -> list[tuple[float, DeferralOutcome]]:
        """Waits for holds due back soon that ended since the last call: (seconds, outcome)."""
        ended, self._ended = self._ended, []
        return ended

    def offer(self, run_id: str, run: R, request: GenerateRequest, digest: NamespaceDigest) -> bool:
        """Whether the request waits here (its pages lie partly below HBM, or its room is short);
        False: hand it to the engine now."""
        keys = page_keys(digest, request.prompt_token_ids, self._engine.pool.page_size)
        chain = self._engine.cached_chain(keys)
        if all(n.tier is Tier.HBM for n in chain) and self._short(request, chain) <= 0:
            return False
        self._waiting[run_id] = _Waiting(run, request, digest, keys, time.monotonic())
        return True

    def wait_for_fetch(self, run_id: str, run: R, request: GenerateRequest, digest: NamespaceDigest) -> None:
        """The request waits here while a peer's pages of its prompt arrive (``kvtier.worker.peer_fetch``:
        pulled and verified off the engine thread, installed a group at a time); after
        ``fetched`` it waits as any other request does, for its room and for pages below HBM."""
        keys = page_keys(digest, request.prompt_token_ids, self._engine.pool.page_size)
        self._waiting[run_id] = _Waiting(run, request, digest, keys, time.monotonic(), is_fetching=True)

    def fetched(self, run_id: str) -> None:
        """The request's peer fetch ended, whatever it brought (the rest is recomputed)."""
        wait = self._waiting.get(run_id)
        if wait is not None:
            wait.is_fetching = False

    def cancel(self, run_id: str) -> bool:
        """Forget a waiting request (False: it was not waiting) and release its pin."""
        self.release(run_id)
        return self._waiting.pop(run_id, None) is not None

    def release(self, run_id: str) -> None:
        """Release the pin on the request's pages (the engine has taken them, or it ended)."""
        node = self._pinned.pop(run_id, None)
        if node is not None and self._engine.index.get(node.key) is node:
            self._engine.index.unpin(node.key)

    def release_queued(self) -> int:
        """Release the pins of requests handed to the engine and not yet stepped; how many.

        Those pins keep a queued request's pages in HBM until its first step. When nothing runs
        and the engine still cannot admit the queue's head, the other queued requests' pins are
        what hold the room it needs: their pages stay cached but may leave HBM, and a request
        whose pages left promotes or recomputes them on admission."""
        queued = [run_id for run_id in self._pinned if run_id not in self._waiting]
        for run_id in queued:
            self.release(run_id)
        return len(queued)

    def ready(self) -> Iterator[Admitted[R]]:
        """Each waiting request that has its room and its pages in HBM, in arrival order; for the
        first that lacks either, start a background demotion or bring its pages up (once). The
        caller adds each to the engine before the next is considered (the next one's room counts
        the pages the engine's queue will allocate)."""
        now = time.monotonic()
        scale = self.wait_scale
        if self._engine.tiers is None or self._engine.tiers.config.simulate:
            yield from self._fetched(now)  # no tiers to promote from or make room in: fetches only
            return
        tiers = require_tiers(self._engine)
        # One request's room-making or promotion at a time, in arrival order: concurrent ones
        # share the link and all finish late; one after the other, the first waits only for its own.
        is_promoting = any(w.promotion is not None and not w.promotion.is_done for w in self._waiting.values())
        has_lower = self._room.lower_tier() is not None
        for run_id, wait in list(self._waiting.items()):
            is_waiting = now - wait.waiting_since < MAX_ADMISSION_WAIT_S * scale
            if wait.is_fetching and is_waiting:
                continue
            chain = self._engine.cached_chain(wait.page_keys)
            below = [n for n in chain if n.tier is not Tier.HBM]
            for node in below:
                wait.below_hbm.setdefault(node.key, node.tier)
            if is_waiting and wait.promotion is None and has_lower:
                # Make room first, in the background: a spill on allocation waits on the link
                # with the engine thread. One request at a time, as promotions.
                short = self._short(wait.request, chain)
                if short <= 0:
                    self._end_deferral(wait, now)
                else:
                    if is_promoting:
                        continue
                    # A hold due back within HOLD_DUE_SOON_S keeps its pages while this request
                    # can still wait for them (HOLD_DEFER_S): displaced, its session's next turn
                    # would promote its whole context, on the link this request's room shares.
                    deferring = now - wait.waiting_since < HOLD_DEFER_S * scale
                    spared = time.time() * 1000.0 + HOLD_DUE_SOON_S * scale * 1000.0 if deferring else None
                    # Its own pages are not the room it makes: pinned before anything is demoted.
                    quotas = self._engine.quotas
                    # On the request's tenant's behalf: other tenants' reserved pages stay.
                    acting = (quotas.acting_for(wait.digest, len(wait.page_keys)) if quotas is not None
                              else contextlib.nullcontext())
                    with acting:
                        made = self._room.make(short, protect=functools.partial(self._pin_chain, run_id, chain),
                                               weaker_than=spared, sparing=self._session_of(wait))
                    if not made and spared is not None and self._holds.is_due_soon(
                            spared, excluding=self._waiting_sessions()):
                        if wait.deferred_at is None:
                            wait.deferred_at = now
                        continue  # only holds due back soon are left: wait for their turns
                    self._end_deferral(wait, now)
                    if made and self._short(wait.request, chain) > 0:
                        is_promoting = True
                        continue  # pages on their way down: admitted once they have left
                    # The room is there now (yielded holds' pages are clean: free to take at no
                    # copy), or nothing can leave HBM: admit in this pass, not after a step.
            if below and is_waiting:
                if any(n.moving for n in below):
                    continue  # on their way up (the controller's prefetch, or ours): wait
                if wait.promotion is None:
                    if is_promoting:
                        continue
                    wait.promotion = tiers.start_prefetch(chain, for_request=True)
                    if not wait.promotion.is_done:
                        wait.promotion.on_done = functools.partial(self._promotion_landed, run_id)
                        is_promoting = True
                        continue
                    # Done at once: nothing could move (no room in HBM); promote on admission.
                elif not wait.promotion.is_done:
                    continue
            del self._waiting[run_id]
            # Its pages stay pinned until the engine has taken them (its first step): room made
            # for the next request in this pass must not take the pages just brought up for it.
            self.release(run_id)
            self._pin_chain(run_id, chain)
            promoted: dict[Tier, int] = {}
            for node in chain:
                tier = wait.below_hbm.get(node.key)
                if tier is not None and node.tier is Tier.HBM:
                    promoted[tier] = promoted.get(tier, 0) + self._engine.pool.page_size
            self._end_deferral(wait, now)
            admission_wait_s = now - wait.waiting_since
            yield Admitted(wait.run, promoted, admission_wait_s if promoted else 0.0, admission_wait_s,
                           wait.hold_wait_s)

    def _fetched(self, now: float) -> Iterator[Admitted[R]]:
        """``ready`` on an engine without tiers: the requests whose peer fetch ended (or that
        waited for it ``MAX_ADMISSION_WAIT_S``)."""
        for run_id, wait in list(self._waiting.items()):
            waited_s = now - wait.waiting_since
            if wait.is_fetching and waited_s < MAX_ADMISSION_WAIT_S * self.wait_scale:
                continue
            del self._waiting[run_id]
            yield Admitted(wait.run, {}, 0.0, waited_s, 0.0)

    def _short(self, request: GenerateRequest, chain: list[RadixNode]) -> int:
        """HBM pages the request's admission would free by spilling: the pages it takes
        (promoted, new, copy-on-write, its output's reservation; ``Room.short_for``)."""
        return self._room.short_for(len(request.prompt_token_ids), request.sampling.max_tokens, chain)

    def _waiting_sessions(self) -> set[SessionRef]:
        return {ref for w in self._waiting.values() if (ref := self._session_of(w)) is not None}

    @staticmethod
    def _session_of(wait: _Waiting[R]) -> SessionRef | None:
        session = wait.request.session_id
        return SessionRef(wait.digest, session) if session else None

    def _pin_chain(self, run_id: str, chain: list[RadixNode]) -> None:
        """Pin the deepest of the request's pages in HBM (the chain above it stays) while it waits."""
        # A page on its way down stays for the pin (``TierManager.start_prefetch``: recalled).
        deepest = next((n for n in reversed(chain) if n.tier is Tier.HBM), None)
        if run_id not in self._pinned and deepest is not None:
            self._engine.index.pin(deepest.key)
            self._pinned[run_id] = deepest

    def _promotion_landed(self, run_id: str, _outcome: MoveOutcome) -> None:
        """Pages brought up for a waiting request are pinned as they land (from the transfer's
        application, before the step's watermark demotion can take them back down) until the
        engine has taken them."""
        wait = self._waiting.get(run_id)
        if wait is not None:
            self.release(run_id)
            self._pin_chain(run_id, self._engine.cached_chain(wait.page_keys))

    def _end_deferral(self, wait: _Waiting[R], now: float) -> None:
        """The request no longer waits for holds due back soon (if it did): count how the wait
        ended and how long it took."""
        if wait.deferred_at is None:
            return
        waited, wait.deferred_at = now - wait.deferred_at, None
        wait.hold_wait_s += waited  # a request may wait for such holds more than once
        outcome = deferral_outcome(now - wait.waiting_since, HOLD_DEFER_S * self.wait_scale)
        self.deferrals[outcome] += 1
        self.deferral_wait_s += waited
        self._ended.append((waited, outcome))
