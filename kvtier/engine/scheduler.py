"""Continuous batching over one page pool: admission, decode slots, preemption.

Each ``schedule()`` returns one batch: newly admitted prefills when any fit, otherwise
one decode token for every running sequence. Admission reserves pages for the prompt
plus an output reservation; reservations are revised as a sequence grows (a new chunk
is reserved when the old one is used up and pages are available). When a running
sequence needs a page and none can be freed by eviction (nor comes back from idle pages
already on their way down to a lower tier, which it waits for), the lowest-priority, newest
sequence is preempted: its pages are released (full pages stay cached in the radix
index) and it waits at the head of the queue, keeping its tokens and RNG state, to
resume by recompute — mostly prefix-cache hits.

    pool pages:  [ free | cached idle (evictable, leaves first) | in use ]
    available for admission = free + evictable idle − Σ reservations of running seqs

The pages an admission takes, and whether they fit, are ``kvtier.policy.admission``'s: the
scheduler's room is every page it may take at all (free, or idle: evicted or spilled on the
way), less the reservations of running sequences and less the idle pages the request hits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.cache.page_pool import PageId, PagePool
from kvtier.cache.quotas import QuotaTracker
from kvtier.cache.radix import RadixIndex
from kvtier.domain.errors import IntegrityError, ResourceExhausted
from kvtier.domain.tiers import Tier
from kvtier.engine.sequence import Sequence, SequenceStatus
from kvtier.policy.admission import AdmissionPages, admission_pages, reserved_pages, shortfall
from kvtier.tiers.manager import TierManager

# Releases one pin that may yield under pressure; False when none may.
ReleasePin = Callable[[], bool]


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    output_reservation_tokens: int = 64


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences that outgrew the whole pool: they can never get another page, so the
    # engine finishes them (LENGTH) instead of preempting them into a wait that never ends.
    capped: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        index: RadixIndex,
        config: SchedulerConfig | None = None,
        tiers: TierManager | None = None,
        quotas: QuotaTracker | None = None,
    ) -> None:
        self.pool = pool
        self.index = index
        self.tiers = tiers
        self.quotas = quotas
        self.config = config or SchedulerConfig()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_admission_waits = 0  # requests that found no room when first considered

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- admission ------------------------------------------------------------------
    def max_prompt_tokens(self) -> int:
        """The longest prompt that can ever be admitted: all pages, one slot kept to decode."""
        return self.pool.num_pages * self.page_size - 1

    def add(self, seq: Sequence) -> None:
        limit = self.max_prompt_tokens()
        if seq.num_tokens > limit:
            raise ResourceExhausted(
                f"prompt of {seq.num_tokens} tokens can never fit: the pool holds {self.pool.num_pages} "
                f"pages of {self.page_size} tokens, so at most {limit} prompt tokens",
                field="prompt_token_ids",
            )
        self.waiting.append(seq)

    def _reservation(self, seq: Sequence) -> int:
        return reserved_pages(seq.num_tokens, self.page_size, num_output_left=seq.params.max_tokens - seq.num_output,
                              reservation_tokens=self.config.output_reservation_tokens)

    def admission_pages(
        self, num_tokens: int, num_output_left: int, num_hbm_hits: int, num_lower_hits: int
    ) -> AdmissionPages:
        """The pages admitting a request of ``num_tokens`` tokens (``num_output_left`` still to
        generate) takes, ``num_hbm_hits`` of its cached prefix in HBM and ``num_lower_hits`` below
        (``kvtier.policy.admission``)."""
        return admission_pages(
            num_tokens=num_tokens, page_size=self.page_size, num_hbm_hits=num_hbm_hits,
            num_lower_hits=num_lower_hits if self.tiers is not None else 0, num_output_left=num_output_left,
            reservation_tokens=self.config.output_reservation_tokens,
        )

    def _available(self) -> int:
        reserved = sum(s.reserved_pages for s in self.running)
        return self.pool.num_free + self.pool.num_cached_idle - reserved

    def _free_page(self, seq: Sequence, num_pending: int) -> bool:
        """Free one HBM page for ``seq``, which will cache ``num_pending`` new pages: its tenant's
        own page when it would pass its quota, else by the tiers (a clean page, a spill), else
        the index's next victim dropped; when it would pass its quota, other tenants' reserved
        pages are passed over (``QuotaTracker.is_reserved``)."""
        if self.quotas is None or seq.namespace is None:
            return self._free_any_page()
        if self.quotas.free_own_page(seq.namespace, num_pending):
            return True
        with self.quotas.acting_for(seq.namespace, num_pending):
            return self._free_any_page()

    def _free_any_page(self) -> bool:
        if self.tiers is not None:
            return self.tiers.free_hbm_page()
        return self.index.evict(1) == 1

    def _allocate(
        self, seq: Sequence, num_pending: int, release_pin: ReleasePin | None, *, wait_leaving: bool = False
    ) -> PageId | None:
        """A page for ``seq``, which will cache ``num_pending`` new pages (this one included):
        with the pool full, a tenant that would pass its quota gives up its own pages first,
        then ``release_pin`` lets pins go one by one.
        ``wait_leaving`` (a running sequence's next page): when every idle page is on its way
        down, wait for those copies to land rather than preempt."""
        page = self.pool.allocate()
        if page is None and self._free_page(seq, num_pending):
            page = self.pool.allocate()
        while page is None and release_pin is not None and release_pin():
            if self._free_page(seq, num_pending):
                page = self.pool.allocate()
        if page is None and wait_leaving and self.tiers is not None and self.tiers.num_leaving(Tier.HBM) > 0:
            # Every idle page is on its way down (a watermark or room-making demotion): its
            # room comes back when the copy lands, sooner than a preempted sequence recomputes.
            self.tiers.wait_leaving(Tier.HBM)
            page = self.pool.allocate()
            if page is None and self._free_page(seq, num_pending):
                page = self.pool.allocate()
        return page

    def _try_admit(self, seq: Sequence, release_pin: ReleasePin | None) -> bool:
        ps = self.page_size
        keys = seq.full_page_keys()
        match = self.index.match(keys, seq.tokens, count_hit=False)
        hits = match.nodes
        num_hbm = next((i for i, n in enumerate(hits) if n.tier is not Tier.HBM), len(hits))
        lower = hits[num_hbm:] if self.tiers is not None else []
        hits = hits[:num_hbm]
        total_pages = seq.pages_for(seq.num_tokens)
        # Admission counts every page not already in HBM, promoted ones included.
        demand = self.admission_pages(seq.num_tokens, seq.params.max_tokens - seq.num_output, num_hbm, len(lower))
        idle_hits = sum(1 for n in hits if self.pool.ref_count(n.page) == 0)
        if shortfall(demand, self._available() - idle_hits, is_alone=not self.running) > 0:
            return False
        reserve = self._reservation(seq)

        self.index.touch(match.nodes)  # admitted: a real reuse (a waiting request is not one)
        pages: list[PageId] = []
        for node in hits:
            self.pool.acquire(node.page)
            pages.append(node.page)
        if lower:
            assert self.tiers is not None
            wait_start = self.tiers.counters.promotion_wait_s
            source_tiers = [n.tier for n in lower]
            promoted = self.tiers.promote(lower)  # each comes with one reference for us
            pages.extend(n.page for n in promoted)
            hits = hits + promoted
            if seq.num_cached_tokens < 0:
                # Reported like the cached tokens: as of the request's first admission
                # (a resume after preemption promotes again, but that is not a cache hit).
                seq.num_promoted_tokens += len(promoted) * ps
                for tier in source_tiers[: len(promoted)]:
                    seq.promoted_tokens_by_tier[tier] = seq.promoted_tokens_by_tier.get(tier, 0) + ps
            seq.promotion_wait_s += self.tiers.counters.promotion_wait_s - wait_start
        cached_tokens = len(hits) * ps
        num_new = max(seq.num_tokens // ps - len(hits), 0)  # full pages this admission will cache
        # The last prompt position must be computed to get logits; if every page hit,
        # recompute that one token in a private copy of the last page (copy-on-write).
        needs_cow = cached_tokens >= seq.num_tokens
        if needs_cow:
            cached_tokens = seq.num_tokens - 1
        ok = True
        if needs_cow:
            private = self.pool.copy_on_write(pages[-1])
            if private is None and self._free_page(seq, num_new):
                private = self.pool.copy_on_write(pages[-1])
            if private is None:
                ok = False
            else:
                pages[-1] = private
        while ok and len(pages) < total_pages:
            page = self._allocate(seq, num_new, release_pin)
            if page is None:
                ok = False
            else:
                pages.append(page)
        if not ok:  # the evictable estimate was optimistic: undo, wait
            for page in pages:
                self.pool.release(page)
            return False

        seq.pages = pages
        seq.num_computed = cached_tokens
        seq.num_registered = len(hits) - (1 if needs_cow else 0)
        seq.reserved_pages = min(reserve, max(self._available(), 0))
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = cached_tokens
        seq.status = SequenceStatus.RUNNING
        return True

    # ---- scheduling -----------------------------------------------------------------
    def schedule(self, release_pin: ReleasePin | None = None) -> ScheduledBatch | None:
        """The next batch: newly admitted prefills when any fit, otherwise one decode token for
        every running sequence. ``release_pin``: pins that yield under pressure (a worker's
        session holds): with no page free or evictable, it lets one go (True) before a
        sequence is preempted or an admission waits."""
        admitted: list[Sequence] = []
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if admitted and seq.num_tokens > budget:
                break
            if not self._try_admit(seq, release_pin):
                if not seq.has_waited:
                    seq.has_waited = True
                    self.num_admission_waits += 1
                break
            self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq)
            budget -= seq.num_tokens - seq.num_computed
        if admitted:
            return ScheduledBatch(seqs=admitted, is_prefill=True)
        if not self.running:
            return None
        return self._schedule_decode(release_pin)

    def _victim_order(self) -> list[Sequence]:
        # Highest priority first; among equals, oldest first. Victims come from the end.
        return sorted(self.running, key=lambda s: (-s.priority, s.arrival))

    def _schedule_decode(self, release_pin: ReleasePin | None) -> ScheduledBatch:
        order = self._victim_order()
        batch: list[Sequence] = []
        preempted: list[Sequence] = []
        capped: list[Sequence] = []
        while order:
            seq = order.pop(0)
            if len(seq.pages) * self.page_size > seq.num_computed:
                batch.append(seq)
                continue
            if len(seq.pages) >= self.pool.num_pages:
                capped.append(seq)
                continue
            num_pending = len(seq.pages) + 1 - seq.num_registered
            page = self._allocate(seq, num_pending, release_pin, wait_leaving=True)
            while page is None and order:
                victim = order.pop()
                self.preempt(victim)
                preempted.append(victim)
                page = self._allocate(seq, num_pending, release_pin)
            if page is None:
                # Nothing left to preempt but the sequence itself.
                self.preempt(seq)
                preempted.append(seq)
                continue
            seq.pages.append(page)
            if seq.reserved_pages > 0:
                seq.reserved_pages -= 1
            elif self._available() > 0:
                seq.reserved_pages = min(self._reservation(seq), self._available())
            batch.append(seq)
        return ScheduledBatch(seqs=batch, is_prefill=False, preempted=preempted, capped=capped)

    def preempt(self, seq: Sequence) -> None:
        """Release every page; keep tokens and RNG state; wait at the head of the queue."""
        self._release_pages(seq)
        seq.num_computed = 0
        seq.num_registered = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    # ---- completion -----------------------------------------------------------------
    def register_full_pages(self, seq: Sequence) -> None:
        """Offer pages that just became full to the index so later requests can share them."""
        num_full = seq.num_computed // self.page_size
        if seq.num_registered >= num_full:
            return
        keys = seq.full_page_keys()
        for i in range(seq.num_registered, num_full):
            if keys[i] in self.index:
                continue  # cached already (our own hit, or a duplicate computed by another seq)
            parent = keys[i - 1] if i > 0 else None
            if self.index.insert(keys[i], parent, seq.pages[i], seq.page_tokens(i), seq.namespace) is None:
                self._reinsert_chain(seq, i)
        seq.num_registered = num_full

    def _reinsert_chain(self, seq: Sequence, upto: int) -> None:
        # An ancestor we duplicated privately was evicted from the index; our pages hold
        # the same bytes, so re-cache the whole chain from the root down.
        keys = seq.full_page_keys()
        for j in range(upto + 1):
            if keys[j] not in self.index:
                parent = keys[j - 1] if j > 0 else None
                if self.index.insert(keys[j], parent, seq.pages[j], seq.page_tokens(j), seq.namespace) is None:
                    cached_parent = self.index.get(parent) if parent is not None else None
                    if cached_parent is not None and cached_parent.tier is not Tier.HBM:
                        # The index's copy of an ancestor we duplicated privately went down a
                        # tier meanwhile (a demotion of idle pages while we ran on our own
                        # copy). A child may not be faster than its parent, so this page and
                        # the ones after it stay private to the sequence (not cached).
                        return
                    raise IntegrityError(f"cannot cache page {j} of {seq.request_id}: parent missing")

    def finish(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release_pages(seq)
        seq.status = SequenceStatus.FINISHED

    def _release_pages(self, seq: Sequence) -> None:
        pages, seq.pages = seq.pages, []
        seq.reserved_pages = 0
        self.index.note_released(pages)
        for page in pages:
            self.pool.release(page)

    def check_integrity(self) -> None:
        held: dict[PageId, int] = {}
        for seq in self.running:
            if seq.status is not SequenceStatus.RUNNING:
                raise IntegrityError(f"{seq.request_id} is in the running list as {seq.status.value}")
            if len(seq.pages) < seq.pages_for(seq.num_computed):
                raise IntegrityError(f"{seq.request_id} computed {seq.num_computed} tokens in {len(seq.pages)} pages")
            for page in seq.pages:
                held[page] = held.get(page, 0) + 1
        for seq in self.waiting:
            if seq.pages:
                raise IntegrityError(f"waiting {seq.request_id} still holds {len(seq.pages)} pages")
        if self.tiers is not None:
            for page, count in self.tiers.hbm_holds().items():
                held[page] = held.get(page, 0) + count
        for page, count in held.items():
            if self.pool.ref_count(page) != count:
                raise IntegrityError(
                    f"page {page}: sequences hold {count} references, pool counts {self.pool.ref_count(page)}"
                )
        if sum(1 for r in range(self.pool.num_pages) if self.pool.ref_count(PageId(r)) > 0) != len(held):
            raise IntegrityError("a page is referenced by no running sequence or transfer (leak)")
        self.index.check_integrity()
