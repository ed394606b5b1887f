"""Sessions end to end: a real controller (gRPC on loopback, real valkey) and a real worker
(tiny HF checkpoint, 256 HBM pages + a 128-page DRAM tier, ``serve_worker`` + ``WorkerLink``).

A paused session's pages sink to DRAM and come back before its next turn (no promotion on
the request path, the full history cached, output equal to the transformers oracle);
Returning promotes at once; End cancels the scheduled prefetch and frees the pages; bad
transitions and unknown sessions get the right status codes. Plus the orchestrator's
pure pieces (tier choice, token bucket, timer queue) with a clock of their own."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time

import pytest
import pytest_asyncio
import torch

from kvtier.controller.orchestrator import Orchestrator
from kvtier.controller.orchestrator_params import OrchestratorParams
from kvtier.controller.predictor import ToolReturnPredictor
from kvtier.controller.registry import Registry
from kvtier.controller.session_tenancy import SessionKey
from kvtier.controller.sessions import ENDED_TTL_S, PrefetchState, SessionRecord, SessionStore, store_key
from kvtier.controller.timer_queue import TimerQueue
from kvtier.controller.token_bucket import TokenBucket
from kvtier.domain import errors
from kvtier.domain.hashing import NamespaceDigest, namespace_digest, page_keys
from kvtier.domain.records import (
    PauseRequest,
    PredictionSource,
    SessionId,
    SessionInfo,
    SessionState,
    WorkerId,
)
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.policy.lateness import equal_hazard_aims
from kvtier.tiers.manager import TierConfig
from kvtier.worker.servicer import serve_worker

from hf_checkpoints import build_checkpoint, hf_logits, load_hf
from live_controller import orchestrated

in_module_loop = pytest.mark.asyncio(loop_scope="module")

PAGE_SIZE = 4
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama", seed=0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def worker(checkpoint):
    engine = Engine.from_pretrained(
        checkpoint, page_size=PAGE_SIZE, num_pages=256, tier_config=TierConfig(dram_pages=128)
    )
    server = await serve_worker(engine, worker_id="w-s")
    yield server
    await server.stop(0)


def cluster(worker, redis_url, tmp_path, **params):
    return orchestrated(worker, redis_url, tmp_path, OrchestratorParams(**params))


def tiers_of(worker, keys):
    index = worker.engine.index
    return [index.get(k).tier if index.get(k) is not None else None for k in keys]


def history_keys(worker, history):
    """Keys of the full pages a turn leaves cached (its last sampled token is never fed back)."""
    digest = namespace_digest(worker.engine.namespace)
    return page_keys(digest, history[:-1], PAGE_SIZE)


def greedy_oracle(model, prompt, num_tokens):
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(int(torch.argmax(hf_logits(model, tokens)[-1])))
    return tokens[len(prompt):]


@in_module_loop
async def test_paused_session_is_parked_and_back_before_its_next_turn(worker, checkpoint, flushed_redis_url,
                                                                      tmp_path):
    namespace = worker.engine.namespace
    prompt = [7, 19, 33, 41, 52, 68, 71, 84, 90, 101, 113]
    async with cluster(worker, flushed_redis_url, tmp_path) as (controller, client):
        out1, final1 = await client.complete(namespace, prompt, GREEDY, session_id="s-park")
        history = prompt + out1  # 17 tokens: 4 full pages cached
        keys = history_keys(worker, history)
        assert len(keys) == 4 and tiers_of(worker, keys) == [Tier.HBM] * 4
        moved_before = worker.engine.tiers.counters.pages_moved.get((Tier.HBM, Tier.DRAM), 0)

        paused_at_ms = time.time() * 1000.0
        info = await client.pause("s-park", tool="search", expected_ms=500)
        assert info.state is SessionState.PAUSED and info.parked_tier is Tier.DRAM
        assert info.worker_id == "w-s" and info.prefetch_at_ms is not None
        assert worker.engine.tiers.counters.pages_moved[(Tier.HBM, Tier.DRAM)] - moved_before == 4
        # The prefetch fires ~400 ms after the pause; the pages are back before the turn at 1 s.
        await asyncio.sleep(1.0)
        assert tiers_of(worker, keys) == [Tier.HBM] * 4
        # Held until the prediction's high quantile, ranked by when the session is expected back
        # (the caller's 500 ms), since when it is away and the prediction's spread (a cold
        # caller estimate: the predictor's default sigma): the Prefetch carried them all.
        hold = worker.loop.holds.view("s-park")
        assert abs(hold.expected.due_at_ms - (paused_at_ms + 500)) < 250
        assert abs(hold.expected.away_since_ms - paused_at_ms) < 250
        assert hold.expected.spread == pytest.approx(controller.orchestrator.predictor.params.default_sigma)
        assert hold.expires_at_ms > hold.expected.due_at_ms + 250

        turn2 = history + [200, 201, 202]  # the tool's result
        out2, final2 = await client.complete(namespace, turn2, GREEDY, session_id="s-park")
        assert final2.usage.promoted_tokens == 0
        assert final2.usage.cached_tokens == len(keys) * PAGE_SIZE
        oracle = load_hf(checkpoint)
        assert out1 == greedy_oracle(oracle, prompt, len(out1))
        assert out2 == greedy_oracle(oracle, turn2, len(out2))

        stats = controller.orchestrator.stats
        assert (stats.num_demoted, stats.num_on_time, stats.num_late, stats.num_wasted) == (1, 1, 0, 0)
        assert stats.on_time_bytes == 4 * worker.engine.pool.geometry.page_bytes
        assert stats.num_errors == 1 and stats.mean_abs_error_ms < 2_000
        record = await controller.orchestrator.store.get("s-park")
        assert record.state is SessionState.ACTIVE and record.parked_tier is None
        # The measured pause went into the predictor's history of (tenant, tool).
        assert controller.orchestrator.predictor.history(namespace.tenant, "search").num_observations == 1
        assert (await worker.loop.check_integrity()).is_ok


@in_module_loop
async def test_returning_promotes_at_once_and_end_cancels_and_frees(worker, flushed_redis_url, tmp_path):
    namespace = worker.engine.namespace
    async with cluster(worker, flushed_redis_url, tmp_path) as (controller, client):
        orchestrator = controller.orchestrator
        # Returning: a long predicted pause, then the tool comes back early.
        prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32]
        out, _ = await client.complete(namespace, prompt, GREEDY, session_id="s-ret")
        keys = history_keys(worker, prompt + out)
        info = await client.pause("s-ret", tool="slow", expected_ms=60_000)
        assert info.parked_tier is Tier.DRAM and tiers_of(worker, keys) == [Tier.DRAM] * len(keys)
        assert orchestrator.timers.is_scheduled(SessionKey("", "s-ret"))
        info = await client.returning("s-ret")
        assert info.state is SessionState.RESUMING and info.prefetch_at_ms is None
        assert tiers_of(worker, keys) == [Tier.HBM] * len(keys)
        assert not orchestrator.timers.is_scheduled(SessionKey("", "s-ret"))
        assert (await client.returning("s-ret")).state is SessionState.RESUMING  # idempotent

        # End with drop: the scheduled prefetch is cancelled, the session's pages leave the worker.
        prompt = [250, 240, 230, 220, 210, 205, 195, 185, 175, 165]
        out, _ = await client.complete(namespace, prompt, GREEDY, session_id="s-end")
        keys = history_keys(worker, prompt + out)
        await client.pause("s-end", tool="slow", expected_ms=60_000)
        assert orchestrator.timers.is_scheduled(SessionKey("", "s-end"))
        status = await client.status()  # s-ret is RESUMING, s-end PAUSED
        assert (status.num_active_sessions, status.num_paused_sessions, status.num_resuming_sessions) == (0, 1, 1)
        info = await client.end("s-end", drop=True)
        assert info.state is SessionState.ENDED
        assert not orchestrator.timers.is_scheduled(SessionKey("", "s-end"))
        assert tiers_of(worker, keys) == [None] * len(keys)
        assert (await client.end("s-end")).state is SessionState.ENDED  # idempotent
        assert orchestrator.stats.num_wasted == 0

        # Bad transitions name the state; unknown sessions are NOT_FOUND.
        with pytest.raises(errors.FailedPrecondition, match="ENDED"):
            await client.pause("s-end", tool="x")
        with pytest.raises(errors.FailedPrecondition, match="RESUMING"):
            await client.pause("s-ret", tool="x")
        await client.route(namespace, prompt, "s-active")
        with pytest.raises(errors.FailedPrecondition, match="ACTIVE"):
            await client.returning("s-active")
        with pytest.raises(errors.NotFound):
            await client.returning("s-nobody")
        with pytest.raises(errors.NotFound):
            await client.end("s-nobody")
        assert (await worker.loop.check_integrity()).is_ok


@in_module_loop
async def test_end_keeps_the_pages_as_ordinary_cache_entries(worker, flushed_redis_url, tmp_path):
    """End without drop: the session is forgotten (its hold released, no prefetch), and a
    re-sent history finds its pages cached; they are evictable like any unpinned page."""
    namespace = worker.engine.namespace
    async with cluster(worker, flushed_redis_url, tmp_path) as (controller, client):
        prompt = [44, 45, 46, 47, 48, 49, 50, 51, 52, 53]
        out, _ = await client.complete(namespace, prompt, GREEDY, session_id="s-keep")
        history = prompt + out
        keys = history_keys(worker, history)
        await client.pause("s-keep", tool="slow", expected_ms=60_000)
        await client.returning("s-keep")
        assert worker.loop.holds.is_held("s-keep")
        info = await client.end("s-keep")
        assert info.state is SessionState.ENDED
        assert not controller.orchestrator.timers.is_scheduled(SessionKey("", "s-keep"))
        assert tiers_of(worker, keys) == [Tier.HBM] * len(keys)
        assert not worker.loop.holds.is_held("s-keep")
        assert all(worker.engine.index.is_evictable(worker.engine.index.get(k)) for k in keys[-1:])
        # The first to go under pressure: the session's pages rank before every other idle page.
        assert all(worker.engine.index.get(k).is_expendable for k in keys)
        # The same history again, without a session: every full page is a prefix hit.
        _, final = await client.complete(namespace, history + [9], GREEDY)
        assert final.usage.cached_tokens == len(keys) * PAGE_SIZE
        assert (await worker.loop.check_integrity()).is_ok


@in_module_loop
async def test_a_pause_starts_a_session_no_route_named(worker, flushed_redis_url, tmp_path):
    """A Generate carrying a session id goes straight to the worker (no Route); the Pause after
    it starts the session instead of answering NOT_FOUND."""
    namespace = worker.engine.namespace
    async with cluster(worker, flushed_redis_url, tmp_path) as (_, client):
        await client.complete(namespace, [5, 6, 7, 8, 9], GREEDY, session_id="s-direct", worker=worker.address)
        info = await client.pause("s-direct", tool="search")
        assert info.state is SessionState.PAUSED and info.tool_name == "search"
        assert (await client.pause("s-direct", tool="search")).state is SessionState.PAUSED  # idempotent
        assert (await client.returning("s-direct")).state is SessionState.RESUMING
        assert (await client.end("s-direct")).state is SessionState.ENDED


@in_module_loop
async def test_a_long_tools_prefetch_aims_later_once_a_short_tool_shares_the_lateness_budget(
    worker, flushed_redis_url, tmp_path
):
    """With histories of a short and a long tool, once the tenant has parked sessions of both,
    the long tool's next prefetch is scheduled for a later point of its return than the first
    one (the prediction bound at 5 %), the short tool's for an earlier one: the same expected
    late share between them, spent where it saves the most HBM time."""
    namespace = worker.engine.namespace
    async with cluster(worker, flushed_redis_url, tmp_path) as (controller, client):
        orchestrator = controller.orchestrator
        predictor = orchestrator.predictor
        rng = random.Random(23)
        for tool, median_ms in (("lookup", 3_000.0), ("build", 30_000.0)):
            for _ in range(40):
                await predictor.observe(namespace.tenant, tool, math.exp(rng.gauss(math.log(median_ms), 0.4)))
        build, lookup = predictor.model(namespace.tenant, "build"), predictor.model(namespace.tenant, "lookup")
        spent = (build.cdf(build.default_aim_ms) + lookup.cdf(lookup.default_aim_ms)) / 2

        async def park(session: str, tool: str, first: int) -> float:
            """Pause a 3-page session for ``tool``; how long after the pause its prefetch fires."""
            prompt = [first + k for k in range(9)]
            await client.complete(namespace, prompt, GREEDY, session_id=session)
            info = await client.pause(session, tool=tool)
            assert info.parked_tier is Tier.DRAM and orchestrator.timers.is_scheduled(SessionKey("", session))
            return info.prefetch_at_ms - info.paused_at_ms

        at_budget = await park("s-b1", "build", 10)  # nothing parked before: every tool at 5 %
        await park("s-l1", "lookup", 30)
        later = await park("s-b2", "build", 50)
        # s-b2 aimed with one park of each in the mix (tests/test_lateness.py checks the split).
        bounds = orchestrator.params.lateness
        aims = equal_hazard_aims({"build": 1.0, "lookup": 1.0}, {"build": build, "lookup": lookup}, spent,
                                 bounds.floor, bounds.cap)
        long_aim, short_aim = aims["build"], aims["lookup"]
        assert short_aim < spent < long_aim and (long_aim + short_aim) / 2 == pytest.approx(spent, abs=1e-3)
        # Same pages, same promote time: the prefetch moved by the gap between the two aims.
        gap_ms = build.quantile_ms(long_aim) - build.default_aim_ms
        assert gap_ms > 1_000
        assert later - at_budget == pytest.approx(gap_ms, abs=5.0)
        for session in ("s-b1", "s-l1", "s-b2"):
            await client.end(session)
        assert (await worker.loop.check_integrity()).is_ok


@in_module_loop
async def test_a_route_does_not_wait_for_the_session_bookkeeping_but_the_next_pause_does(
    worker, flushed_redis_url, tmp_path
):
    """Route answers while the session's bookkeeping is held up (a slow Redis; here its lock is
    held): a resume's time to first token does not pay it. The session's next Pause waits for
    that bookkeeping, so the Route still closes the previous pause (one outcome) and the Pause
    opens a new one instead of finding the session paused already."""
    namespace = worker.engine.namespace
    async with cluster(worker, flushed_redis_url, tmp_path) as (controller, client):
        orchestrator = controller.orchestrator
        prompt = [8, 16, 32, 64, 128, 255, 17, 34, 51]
        out, _ = await client.complete(namespace, prompt, GREEDY, session_id="s-slow")
        first = await client.pause("s-slow", tool="search", expected_ms=60_000)
        assert first.state is SessionState.PAUSED
        held, release = asyncio.Event(), asyncio.Event()

        async def hold_the_session() -> None:
            async with orchestrator.serial.locked(SessionKey("", SessionId("s-slow"))):
                held.set()
                await release.wait()

        holder = asyncio.create_task(hold_the_session())
        await held.wait()
        try:
            decision = await asyncio.wait_for(client.route(namespace, prompt + out, "s-slow"), 5.0)
            assert decision.best.worker_id == worker.worker_id
            assert (await orchestrator.store.get("s-slow")).state is SessionState.PAUSED  # not yet
            pause = asyncio.create_task(client.pause("s-slow", tool="search", expected_ms=60_000))
            await asyncio.sleep(0.2)
            assert not pause.done() and not orchestrator.outcomes
        finally:
            release.set()
            await holder
        second = await pause
        assert second.state is SessionState.PAUSED and second.paused_at_ms > first.paused_at_ms
        assert [o.session_id for o in orchestrator.outcomes] == ["s-slow"]  # the first pause, closed
        await client.end("s-slow")
        await orchestrator.settled()
        assert not orchestrator.serial.num_route_tasks


# --------------------------------------------------------------------------- pure pieces


def test_a_record_holds_every_session_info_field_and_shows_a_pause_only_while_it_means_something():
    assert {f.name for f in dataclasses.fields(SessionInfo)} <= {f.name for f in dataclasses.fields(SessionRecord)}
    record = SessionRecord(
        session_id=SessionId("s"), state=SessionState.PAUSED, worker_id=WorkerId("w"), tool_name="build",
        paused_at_ms=1_000, predicted_return_at_ms=3_000, prediction_source=PredictionSource.HISTORY,
        prefetch_at_ms=2_500, parked_tier=Tier.DRAM, num_cached_tokens=64, tenant="acme",
        num_parked_pages=4, prefetch_state=PrefetchState.SCHEDULED,
    )
    assert record.info() == SessionInfo(
        SessionId("s"), SessionState.PAUSED, WorkerId("w"), "build", 1_000, 3_000, PredictionSource.HISTORY,
        2_500, Tier.DRAM, 64,
    )
    record.state, record.prefetch_state, record.predicted_return_at_ms = SessionState.ACTIVE, PrefetchState.DONE, None
    info = record.info()
    assert (info.tool_name, info.prediction_source, info.prefetch_at_ms) == (None, None, None)


def test_token_bucket_has_hysteresis():
    now = [0.0]
    bucket = TokenBucket(rate=100.0, burst=1000.0, resume_fraction=0.5, clock_s=lambda: now[0])
    assert bucket.try_take(900)
    assert not bucket.try_take(200) and bucket.is_throttled  # 100 left
    now[0] = 2.0  # 300: enough for 200, but below the resume mark (500)
    assert not bucket.try_take(200)
    now[0] = 4.0  # 500
    assert bucket.try_take(200) and not bucket.is_throttled
    bucket.take(1000)  # a prefetch always goes, into debt
    assert bucket.level < 0 and not bucket.try_take(1)


async def test_timer_queue_fires_due_callbacks_once_with_replace_and_cancel():
    now = [0.0]
    timers = TimerQueue(clock_ms=lambda: now[0])
    fired: list[str] = []

    def cb(name):
        async def run():
            fired.append(name)
        return run

    timers.schedule("a", 100, cb("a"))
    timers.schedule("b", 200, cb("b"))
    timers.schedule("c", 50, cb("c"))
    timers.schedule("a", 300, cb("a2"))  # replaces a's earlier entry
    assert timers.cancel("c") and not timers.cancel("c")
    now[0] = 250
    assert await timers.fire_due() == 1 and fired == ["b"]
    now[0] = 1000
    assert await timers.fire_due() == 1 and fired == ["b", "a2"]
    assert len(timers) == 0 and await timers.fire_due() == 0


async def test_an_ended_session_record_expires_soon_an_active_one_keeps_the_idle_ttl(redis_client):
    store = SessionStore(redis_client, ttl_s=3600)
    active = SessionRecord(session_id=SessionId("s-active"), state=SessionState.ACTIVE)
    ended = SessionRecord(session_id=SessionId("s-ended"), state=SessionState.ENDED)
    await store.put(active)
    await store.put(ended)
    assert await redis_client.pttl(store_key("", SessionId("s-active"))) > ENDED_TTL_S * 1000
    assert 0 < await redis_client.pttl(store_key("", SessionId("s-ended"))) <= ENDED_TTL_S * 1000
    assert (await store.get(SessionId("s-ended"))).state is SessionState.ENDED


async def test_sessions_nobody_ends_leave_nothing_behind_in_the_orchestrator(redis_client):
    """Sessions that are never ended (a crashed agent; one abandoned while its tool runs) expire
    from Redis by the idle TTL; the orchestrator then forgets them too, and no session keeps a
    lock it is not using: a long-running controller's memory does not grow with them."""
    now = [1_000_000.0]

    async def no_worker(worker, command):  # none is registered: nothing is ever sent
        raise AssertionError(f"unexpected command {command!r}")

    orchestrator = Orchestrator(SessionStore(redis_client, ttl_s=60), ToolReturnPredictor(redis_client),
                                Registry(lease_ttl_s=10.0), no_worker, clock_ms=lambda: now[0])
    digest = NamespaceDigest(bytes(16))
    for i in range(20):
        await orchestrator.on_route(SessionId(f"s-{i}"), tenant="t", worker=None, digest=digest, num_tokens=64)
    for i in range(10):  # half of them pause (their tool never returns)
        await orchestrator.pause(PauseRequest(SessionId(f"s-{i}"), tool_name="search", expected_ms=500))
    assert not orchestrator.serial.num_locks
    assert len(orchestrator.census) == 20 and len(orchestrator._holds) == 10
    assert orchestrator.session_counts()[SessionState.PAUSED] == 10

    now[0] += 30_000  # within the TTL: one session is touched again, nothing is forgotten
    await orchestrator.on_route(SessionId("s-0"), tenant="t", worker=None, digest=digest, num_tokens=64)
    assert orchestrator.forget_idle() == 0
    now[0] += 31_000  # past the TTL for all but s-0
    assert orchestrator.forget_idle() == 19
    assert SessionKey("t", "s-0") in orchestrator.census and len(orchestrator.census) == 1
    assert not orchestrator._holds
    assert orchestrator.session_counts()[SessionState.ACTIVE] == 1 and not orchestrator.serial.num_locks

