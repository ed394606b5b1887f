"""Prefetch timing and holding (controller/prefetch.py, decision 0008): the promote-time
estimate learnt from acks, the bookkeeping, and end to end against a real controller and
worker — a prefetched session's pages are held in HBM until it is back (an eviction in
between does not undo the prefetch), the hold goes when the turn finishes or the session
ends, and a session kept in HBM is held there the same way (a guard prefetch at once)."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import pytest
import pytest_asyncio

from kvtier.controller.orchestrator_params import OrchestratorParams
from kvtier.controller.prefetch import Outcome, PauseOutcome, PrefetchStats, PromoteLatency
from kvtier.controller.session_tenancy import SessionKey
from kvtier.controller.sessions import PrefetchState
from kvtier.domain.hashing import namespace_digest, page_keys
from kvtier.domain.records import SessionId, SessionState
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.policy.placement import ParkPrices
from kvtier.tiers.manager import TierConfig
from kvtier.worker import admission as admission_module
from kvtier.worker import commands as commands_module
from kvtier.worker import holds as holds_module
from kvtier.worker.servicer import serve_worker
from kvtier.worker.session_ref import SessionRef

from hf_checkpoints import build_checkpoint
from live_controller import orchestrated
from polling import eventually, wait_for

in_module_loop = pytest.mark.asyncio(loop_scope="module")

PAGE_SIZE = 4
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


# --------------------------------------------------------------------------- pure pieces


def test_promote_latency_learns_the_overhead_beyond_the_copy():
    latency = PromoteLatency(50.0, quantile=0.9, window=10)
    assert latency.estimate_ms(1_000_000, 1e9) == pytest.approx(1.0 + 50.0)  # the guess until an ack
    for overhead_ms in (5, 5, 5, 5, 5, 5, 5, 5, 5, 200):  # one prefetch waited for a long prefill
        latency.observe(1.0 + overhead_ms, 1_000_000, 1e9)
    assert latency.overhead_ms() == pytest.approx(5.0)  # the 90 % point of ten: the ninth
    latency.observe(201.0, 1_000_000, 1e9)  # a second long wait pushes it up
    assert latency.overhead_ms() == pytest.approx(200.0)
    fresh = PromoteLatency(50.0, quantile=0.9, window=1)
    fresh.observe(0.0, 10_000_000, 1e9)  # faster than the bandwidth says: no negative overhead
    assert fresh.overhead_ms() == 0.0
    with pytest.raises(ValueError):
        PromoteLatency(1.0, quantile=0.0)


def test_stats_keep_timeliness_and_waste_apart():
    stats = PrefetchStats(num_prefetched=3, prefetched_bytes=300)

    def outcome(kind: str, num_bytes: int) -> PauseOutcome:
        return PauseOutcome("s", "t", Tier.DRAM, 1, num_bytes, kind, 0, 1000.0, 1100.0, None, 10.0)

    stats.count_outcome(outcome(Outcome.ON_TIME, 100))
    stats.count_outcome(outcome(Outcome.ON_TIME, 100))
    stats.count_outcome(outcome(Outcome.LATE, 100))
    stats.count_waste("evicted", 50)  # on time, then half of it evicted before use
    stats.count_waste("ended", 0)  # nothing prefetched: not a waste
    assert stats.on_time_fraction == pytest.approx(2 / 3)
    assert stats.wasted_fraction == pytest.approx(50 / 300)
    assert stats.num_wasted == 1 and stats.wasted_count_by_reason == {"evicted": 1}
    assert stats.mean_abs_error_ms == pytest.approx(100.0)


# --------------------------------------------------------------------------- end to end


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def worker(tmp_path_factory):
    ckpt = build_checkpoint(tmp_path_factory.mktemp("prefetch") / "llama", "llama", seed=6)
    engine = Engine.from_pretrained(ckpt, page_size=PAGE_SIZE, num_pages=256, tier_config=TierConfig(dram_pages=128))
    server = await serve_worker(engine, worker_id="w-pf")
    yield server
    await server.stop(0)


def cluster(worker, redis_url, tmp_path, **params):
    return orchestrated(worker, redis_url, tmp_path, OrchestratorParams(**params))


def history_keys(worker, history):
    return page_keys(namespace_digest(worker.engine.namespace), history[:-1], PAGE_SIZE)


def tiers_of(worker, keys):
    index = worker.engine.index
    return [index.get(k).tier if index.get(k) is not None else None for k in keys]


async def demote_all(worker) -> int:
    return await worker.loop.call(lambda: worker.engine.tiers.demote_all(Tier.DRAM))


async def prefetched(orchestrator, session: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (await orchestrator.store.get(session)).prefetch_state != PrefetchState.DONE:
        assert loop.time() < deadline, f"the prefetch of {session} did not run"
        await asyncio.sleep(0.02)


@in_module_loop
async def test_a_prefetched_session_is_held_in_hbm_until_its_turn_then_released(worker, flushed_redis_url, tmp_path):
    namespace = worker.engine.namespace
    # Returning(eta 2 s) with a 1.5 s margin: the prefetch fires ~0.4 s from now and holds the
    # pages until the eta + margin, 3.5 s from now: the test acts well inside that window.
    async with cluster(worker, flushed_redis_url, tmp_path, margin_ms=1_500.0) as (controller, client):
        prompt = [12, 24, 36, 48, 60, 72, 84, 96, 108, 120, 132]
        out, _ = await client.complete(namespace, prompt, GREEDY, session_id="s-hold")
        history = prompt + out
        keys = history_keys(worker, history)
        assert (await client.pause("s-hold", tool="slow", expected_ms=60_000)).parked_tier is Tier.DRAM
        await client.returning("s-hold", eta_ms=2_000)
        await prefetched(controller.orchestrator, "s-hold")
        assert tiers_of(worker, keys) == [Tier.HBM] * 4
        await demote_all(worker)  # pressure: every idle page would go, the held ones stay
        assert tiers_of(worker, keys) == [Tier.HBM] * 4

        _, final = await client.complete(namespace, history + [5, 6], GREEDY, session_id="s-hold")
        assert final.usage.promoted_tokens == 0 and final.usage.cached_tokens == 16
        await demote_all(worker)  # the turn finished: the hold is gone, the pages cache as usual
        assert Tier.DRAM in tiers_of(worker, keys)
        stats = controller.orchestrator.stats
        assert (stats.num_on_time, stats.num_late, stats.wasted_bytes) == (1, 0, 0)

        # End with drop releases a hold at once, and the session's private pages go.
        prompt = [7, 14, 21, 28, 35, 42, 49, 56, 63, 70, 77]
        out, _ = await client.complete(namespace, prompt, GREEDY, session_id="s-hold-end")
        keys = history_keys(worker, prompt + out)
        await client.pause("s-hold-end", tool="slow", expected_ms=60_000)
        await client.returning("s-hold-end", eta_ms=2_000)
        await prefetched(controller.orchestrator, "s-hold-end")
        assert tiers_of(worker, keys) == [Tier.HBM] * 4
        assert (await client.end("s-hold-end", drop=True)).state is SessionState.ENDED
        assert tiers_of(worker, keys) == [None] * 4
        assert (await worker.loop.check_integrity()).is_ok


@in_module_loop
async def test_no_prefetch_goes_to_a_draining_worker(worker, flushed_redis_url, tmp_path):
    """From the moment a drain marks the worker (before the worker hears of it), the session's
    next turn is routed elsewhere: its scheduled prefetch is not sent, its pages stay below."""
    namespace = worker.engine.namespace
    async with cluster(worker, flushed_redis_url, tmp_path) as (controller, client):
        prompt = [9, 18, 27, 36, 45, 54, 63, 72, 81, 90, 99]
        out, _ = await client.complete(namespace, prompt, GREEDY, session_id="s-drained")
        keys = history_keys(worker, prompt + out)
        assert (await client.pause("s-drained", tool="slow", expected_ms=60_000)).parked_tier is Tier.DRAM
        entry = controller.registry.get(worker.worker_id)
        entry.is_draining = True  # what Drain does first
        try:
            await client.returning("s-drained", eta_ms=0)  # would prefetch at once
            record = await controller.orchestrator.store.get("s-drained")
            assert record.prefetch_state == PrefetchState.NONE
            assert controller.orchestrator.stats.num_prefetched == 0 and not controller.orchestrator.stats.refused
            assert Tier.DRAM in tiers_of(worker, keys)
        finally:
            entry.is_draining = False
        await client.end("s-drained")


@in_module_loop
async def test_a_session_expected_back_after_its_hold_ends_is_ranked_by_the_hold_end(
    worker, flushed_redis_url, tmp_path
):
    """A hold lasts at most ``max_hold_ms``. A session expected back after that is ranked by
    the hold's end, and the Prefetch carries no spread: the worker would otherwise take the
    hold's end for the session's median and rank it by a tail that is not its own."""
    namespace = worker.engine.namespace
    async with cluster(worker, flushed_redis_url, tmp_path, prices=ParkPrices(copy_weight=1e6), max_hold_ms=500.0) as (controller, client):
        prompt = [5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55]
        out, _ = await client.complete(namespace, prompt, GREEDY, session_id="s-long")
        sent_ms = time.time() * 1000.0
        assert (await client.pause("s-long", tool="search", expected_ms=2_000)).parked_tier is Tier.HBM
        await prefetched(controller.orchestrator, "s-long")
        expected = worker.loop.holds.view("s-long").expected
        assert expected.spread is None and expected.away_since_ms is None
        assert abs(expected.due_at_ms - (sent_ms + 500)) < 250
        await client.end("s-long")
        assert not worker.loop.holds.is_held("s-long")


@in_module_loop
async def test_the_controllers_session_hold_max_s_bounds_every_hold(worker, flushed_redis_url, tmp_path):
    """The operator's bound (``ControllerConfig.session_hold_max_s``) is the one the orchestrator
    plans with when no parameters are given: a 60 s tool's hold, to the prediction's 99 % point
    minutes away, runs 0.5 s (10 s with the default bound)."""
    namespace = worker.engine.namespace
    async with orchestrated(worker, flushed_redis_url, tmp_path, session_hold_max_s=0.5) as (controller, client):
        assert controller.orchestrator.params.max_hold_ms == 500.0
        prompt = [7, 14, 21, 28, 35, 42, 49, 56, 63, 70, 77]
        out, _ = await client.complete(namespace, prompt, GREEDY, session_id="s-bound")
        await client.pause("s-bound", tool="test_run", expected_ms=60_000)
        await client.returning("s-bound")  # the prefetch at once, its hold bounded from then
        sent_ms = time.time() * 1000.0
        await prefetched(controller.orchestrator, "s-bound")
        pin = worker.loop.holds.view("s-bound")
        assert 0 < pin.expires_at_ms - sent_ms <= 500 + 250
        await client.end("s-bound")


@in_module_loop
async def test_a_session_kept_in_hbm_is_held_there_until_its_turn(worker, flushed_redis_url, tmp_path):
    namespace = worker.engine.namespace
    # Copies weigh heavily here (ParkPrices.copy_weight): holding a paused session in HBM is the cheaper choice.
    async with cluster(worker, flushed_redis_url, tmp_path, prices=ParkPrices(copy_weight=1e6)) as (controller, client):
        orchestrator = controller.orchestrator
        prompt = [3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33]
        out, _ = await client.complete(namespace, prompt, GREEDY, session_id="s-guard")
        history = prompt + out
        keys = history_keys(worker, history)
        # Kept in HBM, and a guard prefetch at once: it moves nothing and holds the pages...
        info = await client.pause("s-guard", tool="search", expected_ms=2_000)
        assert info.parked_tier is Tier.HBM
        await prefetched(orchestrator, "s-guard")
        # Ranked by its expected return, and once overdue by the return still to come: the
        # guard carried how long the session has been away and the prediction's spread.
        expected = worker.loop.holds.view("s-guard").expected
        assert expected.spread == pytest.approx(orchestrator.predictor.params.default_sigma)
        assert 1_500 < expected.due_at_ms - expected.away_since_ms < 2_500
        # ... so the worker's own demotion (pressure elsewhere) cannot take them meanwhile.
        await demote_all(worker)
        assert tiers_of(worker, keys) == [Tier.HBM] * 4
        _, final = await client.complete(namespace, history + [1, 2], GREEDY, session_id="s-guard")
        assert final.usage.promoted_tokens == 0
        await demote_all(worker)  # back and done: no longer held
        assert Tier.DRAM in tiers_of(worker, keys)
        stats = orchestrator.stats
        assert stats.num_kept_in_hbm == 1 and stats.num_demoted == 0 and stats.num_prefetched == 0
        last = orchestrator.outcomes[-1]
        assert last.outcome == Outcome.KEPT and last.num_pages == 0 and last.wasted_bytes == 0


@in_module_loop
async def test_holds_share_a_capped_room_where_the_session_due_back_first_wins(
    worker, flushed_redis_url, tmp_path, monkeypatch
):
    """Holds keep at most MAX_HELD_FRACTION of HBM. At the cap, the hold of the session due back
    first (its hold lapses first) displaces the others, whether its prefetch copied pages up or
    was a guard's (pages that never left): a page that leaves HBM goes back onto its copy below
    without a write, so either costs one promotion if it goes. A later one is not taken. When
    the controller says when the session is expected back, that ranks the hold."""

    namespace = worker.engine.namespace
    digest = namespace_digest(namespace)
    async with cluster(worker, flushed_redis_url, tmp_path) as (_, client):
        histories = {}
        for session, prompt in (("s-kept", [4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 23]),
                                ("s-paid", [9, 18, 27, 36, 45, 54, 63, 72, 81, 90, 99])):
            out, _ = await client.complete(namespace, prompt, GREEDY, session_id=session)
            histories[session] = history_keys(worker, prompt + out)
        # Room for one session's 4 pages and a half: two holds do not fit together.
        monkeypatch.setattr(holds_module, "MAX_HELD_FRACTION", 6 / worker.engine.pool.num_pages)
        loop = worker.loop
        kept_id, paid_id = "s-kept", "s-paid"
        guard = await loop.prefetch(digest, (), "s-kept", hold_s=60.0)  # all in HBM: a guard
        assert guard.num_moved == 0 and loop.holds.is_held(kept_id)
        await demote_all(worker)
        assert tiers_of(worker, histories["s-kept"]) == [Tier.HBM] * 4  # held
        assert Tier.DRAM in tiers_of(worker, histories["s-paid"])
        # Due back sooner than the guard's session: it displaces the guard.
        paid = await loop.prefetch(digest, (), "s-paid", hold_s=30.0)
        assert paid.num_moved > 0
        assert loop.holds.is_held(paid_id) and not loop.holds.is_held(kept_id)  # displaced
        assert tiers_of(worker, histories["s-paid"]) == [Tier.HBM] * 4
        # A hold due back later does not displace it: it is simply not taken.
        await loop.prefetch(digest, (), "s-kept", hold_s=60.0)
        assert loop.holds.is_held(paid_id) and not loop.holds.is_held(kept_id)
        await demote_all(worker)
        assert tiers_of(worker, histories["s-paid"]) == [Tier.HBM] * 4
        # A guard due back sooner displaces the paid hold: copying up earns no rank.
        await loop.prefetch(digest, tuple(histories["s-kept"]), None)  # back in HBM, not held
        assert tiers_of(worker, histories["s-kept"]) == [Tier.HBM] * 4
        guard = await loop.prefetch(digest, (), "s-kept", hold_s=10.0)
        assert guard.num_moved == 0
        assert loop.holds.is_held(kept_id) and not loop.holds.is_held(paid_id)
        await demote_all(worker)
        assert tiers_of(worker, histories["s-kept"]) == [Tier.HBM] * 4
        assert Tier.DRAM in tiers_of(worker, histories["s-paid"])
        # The controller's expected return ranks before the hold's lapse: held for up to a
        # minute but expected back in a second, s-paid is due before s-kept (lapsing in 10 s).
        await loop.prefetch(digest, (), "s-paid", hold_s=60.0, due_s=1.0)
        assert loop.holds.is_held(paid_id) and not loop.holds.is_held(kept_id)
        await demote_all(worker)
        assert tiers_of(worker, histories["s-paid"]) == [Tier.HBM] * 4
        for session in histories:
            await client.end(session)
        assert not loop.holds.snapshot().held
        assert (await worker.loop.check_integrity()).is_ok


async def park_with_a_page_in_another_move(worker, client, session: str, prompt: list[int], page: int):
    """``session``'s first turn, then its pause parks its 4 pages in DRAM, and its ``page``-th
    page is marked as in the middle of another transfer (a prefetch stops there: a child may not
    rise above its parent). Returns its history, its page keys, and a coroutine function that
    ends that other move."""
    out, _ = await client.complete(worker.engine.namespace, prompt, GREEDY, session_id=session)
    history = prompt + out
    keys = history_keys(worker, history)
    assert (await client.pause(session, tool="slow", expected_ms=60_000)).parked_tier is Tier.DRAM
    assert tiers_of(worker, keys) == [Tier.DRAM] * 4
    node = worker.engine.index.get(keys[page])

    def set_moving(value: bool) -> None:
        node.moving = value
        if not value:
            worker.engine.index.requeue(node)

    await worker.loop.call(lambda: set_moving(True))
    return history, keys, lambda: worker.loop.call(lambda: set_moving(False))


@in_module_loop
async def test_pages_a_prefetch_left_below_are_topped_up_before_the_turn(worker, flushed_redis_url, tmp_path):
    """A page of the chain in the middle of another move stops a prefetch there (a child may not
    rise above its parent): the rest would be promoted on the request path. The orchestrator
    tops the prefetch up shortly after, and the turn finds its whole history in HBM."""
    async with cluster(worker, flushed_redis_url, tmp_path, margin_ms=1_500.0, topup_delay_ms=50.0) as (
        controller, client
    ):
        history, keys, end_the_move = await park_with_a_page_in_another_move(
            worker, client, "s-topup", [5, 10, 20, 40, 80, 160, 200, 240, 11, 22, 33], page=2)
        await client.returning("s-topup", eta_ms=2_000)
        await prefetched(controller.orchestrator, "s-topup")
        assert tiers_of(worker, keys) == [Tier.HBM, Tier.HBM, Tier.DRAM, Tier.DRAM]
        await end_the_move()
        await wait_for(lambda: tiers_of(worker, keys) == [Tier.HBM] * 4, what="the top-up of the skipped pages")
        await resume_after_the_top_up(worker, controller, client, "s-topup", history)  # 2 pages, then 2


async def resume_after_the_top_up(worker, controller, client, session: str, history: list[int]) -> None:
    """Once a top-up has brought the rest of ``session``'s 4 pages up: its next turn promotes
    nothing and finds all 16 tokens cached, its pause is on time with nothing wasted, and the
    pause's outcome counts every page its prefetch and top-ups moved (4)."""
    stats = controller.orchestrator.stats
    # The top-up's ack reaches the controller after the pages land on the worker; a Route before
    # it would close the pause with only the first prefetch's pages (its traffic still counted).
    await wait_for(lambda: stats.moved.get(("prefetch", "dram", "hbm"), (0,))[0] == 4, what="the top-up's ack")
    _, final = await client.complete(worker.engine.namespace, history + [7, 8], GREEDY, session_id=session)
    assert final.usage.promoted_tokens == 0 and final.usage.cached_tokens == 16
    assert (stats.num_on_time, stats.num_late, stats.wasted_bytes) == (1, 0, 0)
    assert stats.moved[("prefetch", "dram", "hbm")][0] == 4
    assert controller.orchestrator.outcomes[-1].num_pages == 4
    await client.end(session)
    assert (await worker.loop.check_integrity()).is_ok


@in_module_loop
async def test_top_ups_back_off_and_bring_up_pages_whose_room_came_late(worker, flushed_redis_url, tmp_path):
    """A prefetch that brought nothing back (here its first page is in another move; in the agent
    benchmark, no room) keeps being topped up at growing delays (50, 100, 200, 400 ms, ...), so
    pages that can move only after two top-ups 50 ms apart would have given up are still in HBM
    for the turn, which is on time (decision 0008)."""
    async with cluster(worker, flushed_redis_url, tmp_path, margin_ms=1_500.0, topup_delay_ms=50.0) as (
        controller, client
    ):
        history, keys, end_the_move = await park_with_a_page_in_another_move(
            worker, client, "s-backoff", [7, 14, 28, 56, 112, 224, 202, 242, 17, 27, 37], page=0)
        await client.returning("s-backoff", eta_ms=2_000)
        await prefetched(controller.orchestrator, "s-backoff")
        assert tiers_of(worker, keys) == [Tier.DRAM] * 4  # acknowledged, nothing moved
        await asyncio.sleep(0.5)  # past the first top-ups (50 + 100 ms after the ack and theirs)
        assert tiers_of(worker, keys) == [Tier.DRAM] * 4
        await end_the_move()
        await wait_for(lambda: tiers_of(worker, keys) == [Tier.HBM] * 4, what="a later top-up")
        await resume_after_the_top_up(worker, controller, client, "s-backoff", history)


@in_module_loop
async def test_top_ups_stop_where_the_hold_would_end(worker, flushed_redis_url, tmp_path, caplog):
    """Pages that can never come up are not topped up forever: none is scheduled past the hold's
    end (Returning's eta + margin, 2 s here), so with 50 ms doubling the chain stops after the
    top-up ~1.55 s in, not at ``max_topups``; the turn then promotes them and is late."""
    namespace = worker.engine.namespace
    async with cluster(worker, flushed_redis_url, tmp_path, margin_ms=1_500.0, topup_delay_ms=50.0,
                       max_topups=20) as (controller, client):
        history, keys, end_the_move = await park_with_a_page_in_another_move(
            worker, client, "s-bound", [8, 16, 32, 64, 128, 255, 203, 243, 18, 28, 38], page=0)
        orchestrator = controller.orchestrator
        with caplog.at_level(logging.INFO, logger="kvtier.controller.orchestrator"):
            await client.returning("s-bound", eta_ms=500)
            await prefetched(orchestrator, "s-bound")
            # Past the hold's end (2 s), with every top-up's ack in: unbounded, top-ups would go
            # on (the next at ~3.15 s, then ~6.35 s, ...). Polling for an empty timer slot would
            # not do: it is empty too while a top-up is in flight.
            await asyncio.sleep(2.5)
            assert not orchestrator.timers.is_scheduled(SessionKey("", "s-bound"))
        sent = [r for r in caplog.records
                if r.getMessage() == "session prefetched" and getattr(r, "session_id", None) == "s-bound"]
        # The prefetch, then top-ups at ~50, 150, 350, 750, 1550 ms (later by their acks' time:
        # a slow machine may fit one fewer); the next would fire at ~3150 ms, past the hold's end.
        assert 4 <= len(sent) <= 6, len(sent)
        assert all(getattr(r, "num_skipped", None) == 4 for r in sent)
        assert (await orchestrator.store.get("s-bound")).state is SessionState.RESUMING
        await end_the_move()

        _, final = await client.complete(namespace, history + [7, 8], GREEDY, session_id="s-bound")
        assert final.usage.promoted_tokens == 16
        assert (orchestrator.stats.num_on_time, orchestrator.stats.num_late) == (0, 1)
        await client.end("s-bound")
        assert (await worker.loop.check_integrity()).is_ok


@in_module_loop
async def test_a_prefetch_that_brought_nothing_back_is_scored_late(worker, flushed_redis_url, tmp_path):
    """A parked session whose prefetch was acknowledged with every page left below (the first
    page of its chain was in another move, and no top-up is allowed here) comes back to a turn
    that promotes them: the pause is late, not "kept" (which would leave it out of the on-time
    share), and it counts the pages that were still below."""
    namespace = worker.engine.namespace
    async with cluster(worker, flushed_redis_url, tmp_path, margin_ms=1_500.0, max_topups=0) as (controller, client):
        history, keys, end_the_move = await park_with_a_page_in_another_move(
            worker, client, "s-none", [6, 12, 24, 48, 96, 192, 201, 241, 13, 26, 39], page=0)
        await client.returning("s-none", eta_ms=2_000)
        await prefetched(controller.orchestrator, "s-none")
        assert tiers_of(worker, keys) == [Tier.DRAM] * 4  # acknowledged, nothing moved
        await end_the_move()

        _, final = await client.complete(namespace, history + [7, 8], GREEDY, session_id="s-none")
        assert final.usage.promoted_tokens == 16
        stats = controller.orchestrator.stats
        assert (stats.num_on_time, stats.num_late) == (0, 1)
        outcome = controller.orchestrator.outcomes[-1]
        assert (outcome.outcome, outcome.tier, outcome.num_pages) == (Outcome.LATE, Tier.DRAM, 4)
        await client.end("s-none")
        assert (await worker.loop.check_integrity()).is_ok


# --------------------------------------------------------------------------- promotion before admission


def _loop_on_a_slow_link(
    tmp_path, pair=(Tier.HBM, Tier.DRAM), pages_per_s=20.0, num_pages=24, dram_pages=64, hold_pages=None,
    wait_scale=1.0,
):
    """An engine loop whose ``pair`` link is emulated at ``pages_per_s`` (decision 0011), its
    session holds capped at ``hold_pages`` (None: the default share of HBM), its fixed waits
    times ``wait_scale``."""
    from kvtier.worker.engine_loop import EngineLoop

    ckpt = build_checkpoint(tmp_path / "llama", "llama", seed=6)
    page_bytes = Engine.from_pretrained(ckpt, page_size=PAGE_SIZE, num_pages=4).geometry.page_bytes
    slow = TierConfig(dram_pages=dram_pages, link_bytes_per_s={pair: pages_per_s * page_bytes})
    engine = Engine.from_pretrained(ckpt, page_size=PAGE_SIZE, num_pages=num_pages, tier_config=slow)
    loop = EngineLoop(engine, hold_fraction=None if hold_pages is None else hold_pages / num_pages,
                      wait_scale=wait_scale)
    loop.start()
    return engine, loop, page_bytes


@pytest.mark.asyncio
async def test_a_request_waits_for_its_pages_outside_the_engine_while_others_decode(tmp_path):
    """Promotion before admission (worker/admission.py, decision 0011): with a slow (emulated)
    DRAM -> HBM link, a request whose prompt was demoted waits for its pages while a running
    sequence keeps decoding; it then reports them as promoted and generates what it would have."""
    from kvtier.domain.records import GenerateFinal, GenerateRequest, TokenChunk

    # A DRAM -> HBM link of 4 pages a second: the 3 demoted pages take at least 0.75 s.
    engine, loop, _ = _loop_on_a_slow_link(tmp_path, (Tier.DRAM, Tier.HBM), 4.0, num_pages=256, dram_pages=128)
    prompt = tuple(range(3, 3 + 3 * PAGE_SIZE + 2))  # 3 full pages + 2 tokens
    events: list[tuple[str, tuple[int, ...]]] = []

    async def run(name: str, tokens: tuple[int, ...], max_tokens: int) -> GenerateFinal:
        request = GenerateRequest(namespace=engine.namespace, prompt_token_ids=tokens,
                                  sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        final = None
        async for event in loop.submit(request):
            if isinstance(event, TokenChunk):
                events.append((name, event.token_ids))
            else:
                final = event
        assert final is not None
        return final

    def output(name: str) -> list[int]:
        return [t for n, ids in events if n == name for t in ids]

    try:
        cold = await run("cold", prompt, 4)
        assert cold.usage.cached_tokens == 0
        assert await loop.call(lambda: engine.tiers.demote_all(Tier.DRAM)) > 0
        runner = asyncio.create_task(run("runner", tuple(range(100, 100 + 2 * PAGE_SIZE + 1)), 80))
        while not output("runner"):
            await asyncio.sleep(0.001)
        warm = await run("warm", prompt, 4)
        await runner
        assert warm.usage.cached_tokens == warm.usage.promoted_tokens == 3 * PAGE_SIZE
        assert warm.usage.cached_tokens_by_tier.dram_tokens == 3 * PAGE_SIZE
        assert output("warm") == output("cold")  # deterministic resume after the round trip
        # The runner kept decoding while the warm request waited for its pages (before the fix,
        # the engine thread waited for the copy and nothing ran meanwhile).
        first_warm = next(i for i, (name, _) in enumerate(events) if name == "warm")
        warm_sent = next(i for i, (name, _) in enumerate(events) if name == "runner")
        assert sum(len(ids) for name, ids in events[warm_sent + 1 : first_warm] if name == "runner") > 8
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()


async def _generate(loop, engine, prompt: tuple[int, ...]) -> None:
    from kvtier.domain.records import GenerateRequest

    request = GenerateRequest(namespace=engine.namespace, prompt_token_ids=prompt,
                              sampling=SamplingParams(max_tokens=2, ignore_eos=True))
    async for _ in loop.submit(request):
        pass


@pytest.mark.asyncio
async def test_a_request_that_needs_room_waits_for_a_background_demotion(tmp_path):
    """Room before admission (worker/admission.py, decision 0011): with HBM full of cached
    pages and a slow (emulated) HBM -> DRAM link, a new request waits outside the engine while
    pages are demoted in the background; the engine thread spills nothing synchronously."""
    engine, loop, _ = _loop_on_a_slow_link(tmp_path)
    try:
        for first in range(0, 240, 30):  # 8 prompts of 4 pages (+ output) into 24 pages of HBM
            await _generate(loop, engine, tuple(range(first, first + 4 * PAGE_SIZE)))
        counters = engine.tiers.counters
        assert counters.bytes_moved.get((Tier.HBM, Tier.DRAM), 0) > 0  # room was made
        assert counters.spill_link_wait_s == 0.0  # and never by a spill on the engine thread
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()


@pytest.mark.asyncio
async def test_a_commanded_prefetch_makes_room_in_the_background(tmp_path):
    """A Prefetch into a full HBM (worker/admission.py, decision 0011): room is made by a
    background demotion before the pages come up, not by spills on the engine thread."""
    engine, loop, page_bytes = _loop_on_a_slow_link(tmp_path)
    try:
        parked = tuple(range(200, 200 + 4 * PAGE_SIZE))
        await _generate(loop, engine, parked)
        assert await loop.call(lambda: engine.tiers.demote_all(Tier.DRAM)) > 0
        waited = engine.tiers.counters.spill_link_wait_s  # demote_all's own synchronous copies
        for first in range(0, 180, 30):  # HBM fills with other cached pages
            await _generate(loop, engine, tuple(range(first, first + 4 * PAGE_SIZE)))
        digest = namespace_digest(engine.namespace)
        outcome = await loop.prefetch(digest, tuple(page_keys(digest, parked, PAGE_SIZE)), None)
        assert outcome.num_moved == 4 and outcome.num_skipped == 0
        assert engine.tiers.counters.bytes_moved[(Tier.HBM, Tier.DRAM)] > 5 * page_bytes  # room was made
        assert engine.tiers.counters.spill_link_wait_s == waited  # never by a spill on the engine thread
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()


# --------------------------------------------------------------------------- holds yield


async def _session_run(loop, engine, session: str, prompt: tuple[int, ...], max_tokens: int = 2):
    """One generation of ``session`` on the loop: its tokens and its final event."""
    from kvtier.domain.records import GenerateFinal, GenerateRequest, TokenChunk

    request = GenerateRequest(namespace=engine.namespace, prompt_token_ids=prompt, session_id=session,
                              sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens, final = [], None
    async for event in loop.submit(request):
        if isinstance(event, TokenChunk):
            tokens.extend(event.token_ids)
        elif isinstance(event, GenerateFinal):
            final = event
    return tokens, final


async def _session_turn(loop, engine, session: str, prompt: tuple[int, ...], max_tokens: int = 2) -> list[int]:
    return (await _session_run(loop, engine, session, prompt, max_tokens))[0]


def _keys(engine, prompt: tuple[int, ...]) -> list:
    return page_keys(namespace_digest(engine.namespace), prompt, PAGE_SIZE)


def _tiers_in(engine, keys) -> list:
    return [engine.index.get(k).tier if engine.index.get(k) is not None else None for k in keys]


@pytest.mark.asyncio
async def test_holds_yield_to_a_waiting_request_the_session_due_back_last_first(tmp_path, monkeypatch):
    """A hold is a prediction (worker/room.py ``Room.make``): when a request waiting for
    admission needs room that the idle pages cannot give, held sessions yield it, the one due
    back last first, and the room is still made in the background (no spill on the engine
    thread). The session due back soon keeps every page in HBM."""

    monkeypatch.setattr(holds_module, "MAX_HELD_FRACTION", 1.0)  # both holds fit: only yielding frees them
    engine, loop, _ = _loop_on_a_slow_link(tmp_path, pages_per_s=200.0)
    try:
        digest = namespace_digest(engine.namespace)
        soon, late = tuple(range(1, 1 + 4 * PAGE_SIZE)), tuple(range(101, 101 + 4 * PAGE_SIZE))
        await _session_turn(loop, engine, "s-soon", soon)
        await _session_turn(loop, engine, "s-late", late)
        # Guards (every page in HBM). When each is expected back ranks them, not when its hold
        # lapses: s-soon may be held longer, but it is due back first.
        for session, hold_s, due_s in (("s-soon", 30.0, 1.0), ("s-late", 5.0, 4.0)):
            assert (await loop.prefetch(digest, (), session, hold_s=hold_s, due_s=due_s)).num_moved == 0
        held = {"s-soon", "s-late"}
        assert held <= loop.holds.snapshot().held
        # Everything else in HBM is free: a prompt needing two pages more than that must take
        # them from a held session.
        num_free = engine.pool.num_free
        big = tuple((40 + 3 * i) % 256 for i in range((num_free + 1) * PAGE_SIZE))  # + its first output's page
        assert await _session_turn(loop, engine, "s-big", big)
        assert engine.scheduler.num_preemptions == 0
        assert not loop.holds.is_held("s-late")  # yielded
        assert loop.holds.is_held("s-soon")
        assert _tiers_in(engine, _keys(engine, soon)) == [Tier.HBM] * 4
        assert Tier.DRAM in _tiers_in(engine, _keys(engine, late))  # moved down, not dropped
        assert engine.tiers.counters.spill_link_wait_s == 0.0
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()


@pytest.mark.asyncio
async def test_a_returning_sessions_request_takes_its_room_from_another_hold_not_its_own(tmp_path, monkeypatch):
    """A session back earlier than expected ranks its own hold the weakest; its request, short
    of room, must not make room by yielding that hold (worker/room.py ``Room.make``,
    ``sparing``): its own pages are pinned for it, so that frees nothing, and the room would
    then be taken on the engine thread. The next weakest hold yields, in the background, and
    the output is the one a run without holds gives."""

    monkeypatch.setattr(holds_module, "MAX_HELD_FRACTION", 1.0)
    engine, loop, _ = _loop_on_a_slow_link(tmp_path, pages_per_s=200.0)
    try:
        digest = namespace_digest(engine.namespace)
        own, other = tuple(range(1, 1 + 4 * PAGE_SIZE)), tuple(range(101, 101 + 4 * PAGE_SIZE))
        own += tuple(await _session_turn(loop, engine, "s-own", own))
        await _session_turn(loop, engine, "s-other", other)
        for session, due_s in (("s-own", 20.0), ("s-other", 4.0)):  # s-own expected back last
            assert (await loop.prefetch(digest, (), session, hold_s=30.0, due_s=due_s)).num_moved == 0
        # s-own is back: its history (4 pages in HBM) and new tokens needing two pages more than are free.
        prompt = own + tuple((40 + 3 * i) % 256 for i in range((engine.pool.num_free + 1) * PAGE_SIZE - len(own) % PAGE_SIZE))
        out, final = await _session_run(loop, engine, "s-own", prompt)
        assert final.usage.cached_tokens == 4 * PAGE_SIZE
        assert loop.holds.outcomes["yielded"] == 1  # s-other's, once
        assert not loop.holds.is_held("s-other")
        assert Tier.DRAM in _tiers_in(engine, _keys(engine, other))  # moved down, not dropped
        assert engine.tiers.counters.spill_link_wait_s == 0.0  # never on the engine thread
        assert engine.scheduler.num_preemptions == 0
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()
    assert await _outputs_without_holds(tmp_path, [prompt]) == [out]


@pytest.mark.asyncio
async def test_the_worker_counts_the_pages_brought_up_for_a_session_and_those_it_did_not_find_in_hbm(tmp_path):
    """The controller judges a prefetch's waste from the directory, which lags the worker: pages
    given up just before the session's turn look in HBM to it. The worker counts it exactly when
    the session's next request arrives (``Holds.settle``): of the page moves that brought
    its pages up since its last generation, one per page still in HBM was used, every other
    move was wasted (pages below again, or brought up twice); a session that ends wastes all."""
    engine, loop, _ = _loop_on_a_slow_link(tmp_path, pages_per_s=100.0, num_pages=40)
    try:
        digest = namespace_digest(engine.namespace)
        histories = {}
        for i, session in enumerate(("s-used", "s-lost", "s-twice", "s-ended")):
            prompt = tuple(range(1 + 50 * i, 1 + 50 * i + 3 * PAGE_SIZE))
            histories[session] = prompt + tuple(await _session_turn(loop, engine, session, prompt))
        await loop.call(lambda: engine.tiers.demote_all(Tier.DRAM))
        def counts() -> tuple[int, int]:
            return loop.holds.session_prefetched_pages, loop.holds.session_prefetch_wasted_pages

        async def up(session: str) -> None:
            assert (await loop.prefetch(digest, (), session)).num_moved == 3, session  # its private pages

        async def down(session: str) -> None:
            await loop.demote(digest, (), session, Tier.DRAM)
            assert Tier.HBM not in _tiers_in(engine, _keys(engine, histories[session]))

        async def turn(session: str) -> None:
            histories[session] += tuple(await _session_turn(loop, engine, session, histories[session] + (7,)))

        # Two prefetches at once (a top-up while the first is in flight): the pages move once,
        # and count once.
        first, second = await asyncio.gather(loop.prefetch(digest, (), "s-used"), loop.prefetch(digest, (), "s-used"))
        assert sorted((first.num_moved, second.num_moved)) == [0, 3]
        assert counts() == (0, 0)  # settled when the session is back, not before
        await turn("s-used")
        assert counts() == (3, 0)
        await up("s-lost")
        await down("s-lost")  # given up before its turn: the turn promotes them again
        await turn("s-lost")
        assert counts() == (6, 3)
        await up("s-twice")
        await down("s-twice")
        await up("s-twice")  # up again: the first move was wasted, the second used
        await turn("s-twice")
        assert counts() == (12, 6)
        await up("s-ended")
        await loop.drop_session(digest, "s-ended")
        assert counts() == (15, 9)
        # A turn with nothing brought up for it counts nothing.
        await turn("s-used")
        assert counts() == (15, 9)
        assert loop.holds.snapshot().num_sessions_prefetched == 0
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()


@pytest.mark.asyncio
async def test_a_prefetch_does_not_take_the_room_of_a_session_due_back_sooner(tmp_path):
    """Pages brought up for a session due back stay in HBM after its hold is refused at the cap
    (clean: their copy below is intact), free to take when room is needed. A prefetch for a
    session due back *later* must not take them: that moves pages up only to send another
    session's down unused, which it must bring up again or promote on arrival (decision 0008).
    With no other room, the later prefetch moves nothing (its top-ups or its turn
    bring it); a prefetch for a session due back sooner still takes them."""
    engine, loop, _ = _loop_on_a_slow_link(tmp_path, pages_per_s=200.0, num_pages=8, hold_pages=1)
    try:
        digest = namespace_digest(engine.namespace)
        prompts = {s: tuple(range(1 + 40 * i, 1 + 40 * i + 4 * PAGE_SIZE))
                   for i, s in enumerate(("s-soon", "s-sooner", "s-late", "s-first"))}
        keys = {}
        for session, prompt in prompts.items():
            history = prompt + tuple(await _session_turn(loop, engine, session, prompt))
            keys[session] = _keys(engine, history)
            assert len(keys[session]) == 4
        await loop.call(lambda: engine.tiers.demote_all(Tier.DRAM))
        assert engine.pool.num_free == 8
        # Due back in 10 s and 5 s: both holds refused (a cap of one page), their pages in HBM.
        for session, due_s in (("s-soon", 10.0), ("s-sooner", 5.0)):
            assert (await loop.prefetch(digest, (), session, hold_s=30.0, due_s=due_s)).num_moved == 4
        assert loop.holds.outcomes["refused"] == 2 and not loop.holds.snapshot().held
        assert engine.tiers.num_reclaimable() == 8 and engine.pool.num_free == 0
        # Due back in 20 s: HBM has no room but theirs, which it may not take.
        late = await loop.prefetch(digest, (), "s-late", hold_s=30.0, due_s=20.0)
        assert late.num_moved == 0
        assert _tiers_in(engine, keys["s-late"]) == [Tier.DRAM] * 4
        for session in ("s-soon", "s-sooner"):
            assert _tiers_in(engine, keys[session]) == [Tier.HBM] * 4, session
        # Due back in 1 s, before both: it takes their room.
        assert (await loop.prefetch(digest, (), "s-first", hold_s=30.0, due_s=1.0)).num_moved == 4
        assert _tiers_in(engine, keys["s-first"]) == [Tier.HBM] * 4
        assert (_tiers_in(engine, keys["s-soon"]) + _tiers_in(engine, keys["s-sooner"])).count(Tier.HBM) == 4
        # The turns settle what was brought up for them; nothing is awaited any more.
        for session in prompts:
            await _session_turn(loop, engine, session, prompts[session])
        assert loop.holds.snapshot().num_awaited_pages == 0
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()


async def _guard_due_soon(loop, engine, due_s: float) -> tuple[tuple[int, ...], str]:
    """One session (``s-soon``), its first turn done and held by a guard, due back in
    ``due_s``: its history and its hold's pin id."""

    soon = tuple(range(1, 1 + 4 * PAGE_SIZE))
    soon += tuple(await _session_turn(loop, engine, "s-soon", soon))
    digest = namespace_digest(engine.namespace)
    assert (await loop.prefetch(digest, (), "s-soon", hold_s=30.0, due_s=due_s)).num_moved == 0
    held = "s-soon"
    assert loop.holds.is_held(held)
    return soon, held


async def _outputs_without_holds(tmp_path, prompts) -> list[list[int]]:
    """The oracle: each prompt on a fresh loop that holds nothing."""
    engine, loop, _ = _loop_on_a_slow_link(tmp_path, pages_per_s=200.0)
    try:
        return [(await _session_run(loop, engine, "s-x", p))[0] for p in prompts]
    finally:
        await loop.close()
        engine.tiers.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("comes_back", [True, False], ids=["back-in-time", "not-back"])
async def test_a_waiting_request_does_not_displace_a_session_due_back_within_a_second(
    tmp_path, monkeypatch, comes_back
):
    """A request that needs a hold's room waits while that session is due back within
    ``HOLD_DUE_SOON_S`` (worker/admission.py ``Admission.ready``): the session's turn comes,
    finds every page in HBM and promotes nothing, and the request runs after it, with the
    output a run without holds gives. The wait is bounded (``HOLD_DEFER_S``): a session that
    is not back by then yields its hold."""

    monkeypatch.setattr(admission_module, "HOLD_DEFER_S", 1.5)
    engine, loop, _ = _loop_on_a_slow_link(tmp_path, pages_per_s=200.0)
    try:
        soon, held = await _guard_due_soon(loop, engine, 0.5)
        # Every other HBM page is free: this prompt needs two pages more, which only the hold has.
        big = tuple((40 + 3 * i) % 256 for i in range((engine.pool.num_free + 1) * PAGE_SIZE))
        started = time.monotonic()
        waiting = asyncio.create_task(_session_run(loop, engine, "s-big", big))
        await asyncio.sleep(0.2)
        assert not waiting.done() and loop.holds.is_held(held)  # it waits; the hold stays
        if comes_back:
            _, resumed = await _session_run(loop, engine, "s-soon", soon + (7, 9))
            assert resumed.usage.promoted_tokens == 0
            assert resumed.usage.cached_tokens == len(soon) // PAGE_SIZE * PAGE_SIZE
            assert loop.holds.outcomes["yielded"] == 0
        out, final = await asyncio.wait_for(waiting, 30)
        if comes_back:
            assert loop.holds.outcomes["yielded"] == 0  # the hold ended with its session's turn
            # The wait is counted, and ended with the room (no hold yielded), before the limit.
            assert loop.admission.deferrals == {"room": 1, "timed_out": 0}
            assert 0.0 < loop.admission.deferral_wait_s < admission_module.HOLD_DEFER_S
        else:
            assert time.monotonic() - started >= admission_module.HOLD_DEFER_S
            assert loop.holds.outcomes["yielded"] == 1 and not loop.holds.is_held(held)
            assert loop.admission.deferrals == {"room": 0, "timed_out": 1}
            assert admission_module.HOLD_DEFER_S / 2 < loop.admission.deferral_wait_s <= time.monotonic() - started
        assert engine.scheduler.num_preemptions == 0
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()
    assert await _outputs_without_holds(tmp_path, [big]) == [out] and final.usage.generated_tokens == 2


@pytest.mark.asyncio
async def test_the_wait_scale_stretches_the_window_of_holds_due_back_soon_and_the_wait_for_them(
    tmp_path, monkeypatch
):
    """``wait_scale`` (``WorkerConfig.wait_scale``) multiplies the fixed waits: with the window
    of holds due back soon and the wait for them both 0.5 s, a hold due back in 1 s is not due
    soon and yields to a request at once; times 3 (1.5 s) it is spared, and the request waits
    the stretched 1.5 s for it before it yields."""

    monkeypatch.setattr(admission_module, "HOLD_DUE_SOON_S", 0.5)
    monkeypatch.setattr(admission_module, "HOLD_DEFER_S", 0.5)
    outs = []
    for scale in (1.0, 3.0):
        engine, loop, _ = _loop_on_a_slow_link(tmp_path / f"x{scale:g}", pages_per_s=200.0, wait_scale=scale)
        try:
            _, held = await _guard_due_soon(loop, engine, 1.0)
            big = tuple((40 + 3 * i) % 256 for i in range((engine.pool.num_free + 1) * PAGE_SIZE))
            started = time.monotonic()
            out, _ = await asyncio.wait_for(_session_run(loop, engine, "s-big", big), 30)
            waited = time.monotonic() - started
            assert loop.holds.outcomes["yielded"] == 1 and not loop.holds.is_held(held)
            if scale == 1.0:
                assert loop.admission.deferrals == {"room": 0, "timed_out": 0}  # not due soon: no wait
            else:
                assert loop.admission.deferrals == {"room": 0, "timed_out": 1}
                assert waited >= 0.5 * scale and loop.admission.deferral_wait_s > 0.5 * scale / 2
            assert (await loop.check_integrity()).is_ok
            outs.append(out)
        finally:
            await loop.close()
            engine.tiers.close()
    assert outs[0] == outs[1]  # the wait changes when, not what


def test_a_wait_scale_outside_0_to_100_is_refused_naming_the_setting(tmp_path):
    from kvtier.domain.errors import InvalidArgument
    from kvtier.runtime.config import MAX_WAIT_SCALE
    from kvtier.worker.engine_loop import EngineLoop

    ckpt = build_checkpoint(tmp_path / "llama", "llama", seed=6)
    engine = Engine.from_pretrained(ckpt, page_size=PAGE_SIZE, num_pages=8)
    for bad in (0, -1.0, MAX_WAIT_SCALE + 1, float("nan"), float("inf"), True, "2"):
        with pytest.raises(InvalidArgument, match="wait_scale must be in") as exc:
            EngineLoop(engine, wait_scale=bad)
        assert exc.value.field == "wait_scale"


@pytest.mark.asyncio
async def test_room_a_clean_hold_gives_up_is_taken_in_the_same_pass_not_after_a_step(tmp_path, monkeypatch, caplog):
    """A waiting request whose room a held session gives up, where the hold's pages were
    prefetched and so kept their copy below: the hold yields (worker/room.py
    ``Room.make``) and its pages are free to take at once, so the request is admitted in the
    pass that made the room, not after the engine's next step. Here the request waits first
    for a hold due back soon (``HOLD_DEFER_S``), and a running sequence's every step takes
    0.5 s (a stand-in for a long GPU step): admitted a step later, it would wait that long
    more once the wait for the hold was over."""

    step_s = 0.5
    monkeypatch.setattr(admission_module, "HOLD_DEFER_S", 1.0)
    engine, loop, _ = _loop_on_a_slow_link(tmp_path, pages_per_s=200.0)
    try:
        digest = namespace_digest(engine.namespace)
        soon = tuple(range(101, 101 + 4 * PAGE_SIZE))
        soon += tuple(await _session_turn(loop, engine, "s-soon", soon))
        assert (await loop.demote(digest, (), "s-soon", Tier.DRAM)).num_moved == 4
        assert (await loop.prefetch(digest, (), "s-soon", hold_s=30.0, due_s=0.5)).num_moved == 4
        step = engine.step

        def slow_step(**kwargs):
            time.sleep(step_s)
            return step(**kwargs)

        monkeypatch.setattr(engine, "step", slow_step)
        running = asyncio.create_task(_session_run(loop, engine, "s-run", tuple(range(60, 64)), max_tokens=8))
        while not engine.num_running:
            await asyncio.sleep(0.01)
        # The free pages and two more, which only the hold has (its own, clean).
        big = tuple((40 + 3 * i) % 256 for i in range((engine.pool.num_free + 1) * PAGE_SIZE))
        with caplog.at_level(logging.INFO, logger="kvtier.worker.engine"):
            out, final = await asyncio.wait_for(_session_run(loop, engine, "s-big", big), 30)
        await asyncio.wait_for(running, 30)
        assert loop.holds.outcomes["yielded"] == 1 and loop.admission.deferrals == {"room": 0, "timed_out": 1}
        assert engine.scheduler.num_preemptions == 0 and final.usage.promoted_tokens == 0
        [done] = [r for r in caplog.records
                  if r.getMessage() == "generation finished" and getattr(r, "prompt_tokens", None) == len(big)]
        assert done.hold_wait_ms >= admission_module.HOLD_DEFER_S * 1000.0 / 2
        # Admitted in the pass whose room-making ended the wait, not a step after it.
        assert done.admission_wait_ms - done.hold_wait_ms < step_s * 1000.0 / 2
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()
    assert await _outputs_without_holds(tmp_path, [big]) == [out]


@pytest.mark.asyncio
async def test_requests_that_arrive_together_do_not_take_a_held_session_s_room_on_the_engine_thread(tmp_path):
    """Two requests reach the engine loop in one pass; each fits in the free HBM pages, both
    do not. The second counts the pages promised to the first (``Room.backlog_pages``), so it
    waits outside the engine, where a hold due back within a second keeps its pages, instead
    of being admitted and taking them from the hold on the engine thread (the scheduler counts
    held pages as idle). The held session's turn then promotes nothing, and both requests
    finish with the output a run without holds gives."""
    engine, loop, _ = _loop_on_a_slow_link(tmp_path, pages_per_s=200.0)
    try:
        soon, held = await _guard_due_soon(loop, engine, 0.8)
        # Each needs num_free // 2 + 1 pages (its prompt's and its first output's).
        n = engine.pool.num_free // 2 + 1
        prompts = [tuple((40 + 3 * i) % 256 for i in range((n - 1) * PAGE_SIZE)),
                   tuple((41 + 5 * i) % 256 for i in range((n - 1) * PAGE_SIZE))]
        # Both are posted while the engine thread is busy, so it takes them in one pass.
        loop.call(lambda: time.sleep(0.3))
        runs = [asyncio.create_task(_session_run(loop, engine, f"s-{i}", p)) for i, p in enumerate(prompts)]
        await asyncio.sleep(0.5)
        assert loop.holds.is_held(held) and loop.holds.outcomes["yielded"] == 0
        _, resumed = await _session_run(loop, engine, "s-soon", soon + (7, 9))
        assert resumed.usage.promoted_tokens == 0
        outputs = [out for out, _ in await asyncio.wait_for(asyncio.gather(*runs), 30)]
        assert loop.holds.outcomes["yielded"] == 0 and engine.scheduler.num_preemptions == 0
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()
    assert await _outputs_without_holds(tmp_path, prompts) == outputs


def test_a_hold_share_outside_0_to_1_is_refused_naming_the_setting(tmp_path):
    from kvtier.domain.errors import InvalidArgument
    from kvtier.worker.engine_loop import EngineLoop

    ckpt = build_checkpoint(tmp_path / "llama", "llama", seed=6)
    engine = Engine.from_pretrained(ckpt, page_size=PAGE_SIZE, num_pages=8)
    for bad in (0, -0.5, 1.5, float("nan"), True):
        with pytest.raises(InvalidArgument, match="session_hold_fraction must be in") as exc:
            EngineLoop(engine, hold_fraction=bad)
        assert exc.value.field == "session_hold_fraction"
    assert EngineLoop(engine, hold_fraction=0.25).holds.cap_pages == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("spread", [0.4, None], ids=["with-spread", "without"])
async def test_an_overdue_session_ranks_by_the_return_still_to_come(tmp_path, spread):
    """A hold ranks by when its session is expected back. Once the session is overdue that is
    not its passed median: given that it has not returned, the median of its return moves out
    with the tail (``ExpectedReturn``). Paused 10 s ago and expected back at 10.05 s (sigma
    0.4), by 10.35 s it is expected back ~3 s later still, so a session due back in 1 s takes
    its place at the holds' cap. Without the spread (an older controller) the passed median
    still ranks it first, and the session due back in 1 s is not held."""

    engine, loop, _ = _loop_on_a_slow_link(tmp_path, pages_per_s=200.0, hold_pages=6)  # one session's 4 pages
    assert loop.holds.cap_pages == 6
    try:
        digest = namespace_digest(engine.namespace)
        overdue_id, soon_id = "s-overdue", "s-soon"
        await _session_turn(loop, engine, "s-overdue", tuple(range(1, 1 + 4 * PAGE_SIZE)))
        await _session_turn(loop, engine, "s-soon", tuple(range(101, 101 + 4 * PAGE_SIZE)))
        await loop.prefetch(digest, (), "s-overdue", hold_s=30.0, due_s=0.05,
                            away_s=10.0 if spread else None, spread=spread)
        assert loop.holds.is_held(overdue_id)
        await asyncio.sleep(0.3)  # past its median
        now_ms = time.time() * 1000.0
        rank_in_s = (loop.holds.view(overdue_id).rank_ms - now_ms) / 1000.0
        if spread:
            assert 2.0 < rank_in_s < 4.0
        else:
            assert rank_in_s < 0.0
        await loop.prefetch(digest, (), "s-soon", hold_s=30.0, due_s=1.0)
        if spread:
            assert loop.holds.is_held(soon_id) and not loop.holds.is_held(overdue_id)
            assert loop.holds.outcomes["displaced"] == 1
        else:
            assert loop.holds.is_held(overdue_id) and not loop.holds.is_held(soon_id)
            assert loop.holds.outcomes["refused"] == 1
    finally:
        await loop.close()
        engine.tiers.close()


def test_the_median_of_a_return_still_to_come():
    """``conditional_median_ms``: the point where a log-normal duration's survival is half of
    what it is after ``elapsed``, checked against the survival function itself; the median at
    the start, barely later early on, moving out past the median."""
    from statistics import NormalDist

    from kvtier.policy.holds import conditional_median_ms

    def survival(t: float, median: float, sigma: float) -> float:
        return 1.0 - NormalDist().cdf(math.log(t / median) / sigma)

    for median, sigma in ((10_000.0, 0.4), (1_200.0, 0.5), (400.0, 1.0)):
        assert conditional_median_ms(median, 0.0, sigma) == median
        previous = median
        for fraction in (0.3, 0.52, 1.0, 1.2, 2.0, 4.0):
            elapsed = fraction * median
            t = conditional_median_ms(median, elapsed, sigma)
            assert t > elapsed and t >= previous  # later with every moment it is not back
            assert survival(t, median, sigma) == pytest.approx(survival(elapsed, median, sigma) / 2, rel=1e-6)
            previous = t
    # Prefetched at its 5 % point (sigma 0.4): 1.03 x the median; 2 s overdue on a 10 s median: 14.8 s.
    assert conditional_median_ms(10_000.0, 10_000.0 * math.exp(-1.645 * 0.4), 0.4) == pytest.approx(10_250, rel=0.01)
    assert conditional_median_ms(10_000.0, 12_000.0, 0.4) == pytest.approx(14_800, rel=0.01)
    # Far in the tail it stays finite and after now.
    assert 1e6 < conditional_median_ms(1_000.0, 1e6, 0.4) < float("inf")


@pytest.mark.asyncio
async def test_a_running_sequence_takes_a_held_page_instead_of_being_preempted(tmp_path, monkeypatch):
    """A sequence that outgrows the free pages while the rest of HBM is held
    (``Engine.step(release_pin=...)``): the hold yields and the sequence runs on, instead of
    being preempted and recomputed; its output is the one a run without holds gives."""
    from kvtier.worker.engine_loop import EngineLoop

    monkeypatch.setattr(holds_module, "MAX_HELD_FRACTION", 1.0)
    ckpt = build_checkpoint(tmp_path / "llama", "llama", seed=6)
    prompt = tuple(range(7, 7 + 2 * PAGE_SIZE))

    async def long_turn(held: bool) -> tuple[list[int], int]:
        engine = Engine.from_pretrained(ckpt, page_size=PAGE_SIZE, num_pages=24, tier_config=TierConfig(dram_pages=64))
        loop = EngineLoop(engine)
        loop.start()
        try:
            if held:
                parked = tuple(range(200, 200 + 5 * PAGE_SIZE))
                await _session_turn(loop, engine, "s-held", parked)
                digest = namespace_digest(engine.namespace)
                await loop.prefetch(digest, (), "s-held", hold_s=30.0)
                assert loop.holds.is_held("s-held")
            # Admitted with room for its prompt; its output then needs more pages than are free.
            grow_to = engine.pool.num_free + 2
            out = await _session_turn(loop, engine, "s-long", prompt, max_tokens=grow_to * PAGE_SIZE - len(prompt))
            if held:
                assert not loop.holds.is_held("s-held")
            assert (await loop.check_integrity()).is_ok
            return out, engine.scheduler.num_preemptions
        finally:
            await loop.close()
            engine.tiers.close()

    out_held, preemptions = await long_turn(held=True)
    assert preemptions == 0
    out_free, _ = await long_turn(held=False)
    assert out_held[: len(out_free)] == out_free[: len(out_held)] and len(out_held) > 0


async def _yield_the_later_hold(
    loop, engine, late_hold_s: float, *, paid: bool = False
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two held sessions (guards; ``s-late`` parked and prefetched when ``paid``), then a
    request that takes room from them: the one due back later (``s-late``, held
    ``late_hold_s``) yields. Returns both sessions' histories."""

    digest = namespace_digest(engine.namespace)
    soon, late = tuple(range(1, 1 + 4 * PAGE_SIZE)), tuple(range(101, 101 + 4 * PAGE_SIZE))
    soon += tuple(await _session_turn(loop, engine, "s-soon", soon))
    late += tuple(await _session_turn(loop, engine, "s-late", late))
    if paid:
        assert (await loop.demote(digest, (), "s-late", Tier.DRAM)).num_moved == 4
    for session, hold_s, due_s in (("s-soon", 30.0, 1.0), ("s-late", late_hold_s, 4.0)):
        moved = (await loop.prefetch(digest, (), session, hold_s=hold_s, due_s=due_s)).num_moved
        assert moved == (4 if paid and session == "s-late" else 0)
    big = tuple((40 + 3 * i) % 256 for i in range((engine.pool.num_free + 1) * PAGE_SIZE))
    await _session_turn(loop, engine, "s-big", big)
    assert not loop.holds.is_held("s-late") and loop.holds.outcomes["yielded"] == 1
    # The watermark's background demotion the turn left running (it takes s-big's leaf) lands.
    async def settled() -> bool:
        return not await loop.call(lambda: any(n.moving for n in engine.index.nodes()))

    await eventually(settled, what="the watermark demotion")
    assert Tier.DRAM in _tiers_in(engine, _keys(engine, late[:-1]))
    return soon, late


@pytest.mark.asyncio
@pytest.mark.parametrize("paid", [False, True], ids=["guard", "prefetched"])
async def test_a_yielded_hold_is_retaken_once_room_comes_back(tmp_path, monkeypatch, paid):
    """A hold that yielded is a prediction that still stands (worker/holds.py
    ``Holds.retake``): once HBM has free room again, without a request waiting for it, the
    session's pages come back up and are held again, so its next turn promotes nothing; the
    pages moved are counted (``retaken_pages``), as waste only if a prefetch had moved them up
    (``retaken_waste_pages``: a guard's had not)."""

    monkeypatch.setattr(holds_module, "MAX_HELD_FRACTION", 1.0)
    engine, loop, _ = _loop_on_a_slow_link(tmp_path, pages_per_s=200.0)
    try:
        _, late = await _yield_the_later_hold(loop, engine, late_hold_s=30.0, paid=paid)
        # s-big's pages fill HBM: too little is free for s-late's 4 pages and the watermark's
        # free share, so nothing comes back yet.
        reserve = (1.0 - engine.tiers.config.hbm_watermark.low) * engine.pool.num_pages
        assert engine.pool.num_free - 4 < reserve and loop.holds.outcomes["retaken"] == 0
        # Its session pauses and the controller parks it: room comes back.
        await loop.demote(namespace_digest(engine.namespace), (), "s-big", Tier.DRAM)
        await wait_for(lambda: loop.holds.is_held("s-late"), what="the retaken hold")
        keys = _keys(engine, late[:-1])
        assert _tiers_in(engine, keys) == [Tier.HBM] * 4
        assert loop.holds.outcomes["retaken"] == 1 and loop.holds.retaken_pages > 0
        assert loop.holds.retaken_waste_pages == (loop.holds.retaken_pages if paid else 0)
        _, final = await _session_run(loop, engine, "s-late", late + (7, 8))
        assert final.usage.promoted_tokens == 0 and final.usage.cached_tokens == 4 * PAGE_SIZE
        assert not loop.holds.is_lapsed("s-late")
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()


@pytest.mark.asyncio
async def test_a_prefetch_never_takes_its_room_from_its_own_sessions_hold(tmp_path, monkeypatch):
    """A top-up for a held session short of room, whose prediction ranks a hair before the one
    the session is held by (worker/room.py ``Room.make``, ``sparing``): the session's
    own hold is not a weaker hold to yield; its pages would go down to make room for the same
    session's pages. In the agent run every top-up of such a session released its hold and
    took it again. A prefetch for any other session of that rank takes the room from it."""

    monkeypatch.setattr(holds_module, "MAX_HELD_FRACTION", 1.0)
    engine, loop, _ = _loop_on_a_slow_link(tmp_path, pages_per_s=200.0)
    try:
        await _yield_the_later_hold(loop, engine, late_hold_s=30.0, paid=True)
        await loop.call(lambda: engine.tiers.demote_all(Tier.DRAM))  # only holds are left in HBM
        hold_id = "s-late"
        # The room is back, so s-late's hold is retaken (``Holds.retake``).
        await wait_for(lambda: loop.holds.is_held(hold_id), what="the retake")
        pin = loop.holds.view(hold_id)
        rank = pin.rank_ms - 1.0

        def short_of_room(session: str) -> bool:
            ref = SessionRef(namespace_digest(engine.namespace), SessionId(session))
            return loop.room.needs(loop.room.free_hbm(sparing=rank) + 1, rank=rank, session=ref)

        assert await loop.call(lambda: short_of_room("s-late")) is False  # nothing may leave for it
        still = loop.holds.view(hold_id)  # the same hold, not yielded and retaken anew
        assert (still.expires_at_ms, still.expected) == (pin.expires_at_ms, pin.expected)
        assert loop.holds.outcomes["yielded"] == 1  # the request's, before
        assert await loop.call(lambda: short_of_room("s-other")) is True
        assert loop.holds.outcomes["yielded"] == 2  # (retaken at once: the room is there)
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()


@pytest.mark.asyncio
async def test_a_yielded_hold_is_not_retaken_after_it_would_have_lapsed_or_once_its_session_ends(
    tmp_path, monkeypatch
):
    """Retaking is bounded by the hold it replaces: past the hold's lapse time (the session is
    overdue: a prediction no longer), or once the session ends, the pages stay where they are."""

    monkeypatch.setattr(holds_module, "MAX_HELD_FRACTION", 1.0)
    engine, loop, _ = _loop_on_a_slow_link(tmp_path, pages_per_s=200.0)
    digest = namespace_digest(engine.namespace)
    try:
        _, late = await _yield_the_later_hold(loop, engine, late_hold_s=0.5)
        assert loop.holds.is_lapsed("s-late")
        await asyncio.sleep(0.6)  # s-late's hold would have lapsed by now
        await loop.demote(digest, (), "s-big", Tier.DRAM)
        await wait_for(lambda: not loop.holds.is_lapsed("s-late"), what="the lapsed hold forgotten")
        assert loop.holds.outcomes["retaken"] == 0 and loop.holds.retaken_pages == 0
        assert Tier.DRAM in _tiers_in(engine, _keys(engine, late[:-1]))
        assert engine.pool.num_free >= 8  # there was room: the lapse kept it out

        # Yielded again, then the session ends before room comes back: forgotten with it.
        await loop.prefetch(digest, (), "s-late", hold_s=30.0, due_s=4.0)
        assert loop.holds.is_held("s-late")
        await _session_turn(loop, engine, "s-big", tuple((41 + 3 * i) % 256 for i in range(
            (engine.pool.num_free + 1) * PAGE_SIZE)))
        assert loop.holds.is_lapsed("s-late")
        await loop.drop_session(digest, "s-late")
        assert not loop.holds.is_lapsed("s-late")
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()


@pytest.mark.asyncio
async def test_a_drain_releases_the_session_holds_and_refuses_prefetches_until_it_ends(tmp_path):
    """A draining worker's sessions come back elsewhere (Route skips it): their holds would only
    keep pinned pages the drain's drops must leave, so starting a drain releases them and
    forgets the lapsed ones, and a prefetch is refused until the drain ends."""
    from kvtier.domain.errors import FailedPrecondition

    engine, loop, _ = _loop_on_a_slow_link(tmp_path, pages_per_s=200.0)
    digest = namespace_digest(engine.namespace)
    try:
        _, late = await _yield_the_later_hold(loop, engine, late_hold_s=30.0, paid=True)
        assert loop.holds.is_held("s-soon") and loop.holds.is_lapsed("s-late")
        assert engine.pool.counts().pinned > 0
        assert await loop.set_draining(True) == 1
        assert not loop.holds.snapshot().held and not loop.holds.snapshot().lapsed
        assert engine.pool.counts().pinned == 0  # nothing keeps a page from the drain's drops
        with pytest.raises(FailedPrecondition, match="draining"):
            await loop.prefetch(digest, (), "s-late", hold_s=30.0, due_s=1.0)
        assert Tier.DRAM in _tiers_in(engine, _keys(engine, late[:-1]))  # the refused prefetch moved nothing
        assert await loop.set_draining(False) == 0
        assert (await loop.prefetch(digest, (), "s-late", hold_s=30.0, due_s=1.0)).num_moved > 0
        assert loop.holds.is_held("s-late")
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()


@pytest.mark.asyncio
async def test_a_park_waits_for_the_session_pages_a_demotion_was_taking_down_and_counts_them(
    tmp_path, monkeypatch
):
    """A session's turn finishes, the watermark demotion takes its deepest idle page in the next
    step, and its Pause's Demote comes while that page is on its way down. Not waiting, the
    page is skipped (moving) and so is every page above it (a page leaves HBM only
    after its children): the park moves nothing, and the controller keeps the session in HBM
    for its whole pause, holding it. The Demote waits for the page to land, counts it, and
    takes the rest of the chain down."""
    from kvtier.tiers.transfer import TransferReason

    engine, loop, _ = _loop_on_a_slow_link(tmp_path, pages_per_s=20.0)  # a page takes 50 ms down
    digest = namespace_digest(engine.namespace)

    async def park_while_the_leaf_leaves(session: str, prompt: tuple[int, ...]):
        first, _ = await _session_run(loop, engine, session, prompt)
        keys = _keys(engine, (*prompt, first[0]))[:4]
        assert await loop.call(lambda: engine.tiers.demote(Tier.HBM, Tier.DRAM, 1, TransferReason.WATERMARK)) == 1
        assert [engine.index.get(k).moving for k in keys] == [False, False, False, True]  # the leaf first
        outcome = await loop.demote(digest, (), session, Tier.DRAM)
        await loop.call(engine.tiers.wait_idle)
        return outcome, _tiers_in(engine, keys)

    try:
        monkeypatch.setattr(commands_module, "MAX_DEMOTE_WAIT_S", 0.0)  # no wait
        outcome, tiers = await park_while_the_leaf_leaves("s-before", tuple(range(40, 40 + 4 * PAGE_SIZE + 2)))
        assert (outcome.num_moved, outcome.num_skipped) == (0, 4)
        assert tiers == [Tier.HBM] * 3 + [Tier.DRAM]
        monkeypatch.undo()
        await loop.drop_session(digest, "s-before")  # the watermark's next pick is the new leaf
        outcome, tiers = await park_while_the_leaf_leaves("s-park", tuple(range(140, 140 + 4 * PAGE_SIZE + 2)))
        assert (outcome.num_moved, outcome.num_skipped) == (4, 0)
        assert tiers == [Tier.DRAM] * 4
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()


@pytest.mark.asyncio
async def test_a_hold_recalls_the_session_pages_a_demotion_was_taking_down(tmp_path):
    """A session's turn finishes, the watermark demotion picks its idle pages in the next step,
    and its Pause's guard prefetch comes a moment later, while they are on their way down
    (issue #7: the guard then held only the pages above them, and the turn promoted the rest).
    The hold recalls them: the demotion in flight leaves the pinned chain in HBM, the copies it
    made stay as shadows, and the next turn promotes nothing. Once the session is back and
    done, its pages go down onto those copies without a second one."""
    from kvtier.tiers.transfer import TransferReason

    engine, loop, _ = _loop_on_a_slow_link(tmp_path, pages_per_s=20.0)  # 4 pages take 0.2 s down
    try:
        prompt = tuple(range(40, 40 + 4 * PAGE_SIZE + 2))
        first, _ = await _session_run(loop, engine, "s-recall", prompt)
        keys = _keys(engine, (*prompt, first[0]))[:4]
        leaving = await loop.call(lambda: engine.tiers.demote(Tier.HBM, Tier.DRAM, 4, TransferReason.WATERMARK))
        assert leaving == 4 and all(engine.index.get(k).moving for k in keys)
        digest = namespace_digest(engine.namespace)
        outcome = await loop.prefetch(digest, (), "s-recall", hold_s=30.0, due_s=1.0)
        assert (outcome.num_moved, outcome.num_skipped) == (0, 0)
        await loop.call(engine.tiers.wait_idle)  # the demotion lands
        assert _tiers_in(engine, keys) == [Tier.HBM] * 4
        assert engine.tiers.counters.demotions_abandoned == 4
        _, final = await _session_run(loop, engine, "s-recall", (*prompt, first[0], 5, 6))
        assert final.usage.promoted_tokens == 0 and final.usage.cached_tokens >= 4 * PAGE_SIZE
        moved = engine.tiers.counters.bytes_moved.get((Tier.HBM, Tier.DRAM), 0)
        without_copy = engine.tiers.counters.demotions_without_copy
        assert await loop.call(lambda: engine.tiers.demote_all(Tier.DRAM)) >= 4
        assert engine.tiers.counters.demotions_without_copy - without_copy >= 4  # onto the recalled copies
        assert _tiers_in(engine, keys) == [Tier.DRAM] * 4
        assert engine.tiers.counters.bytes_moved.get((Tier.HBM, Tier.DRAM), 0) - moved < 4 * engine.geometry.page_bytes
        assert (await loop.check_integrity()).is_ok
    finally:
        await loop.close()
        engine.tiers.close()
