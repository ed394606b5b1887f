"""Leader lease against a real valkey-server: acquire, renew, lose, take over, step down."""

import asyncio

from kvtier.controller.leader import LEADER_KEY, LeaderLease
from kvtier.controller.redis_connect import connect


async def test_only_one_controller_acquires_and_tokens_increase(redis_client):
    a = LeaderLease(redis_client, "ctl-a", ttl_ms=5000)
    b = LeaderLease(redis_client, "ctl-b", ttl_ms=5000)
    term = await a.try_acquire()
    assert term is not None and term.owner == "ctl-a" and term.token == 1
    assert await b.try_acquire() is None
    assert a.is_leader and not b.is_leader
    assert await b.current() == term
    assert await a.renew()
    assert await a.release()
    assert await redis_client.get(LEADER_KEY) is None
    assert (await b.try_acquire()).token == 2  # every term gets a larger fencing token


async def test_lost_lease_is_taken_over_and_the_old_holder_cannot_renew(redis_client):
    a = LeaderLease(redis_client, "ctl-a", ttl_ms=150)
    b = LeaderLease(redis_client, "ctl-b", ttl_ms=150)
    old = await a.try_acquire()
    await asyncio.sleep(0.2)  # a stalls past its TTL
    assert not a.is_leader  # its local deadline passed too
    new = await b.try_acquire()
    assert new is not None and new.token == old.token + 1
    assert not await a.renew()
    assert not await a.release()  # releasing must not delete b's lease
    assert await b.current() == new


async def test_renew_fails_after_the_key_is_replaced(redis_client):
    a = LeaderLease(redis_client, "ctl-a", ttl_ms=5000)
    await a.try_acquire()
    await redis_client.set(LEADER_KEY, "99:ctl-x", px=5000)  # e.g. an operator forced a handover
    assert not await a.renew()
    assert a.term is None


async def test_run_elects_renews_and_hands_over_on_stop(redis_client, flushed_redis_url):
    other = connect(flushed_redis_url)
    events = []

    async def elected(term):
        events.append(("elected", term.owner, term.token))

    async def deposed(term):
        events.append(("deposed", term.owner, term.token))

    a = LeaderLease(redis_client, "ctl-a", ttl_ms=300)
    b = LeaderLease(other, "ctl-b", ttl_ms=300)
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    try:
        task_a = asyncio.create_task(a.run(stop_a, on_elected=elected, on_deposed=deposed))
        for _ in range(250):  # a campaigns first (a cluster client's first call also reads the topology)
            if events:
                break
            await asyncio.sleep(0.02)
        task_b = asyncio.create_task(b.run(stop_b, on_elected=elected, on_deposed=deposed, period_ms=20))
        await asyncio.sleep(0.5)  # several TTLs: a keeps renewing, b keeps waiting
        assert events == [("elected", "ctl-a", 1)] and a.is_leader
        stop_a.set()
        await task_a  # releases the lease, so b takes over without waiting for the TTL
        for _ in range(100):
            if len(events) == 3:
                break
            await asyncio.sleep(0.02)
        assert events == [("elected", "ctl-a", 1), ("deposed", "ctl-a", 1), ("elected", "ctl-b", 2)]
        stop_b.set()
        await task_b
    finally:
        await other.aclose()


async def test_a_counter_that_lost_its_latest_increments_still_gives_a_larger_token(redis_client):
    """A Redis Cluster failover can lose the epoch's last INCR (replication is asynchronous)
    while the namespaces' fences on other primaries keep the token it gave out."""
    a = LeaderLease(redis_client, "ctl-a", ttl_ms=5000)
    b = LeaderLease(redis_client, "ctl-b", ttl_ms=5000)
    for _ in range(3):
        await a.try_acquire()
        await a.release()
    assert a.highest_token == 3
    await b.try_acquire()
    assert await a.try_acquire() is None  # a sees b's lease, token 4
    await b.release()
    await redis_client.delete("kvt:{g}:leader_epoch")  # the promoted replica never saw the INCRs
    assert (await a.try_acquire()).token == 5
    await a.release()
    await redis_client.delete("kvt:{g}:leader_epoch")
    assert (await LeaderLease(redis_client, "ctl-c").try_acquire()).token == 1  # it saw nothing
