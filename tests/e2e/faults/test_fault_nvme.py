"""NVMe faults on a live stack: a corrupted page, a slow disk, a write torn by a crash, and a
full disk (ENOSPC / EFBIG).

Pages reach NVMe the way the orchestrator sends them: a ``Demote`` command from the
controller down the worker's WorkerLink. Faults hit the real slot files (format in
``kvtier.tiers.nvme.format``): bytes are flipped or zeroed on disk, the disk is slowed by wrapping
the pool's positional I/O (a fake of the device, not of kvtier), and the disk fills up
through a file size limit (RLIMIT_FSIZE) set inside a worker process (a full tmpfs would
need root). After each: the oracle, no leaked page, bounded calls, a converged directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import pytest_asyncio
import redis
from fault_harness import (
    HEARTBEAT_S,
    LEASE_TTL_S,
    PAGE_SIZE,
    Expected,
    ProcessWorker,
    assert_converged,
    assert_no_leak,
    cancel_leftovers,
    complete_checked,
    complete_slots,
    flip_payload_byte,
    greedy,
    prompts,
    redis_reader,
    start_local_worker,
    stats_pages,
    stop_controller,
    tear_payload,
    within,
    worker_args,
)

from kvtier.client import AsyncClient
from kvtier.controller.server import serve_controller
from kvtier.domain.errors import DeadlineExceeded
from kvtier.domain.hashing import namespace_digest, page_keys
from kvtier.domain.records import DemoteCommand, WorkerId
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine
from kvtier.runtime.config import ControllerConfig
from kvtier.tiers.manager import TierConfig
from kvtier.tiers.nvme import format as nvme_format
from kvtier.tiers.nvme import io as nvme_io

pytestmark = pytest.mark.asyncio(loop_scope="module")
STEPS = 6
# A worker process that fills its disk: the phases of `python -m kvtier.worker`, then a file
# size limit below the first NVMe slot, so every page write fails with EFBIG (SIGXFSZ ignored).
DISK_FULL_WORKER = """
import resource, signal, sys, threading
from kvtier.worker.actor import WorkerActor, worker_args
limit, argv = int(sys.argv[1]), sys.argv[2:]
args = worker_args(argv)
worker = WorkerActor(args.config, worker_id=args.worker_id, heartbeat_interval_s=args.heartbeat_interval_s)
worker.init_device(); worker.load_model(); worker.allocate_pools()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
address = worker.serve()
print(f"kvtier worker {worker.worker_id} serving on {address}", file=sys.stderr, flush=True)
threading.Event().wait()
"""


@dataclasses.dataclass
class NvmeStack:
    controller: object
    local: object
    torn: ProcessWorker
    full: ProcessWorker
    client: AsyncClient
    reader: object
    root: object

    @property
    def namespace(self):
        return self.local.engine.namespace

    def ns(self, tenant):
        return dataclasses.replace(self.namespace, tenant=tenant)

    async def demote(self, worker_id: str, tenant: str, prompt: list[int]):
        """Send every full page of ``prompt`` (and what hangs below) to NVMe; the command's ack."""
        digest = namespace_digest(self.ns(tenant))
        first = page_keys(digest, prompt, PAGE_SIZE)[:1]
        command = DemoteCommand(namespace_digest=digest, page_keys=tuple(first), target_tier=Tier.NVME)
        return await within(self.controller.send_command(WorkerId(worker_id), command), 30, "a Demote command")

    async def check(self, tenant: str, *, local: bool = False, proc: ProcessWorker | None = None) -> None:
        digest = namespace_digest(self.ns(tenant))
        if local:
            await assert_no_leak(self.client, self.local.address)
            await assert_converged(self.reader, lambda: _expected(self.local), digests=[digest])
        if proc is not None:
            await assert_no_leak(self.client, proc.address)

            async def expected():
                return [Expected(proc.worker_id, num_pages=await stats_pages(self.client, proc.address))]

            await assert_converged(self.reader, expected, digests=[digest])


async def _expected(worker):
    return [await worker.expected()]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(fault_checkpoint, redis_url, tmp_path_factory):
    flush = redis.Redis.from_url(redis_url)
    flush.flushdb()
    flush.close()
    root = tmp_path_factory.mktemp("nvme-faults")
    config = ControllerConfig(port=0, state_dir=root, lease_ttl_s=LEASE_TTL_S, heartbeat_interval_s=HEARTBEAT_S)
    controller = await serve_controller(config, redis_url=redis_url, controller_id="ctl-nvme")

    def process(worker_id, **kwargs):
        args = worker_args(fault_checkpoint, controller.address, worker_id, root / worker_id, hbm_pages=64,
                           nvme_pages=64, nvme_dir=root / f"nvme-{worker_id}")
        return ProcessWorker(worker_id, args, root / f"{worker_id}.log", **kwargs)

    torn = process("w-torn")
    full = process("w-full", script=DISK_FULL_WORKER)
    full.args = [str(2 * nvme_format.ALIGN), *full.args]  # the file superblock fits, no slot does
    torn.start()
    full.start()
    tiers = TierConfig(nvme_slots=128, nvme_dir=root / "nvme-local")
    engine = Engine.from_pretrained(fault_checkpoint, page_size=PAGE_SIZE, num_pages=64, tier_config=tiers)
    local = await start_local_worker(engine, controller.address, "w-nvme")
    await torn.wait_serving()
    await full.wait_serving()
    client = AsyncClient(controller.address, timeout_s=30)
    reader_client, reader = await redis_reader(redis_url)
    s = NvmeStack(controller, local, torn, full, client, reader, root)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while len(controller.registry.live_workers()) < 3:
        assert loop.time() < deadline, f"workers never registered: {torn.log_tail()} {full.log_tail()}"
        await asyncio.sleep(0.1)
    yield s
    await client.close()
    torn.stop()
    full.stop()
    await local.stop()
    await stop_controller(controller)
    await reader_client.aclose()
    await cancel_leftovers()


async def test_a_corrupted_nvme_page_is_never_used_and_the_prefix_is_recomputed(stack, oracle):
    ns = stack.ns("corrupt")
    base = prompts(1, 21, seed=20)[0]  # 5 full pages
    await complete_checked(stack.client, oracle, ns, base, STEPS, worker=stack.local.address)
    ack = await stack.demote("w-nvme", "corrupt", base)
    assert ack.error_code is None and ack.num_pages >= 5, ack
    slots = complete_slots(stack.root / "nvme-local")
    digest = namespace_digest(ns)
    keys = page_keys(digest, base, PAGE_SIZE)
    on_disk = {slot.page_key: slot for slot in slots}
    assert set(keys) <= set(on_disk), "the demoted pages are in complete slots on disk"
    flip_payload_byte(on_disk[keys[2]])  # the third page rots on the device
    failures = stack.local.engine.tiers.counters.checksum_failures

    _, final = await complete_checked(stack.client, oracle, ns, base[:20] + [7, 7], STEPS,
                                      worker=stack.local.address)
    assert stack.local.engine.tiers.counters.checksum_failures == failures + 1
    assert final.usage.cached_tokens == 2 * PAGE_SIZE, "only the pages above the bad one are reused"
    assert final.usage.promoted_tokens == 2 * PAGE_SIZE
    await stack.check("corrupt", local=True)


async def test_a_slow_disk_delays_promotions_but_every_answer_is_right_and_in_time(stack, oracle, monkeypatch):
    ns = stack.ns("slow")
    slow_prefix, fast_prompt = prompts(1, 17, seed=21)[0], prompts(1, 9, seed=22)[0]
    await complete_checked(stack.client, oracle, ns, slow_prefix, STEPS, worker=stack.local.address)
    read, write = nvme_io.preadv_all, nvme_io.pwritev_all
    num_slow_ios = 0

    def slow(io):
        def wrapped(*args):
            nonlocal num_slow_ios
            num_slow_ios += 1
            time.sleep(0.4)  # per call: a device that takes 400 ms per I/O
            return io(*args)

        return wrapped

    monkeypatch.setattr(nvme_io, "preadv_all", slow(read))
    monkeypatch.setattr(nvme_io, "pwritev_all", slow(write))
    ack = await stack.demote("w-nvme", "slow", slow_prefix)
    assert ack.error_code is None and ack.num_pages >= 4, ack

    # A caller whose deadline is shorter than the promotion gives up in time, cleanly...
    impatient = stack.client.complete(ns, slow_prefix[:16] + [1, 2], greedy(STEPS), deadline_s=0.2,
                                      worker=stack.local.address)
    with pytest.raises(DeadlineExceeded):
        await within(impatient, 0.2, "a generation waiting on a slow promotion")
    # ... and patient ones, with and without a slow promotion, get the oracle's tokens.
    results = await asyncio.gather(
        complete_checked(stack.client, oracle, ns, slow_prefix[:16] + [3, 4], STEPS, deadline_s=60,
                         worker=stack.local.address),
        complete_checked(stack.client, oracle, ns, fast_prompt, STEPS, deadline_s=60, worker=stack.local.address),
    )
    assert results[0][1].usage.cached_tokens == 16
    assert num_slow_ios > 0, "the promotions went through the slow disk"
    monkeypatch.undo()
    await stack.check("slow", local=True)


async def test_a_write_torn_by_a_crash_is_discarded_at_restart(stack, oracle):
    ns = stack.ns("torn")
    digest = namespace_digest(ns)
    bases = prompts(3, 13, seed=23)  # each leaves 4 full pages (13 + 6 tokens, K/V for 18)
    for base in bases:
        await complete_checked(stack.client, oracle, ns, base, STEPS, worker=stack.torn.address)
        ack = await stack.demote("w-torn", "torn", base)
        assert ack.error_code is None and ack.num_pages == 4, ack
    stack.torn.kill()  # the worker dies; its last write may be torn
    chains = {tuple(page_keys(digest, b, PAGE_SIZE)): b for b in bases}
    slots = {s.page_key: s for s in complete_slots(stack.root / "nvme-w-torn")}
    torn_chain, torn_base = next(iter(chains.items()))
    tear_payload(slots[torn_chain[1]])  # the second page of the first prompt is torn

    stack.torn.start()  # same worker id, same NVMe directory
    await stack.torn.wait_serving()

    async def recovered():
        await stack.reader.refresh_workers(revive=True)
        depths = []
        for chain in chains:
            match = [m for m in (await stack.reader.lookup(digest, list(chain))).matches if m.worker == "w-torn"]
            depths.append(bytes(match[0].tiers) if match else b"")
        return depths

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    # The prompts' own full pages (3 of each chain's 4): only the first page of the torn chain.
    while (depths := await recovered()) != [bytes([Tier.NVME]), *[bytes([Tier.NVME] * 3)] * 2]:
        assert loop.time() < deadline, f"the recovered pages never reached the directory: {depths}"
        await asyncio.sleep(0.1)
    # The torn page and everything below it were discarded; the rest came back from disk.
    for chain, base in chains.items():
        _, final = await complete_checked(stack.client, oracle, ns, base, STEPS, worker=stack.torn.address)
        assert final.usage.promoted_tokens == (PAGE_SIZE if chain == torn_chain else 3 * PAGE_SIZE)
    await stack.check("torn", proc=stack.torn)


async def test_a_full_disk_drops_pages_instead_and_keeps_serving(stack, oracle):
    ns = stack.ns("full")
    bases = prompts(3, 13, seed=24)
    for base in bases:
        await complete_checked(stack.client, oracle, ns, base, STEPS, worker=stack.full.address)
    acks = [await stack.demote("w-full", "full", base) for base in bases]
    assert sum(a.num_pages for a in acks) == 0, f"nothing fits on a full disk: {acks}"
    assert not complete_slots(stack.root / "nvme-w-full")
    for base in bases:
        await complete_checked(stack.client, oracle, ns, base[:12] + [5], STEPS, worker=stack.full.address)
    await stack.check("full", proc=stack.full)
    assert stack.full.process.poll() is None, "a full disk never takes the worker down"
