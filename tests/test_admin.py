"""Admin RPCs over real gRPC on loopback against a real controller (real valkey-server) and two
real workers (tiny random-weight checkpoint, ``serve_worker`` + ``WorkerLink``).

Covered: SetPolicy refuses bad input with INVALID_ARGUMENT naming the field and keeps working;
a policy changes how Route ranks (and a rollback restores it), its versions show in
GetPolicy/PolicyHistory/Status, and a standby follows the stored version while refusing the
leader-only RPCs; ListWorkers; Drain takes a worker out of Route, makes it refuse requests and
empties its cache, Resume brings it back; ListSessions pages return every session exactly
once; Snapshot(wait) reports the worker's whole inventory."""

from __future__ import annotations

import contextlib
import dataclasses

import grpc
import grpc.aio
import pytest
import pytest_asyncio

from kvtier.client import AsyncClient
from kvtier.domain import errors
from kvtier.domain.hashing import namespace_digest, page_keys
from kvtier.domain.records import (
    DrainRequest,
    ListSessionsRequest,
    LookupRequest,
    Policy,
    SessionState,
    SetPolicyRequest,
    SnapshotRequest,
    TokenPrefix,
    WorkerId,
    WorkerState,
)
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
from kvtier.rpc._gen import admin_pb2, admin_pb2_grpc
from kvtier.rpc.convert.admin import (
    from_proto_controller_status,
    from_proto_drain_response,
    from_proto_lookup_result,
    from_proto_session_page,
    from_proto_snapshot_result,
    from_proto_worker_list,
    to_proto_drain_request,
    to_proto_list_sessions_request,
    to_proto_lookup_request,
    to_proto_snapshot_request,
)
from kvtier.rpc.convert.policy import (
    from_proto_get_policy_response,
    from_proto_policy_history,
    from_proto_rollback_policy_response,
    from_proto_set_policy_response,
    to_proto_set_policy_request,
)
from kvtier.rpc.status import FIELD_METADATA_KEY
from kvtier.worker.servicer import serve_worker

from live_controller import controller_at, linked
from polling import eventually

in_module_loop = pytest.mark.asyncio(loop_scope="module")

PAGE_SIZE = 4
ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TINY_LLAMA_CONFIG, seed=0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def workers(checkpoint):
    servers = [
        await serve_worker(Engine.from_pretrained(checkpoint, page_size=PAGE_SIZE, num_pages=128), worker_id=w)
        for w in ("w-a", "w-b")
    ]
    yield servers
    for server in servers:
        await server.stop(0)


@contextlib.asynccontextmanager
async def admin_of(controller):
    async with grpc.aio.insecure_channel(controller.address) as channel:
        yield admin_pb2_grpc.AdminStub(channel)


async def rpc_error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


def error_field(err: grpc.aio.AioRpcError) -> str | None:
    return dict(err.trailing_metadata() or ()).get(FIELD_METADATA_KEY)


def tenant_namespace(worker, tenant):
    """A namespace of its own per test, so tests sharing the workers never see each other's pages."""
    return dataclasses.replace(worker.engine.namespace, tenant=tenant)


async def hbm_cached_pages(client, worker) -> int:
    stats = await client.worker_stats(worker.address)
    return next(t.cached_pages for t in stats.tiers if t.tier is Tier.HBM)


@in_module_loop
async def test_set_policy_refuses_bad_input_naming_the_field_and_keeps_working(workers, flushed_redis_url,
                                                                               tmp_path):
    async with controller_at(flushed_redis_url, tmp_path) as controller, admin_of(controller) as admin:
        inverted = admin_pb2.Policy(watermarks={"hbm": admin_pb2.Watermarks(high=0.5, low=0.8)})
        negative = admin_pb2.Policy(budget_bytes_per_s={"dram": 2**64 - 1})  # int64 -1 on the wire
        unknown = admin_pb2.Policy(tier_weights={"hbm": 1.0, "ssd": 0.5})
        out_of_range = admin_pb2.Policy(watermarks={"nvme": admin_pb2.Watermarks(high=1.5, low=0.5)})
        for policy, field in ((inverted, "policy.watermarks.hbm.low"),
                              (negative, "policy.budget_bytes_per_s.dram"),
                              (unknown, "policy.tier_weights.ssd"),
                              (out_of_range, "policy.watermarks.nvme.high")):
            err = await rpc_error(admin.SetPolicy(admin_pb2.SetPolicyRequest(policy=policy)))
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, field
            assert field in err.details() and error_field(err) == field
        err = await rpc_error(admin.SetPolicy(admin_pb2.SetPolicyRequest()))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and error_field(err) == "policy"

        # Nothing was stored; a good policy goes in as version 2, stale expectations fail.
        status = from_proto_controller_status(await admin.Status(admin_pb2.StatusRequest()))
        assert status.policy_version == 1
        good = dataclasses.replace(Policy.default(), tier_weights={Tier.HBM: 2.0})
        request = SetPolicyRequest(good, expected_version=1, reason="test")
        installed = from_proto_set_policy_response(
            await admin.SetPolicy(to_proto_set_policy_request(request)))
        assert (installed.version, installed.policy, installed.set_by, installed.reason) == (
            2, good, "anonymous", "test")
        err = await rpc_error(admin.SetPolicy(to_proto_set_policy_request(request)))
        assert err.code() is grpc.StatusCode.FAILED_PRECONDITION and error_field(err) == "expected_version"
        status = from_proto_controller_status(await admin.Status(admin_pb2.StatusRequest()))
        assert status.policy_version == 2

        err = await rpc_error(admin.GetPolicy(admin_pb2.GetPolicyRequest(version=7)))
        assert err.code() is grpc.StatusCode.NOT_FOUND and error_field(err) == "version"
        err = await rpc_error(admin.RollbackPolicy(admin_pb2.RollbackPolicyRequest(to_version=7)))
        assert err.code() is grpc.StatusCode.NOT_FOUND and error_field(err) == "to_version"
        err = await rpc_error(admin.PolicyHistory(admin_pb2.PolicyHistoryRequest(limit=0)))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and error_field(err) == "limit"


@in_module_loop
async def test_a_policy_changes_how_route_ranks_and_a_rollback_restores_it(workers, flushed_redis_url, tmp_path):
    _, w_b = workers
    namespace = tenant_namespace(w_b, "policy")
    prompt = list(range(100, 113))  # 3 full pages cached on w-b after one generation
    async with (
        controller_at(flushed_redis_url, tmp_path) as controller,
        linked(controller, *workers),
        AsyncClient(controller.address) as client,
        admin_of(controller) as admin,
    ):
        await client.complete(namespace, prompt, ONE_TOKEN, worker=w_b.address)

        async def ranking():
            return [w.worker_id for w in (await client.route(namespace, prompt)).workers]

        async def b_holds_the_prefix():
            decision = await client.route(namespace, prompt)
            return {w.worker_id: w.matched_tokens.hbm_tokens for w in decision.workers}.get("w-b") == 12

        await eventually(b_holds_the_prefix, what="w-b's pages in the directory")
        assert await ranking() == ["w-b", "w-a"]  # the cached prefix wins

        # Cached tokens worth nothing: the tie goes to the lower worker id.
        worthless = dataclasses.replace(Policy.default(), tier_weights={})
        installed = from_proto_set_policy_response(await admin.SetPolicy(
            to_proto_set_policy_request(SetPolicyRequest(worthless, reason="flat")))).version
        assert await ranking() == ["w-a", "w-b"]
        scores = {w.worker_id: w.score for w in (await client.route(namespace, prompt)).workers}
        assert scores["w-a"] == scores["w-b"]

        history = from_proto_policy_history(await admin.PolicyHistory(admin_pb2.PolicyHistoryRequest()))
        assert [v.version for v in history] == [installed, installed - 1] and history[0].reason == "flat"
        back = from_proto_rollback_policy_response(await admin.RollbackPolicy(
            admin_pb2.RollbackPolicyRequest(to_version=installed - 1)))
        assert back.version == installed + 1 and back.policy == history[1].policy
        assert await ranking() == ["w-b", "w-a"]
        current = from_proto_get_policy_response(await admin.GetPolicy(admin_pb2.GetPolicyRequest()))
        assert current == back


@in_module_loop
async def test_a_standby_follows_the_stored_policy_and_refuses_leader_only_rpcs(flushed_redis_url, tmp_path):
    async with (
        controller_at(flushed_redis_url, tmp_path / "leader") as leader,
        controller_at(flushed_redis_url, tmp_path / "standby") as standby,
        admin_of(leader) as leader_admin,
        admin_of(standby) as standby_admin,
    ):
        assert leader.is_leader and not standby.is_leader
        policy = dataclasses.replace(Policy.default(), tier_weights={Tier.HBM: 3.0})
        await leader_admin.SetPolicy(to_proto_set_policy_request(SetPolicyRequest(policy)))

        async def standby_version():
            return from_proto_controller_status(
                await standby_admin.Status(admin_pb2.StatusRequest())).policy_version == 2

        await eventually(standby_version, what="the standby to load version 2")
        assert standby.router.params.tier_weights == {Tier.HBM: 3.0}  # it would route with it
        got = from_proto_get_policy_response(await standby_admin.GetPolicy(admin_pb2.GetPolicyRequest()))
        assert got.version == 2 and got.policy == policy
        for call in (
            standby_admin.SetPolicy(to_proto_set_policy_request(SetPolicyRequest(policy))),
            standby_admin.RollbackPolicy(admin_pb2.RollbackPolicyRequest(to_version=1)),
            standby_admin.ListWorkers(admin_pb2.ListWorkersRequest()),
            standby_admin.Drain(admin_pb2.DrainRequest(worker_id="w-a")),
            standby_admin.Snapshot(admin_pb2.SnapshotRequest()),
        ):
            err = await rpc_error(call)
            assert err.code() is grpc.StatusCode.UNAVAILABLE and leader.address in err.details()


@in_module_loop
async def test_drain_takes_a_worker_out_empties_it_and_resume_brings_it_back(workers, flushed_redis_url,
                                                                            tmp_path):
    w_a, w_b = workers
    namespace = tenant_namespace(w_b, "drain")
    prompt = list(range(200, 217))  # 4 full pages
    keys = page_keys(namespace_digest(namespace), prompt, PAGE_SIZE)
    async with (
        controller_at(flushed_redis_url, tmp_path) as controller,
        linked(controller, *workers),
        AsyncClient(controller.address) as client,
        admin_of(controller) as admin,
    ):
        listed = from_proto_worker_list(await admin.ListWorkers(admin_pb2.ListWorkersRequest()))
        assert [(w.worker_id, w.state, w.address) for w in listed] == [
            ("w-a", WorkerState.LIVE, w_a.address), ("w-b", WorkerState.LIVE, w_b.address)]
        assert listed[1].page_size == PAGE_SIZE and listed[1].model.model_id == namespace.model_id

        await client.complete(namespace, prompt, ONE_TOKEN, worker=w_b.address)
        assert await hbm_cached_pages(client, w_b) >= 4

        async def lookup():
            return from_proto_lookup_result(await admin.Lookup(
                to_proto_lookup_request(LookupRequest(namespace, TokenPrefix(tuple(prompt))))))

        await eventually(lambda: _holds(lookup(), "w-b", 16), what="w-b's pages in the directory")

        drained = from_proto_drain_response(await admin.Drain(
            to_proto_drain_request(DrainRequest(WorkerId("w-b")))))
        assert drained.worker_id == "w-b" and drained.state is WorkerState.DRAINING
        assert [w.worker_id for w in (await client.route(namespace, prompt)).workers] == ["w-a"]
        with pytest.raises(errors.Unavailable):  # the worker itself refuses new requests
            await client.complete(namespace, prompt, ONE_TOKEN, worker=w_b.address)
        # Once idle its cache is emptied, in the worker and in the directory.
        await eventually(lambda: _zero(hbm_cached_pages(client, w_b)), what="w-b's cache to empty")
        assert all(w_b.engine.index.get(k) is None for k in keys)
        await eventually(lambda: _holds(lookup(), "w-b", 0), what="w-b's entries to leave the directory")
        assert (await client.check_integrity(w_b.address)).is_ok
        listed = from_proto_worker_list(await admin.ListWorkers(admin_pb2.ListWorkersRequest()))
        assert [w.state for w in listed] == [WorkerState.LIVE, WorkerState.DRAINING]
        # Draining again is harmless.
        again = await admin.Drain(admin_pb2.DrainRequest(worker_id="w-b"))
        assert from_proto_drain_response(again).state is WorkerState.DRAINING

        resumed = from_proto_drain_response(await admin.Drain(
            to_proto_drain_request(DrainRequest(WorkerId("w-b"), resume=True))))
        assert resumed.state is WorkerState.LIVE
        assert [w.worker_id for w in (await client.route(namespace, prompt)).workers] == ["w-a", "w-b"]
        _, final = await client.complete(namespace, prompt, ONE_TOKEN, worker=w_b.address)
        assert final.usage.cached_tokens == 0  # it admits again, with nothing left cached

        err = await rpc_error(admin.Drain(admin_pb2.DrainRequest(worker_id="w-nobody")))
        assert err.code() is grpc.StatusCode.NOT_FOUND and error_field(err) == "worker_id"
        assert "w-nobody" in err.details()
        err = await rpc_error(admin.Drain(admin_pb2.DrainRequest()))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and error_field(err) == "worker_id"


async def _holds(lookup, worker, num_tokens):
    result = await lookup
    return {m.worker_id: m.matched_tokens.hbm_tokens for m in result.matches}.get(worker, 0) == num_tokens


async def _zero(count):
    return await count == 0


@in_module_loop
async def test_list_sessions_pages_return_every_session_exactly_once(workers, flushed_redis_url, tmp_path):
    w_a, _ = workers
    namespace = tenant_namespace(w_a, "sessions")
    ids = [f"s-{i:02d}" for i in range(11)]
    async with (
        controller_at(flushed_redis_url, tmp_path) as controller,
        linked(controller, w_a),
        AsyncClient(controller.address) as client,
        admin_of(controller) as admin,
    ):
        for session in reversed(ids):  # creation order is not the listing order
            await client.route(namespace, [1, 2, 3, 4, 5], session_id=session)
        ended = set(ids[1::3])
        for session in ended:
            await client.end(session)

        async def pages(state=None, limit=None):
            seen, token, num_pages = [], "", 0
            while True:
                request = ListSessionsRequest(state=state, limit=limit or 100, page_token=token or None)
                page = from_proto_session_page(await admin.ListSessions(
                    to_proto_list_sessions_request(request)))
                seen.extend(page.sessions)
                num_pages += 1
                if not page.next_page_token:
                    return seen, num_pages
                token = page.next_page_token

        everything, num_pages = await pages(limit=3)
        assert [s.session_id for s in everything] == ids and num_pages == 4
        assert {s.session_id for s in everything if s.state is SessionState.ENDED} == ended
        only_ended, num_pages = await pages(SessionState.ENDED, limit=2)
        assert [s.session_id for s in only_ended] == sorted(ended) and num_pages == 2
        active, _ = await pages(SessionState.ACTIVE, limit=1000)
        assert [s.session_id for s in active] == [i for i in ids if i not in ended]
        assert all(s.worker_id == "w-a" for s in active)
        exact, num_pages = await pages(limit=11)  # a full last page has no next token
        assert len(exact) == 11 and num_pages == 1

        err = await rpc_error(admin.ListSessions(admin_pb2.ListSessionsRequest(page_token="not a token")))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and error_field(err) == "page_token"
        err = await rpc_error(admin.ListSessions(admin_pb2.ListSessionsRequest(limit=1001)))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and error_field(err) == "limit"


@in_module_loop
async def test_snapshot_waits_for_the_whole_inventory(workers, flushed_redis_url, tmp_path):
    w_a, w_b = workers
    namespace = tenant_namespace(w_a, "snapshot")
    async with (
        controller_at(flushed_redis_url, tmp_path) as controller,
        linked(controller, *workers),
        AsyncClient(controller.address) as client,
        admin_of(controller) as admin,
    ):
        for start in (300, 400):
            await client.complete(namespace, list(range(start, start + 9)), ONE_TOKEN, worker=w_a.address)
        applied = controller.links.counters["snapshots.applied"]
        snapshots = from_proto_snapshot_result(await admin.Snapshot(
            to_proto_snapshot_request(SnapshotRequest(wait=True))))
        assert [s.worker_id for s in snapshots] == ["w-a", "w-b"]
        assert all(s.is_complete for s in snapshots)
        assert controller.links.counters["snapshots.applied"] == applied + 2
        for snapshot, worker in zip(snapshots, workers, strict=True):
            inventory = await worker.loop.inventory()
            assert snapshot.num_pages == sum(len(inv.pages) for inv in inventory)
        assert snapshots[0].num_pages >= 4  # this test's two prompts: 2 full pages each

        one = from_proto_snapshot_result(await admin.Snapshot(
            to_proto_snapshot_request(SnapshotRequest(worker_ids=(WorkerId("w-b"),)))))
        assert [s.worker_id for s in one] == ["w-b"] and one[0].snapshot_id != snapshots[1].snapshot_id
        err = await rpc_error(admin.Snapshot(admin_pb2.SnapshotRequest(worker_ids=["w-a", "w-nobody"])))
        assert err.code() is grpc.StatusCode.NOT_FOUND and error_field(err) == "worker_id"
