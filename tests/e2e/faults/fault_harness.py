"""The fault-injection suite's harness: real processes, the oracle, and the four checks.

Every fault test ends with the same post-conditions (issue 9, item 3):

(a) ``complete_checked``: every completed generation equals the uninterrupted run's output
    (transformers' greedy tokens for the same random-weight checkpoint);
(b) ``assert_no_leak``: once idle, the worker holds no page and ``CheckIntegrity`` (every
    pool and index of the worker, over gRPC) passes;
(c) every stream is opened with a client deadline and awaited with ``within(deadline)``: a
    call that has not returned shortly after its deadline fails the test (a bounded wait,
    not a timing assertion);
(d) ``assert_converged``: the directory in Redis lists exactly what the workers hold —
    for in-process workers page by page against their inventory (every chain routable to
    its holder at its depth and tier), for worker processes by page count against their
    ``Stats`` — and nothing of workers that are gone.

Pieces: Valkey is a real ``valkey-server`` process (restartable on a fixed port), workers
run either in this process (``LocalWorker``: the engine, its gRPC server and a real
WorkerLink, so tests can read the inventory and wrap the NVMe pool's I/O) or as
``python -m kvtier.worker`` processes (``ProcessWorker``: killable), and the controller
either in this process or as ``python -m kvtier.controller``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis.asyncio as aredis
import torch

from kvtier.client import AsyncClient
from kvtier.controller.directory import Directory
from kvtier.domain.errors import NotFound, Unavailable
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.domain.records import GenerateFinal, NamespaceInventory
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.worker.link import WorkerLink
from kvtier.worker.servicer import WorkerServer, serve_worker

from valkey_fixture import free_port as free_port  # re-exported: the fault tests import them from here
from valkey_fixture import start_valkey as start_valkey

T = TypeVar("T")

PAGE_SIZE = 4
VOCAB = 512  # TINY_LLAMA_CONFIG
LEASE_TTL_S = 1.0  # short leases: a dead worker leaves the directory within ~2 s
HEARTBEAT_S = 0.25
DEADLINE_GRACE_S = 5.0  # how long after its deadline a call may take to return (event-loop slack)
CONVERGE_TIMEOUT_S = 15.0
REPO = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------- oracle


class Oracle:
    """Greedy continuations from transformers for the checkpoint every worker serves."""

    def __init__(self, checkpoint: Path) -> None:
        from hf_checkpoints import load_hf

        self.model = load_hf(checkpoint)
        self._cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, prompt: Sequence[int], steps: int) -> list[int]:
        """Argmax of a full forward pass per step (no KV cache: nothing shared with the
        engine's incremental decoding, nor with ``generate()``'s cache)."""
        key = (tuple(prompt), steps)
        if key not in self._cache:
            tokens = list(prompt)
            with torch.inference_mode():
                for _ in range(steps):
                    logits = self.model(input_ids=torch.tensor([tokens])).logits[0, -1]
                    tokens.append(int(logits.argmax()))
            self._cache[key] = tokens[len(prompt) :]
        return self._cache[key]

    async def greedy_off_loop(self, prompt: Sequence[int], steps: int) -> list[int]:
        """``greedy`` in a thread. The controllers and workers under test share the test's event
        loop and their leases are 1 s long: a forward pass run on the loop would stall their
        heartbeats and make a healthy worker or leader lapse on a loaded machine."""
        return await asyncio.to_thread(self.greedy, prompt, steps)


def prompts(n: int, length: int, seed: int, prefix: Sequence[int] = ()) -> list[list[int]]:
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(VOCAB) for _ in range(length)] for _ in range(n)]


def greedy(steps: int) -> SamplingParams:
    return SamplingParams(max_tokens=steps, ignore_eos=True)


@contextlib.contextmanager
def slowed(engine: Engine, step_s: float) -> Iterator[None]:
    """Each engine step takes ``step_s`` longer, so that a short generation (cheap for the
    oracle, which runs a full forward pass per token) is still in flight when the fault strikes."""
    step = engine.step

    def slow_step(**kwargs):
        time.sleep(step_s)
        return step(**kwargs)

    engine.step = slow_step
    try:
        yield
    finally:
        del engine.step


# --------------------------------------------------------------------------- (c) deadlines


async def routed_workers(client: AsyncClient, namespace: NamespaceIdentity, prompt: Sequence[int]) -> list[str]:
    """Ids of the workers Route offers for ``prompt``; none while no live worker serves the
    namespace (Route then fails UNAVAILABLE or NOT_FOUND, saying why)."""
    try:
        return [w.worker_id for w in (await client.route(namespace, prompt)).workers]
    except (Unavailable, NotFound):
        return []


async def within(awaitable: Awaitable[T], deadline_s: float, what: str) -> T:
    """Await a call that carries a deadline of ``deadline_s``; fail if it hangs past it."""
    try:
        return await asyncio.wait_for(awaitable, deadline_s + DEADLINE_GRACE_S)
    except TimeoutError:
        raise AssertionError(f"{what} did not return within {deadline_s:g} s (+{DEADLINE_GRACE_S:g} s grace)") from None


# --------------------------------------------------------------------------- (a) the oracle


async def complete_checked(
    client: AsyncClient,
    oracle: Oracle,
    namespace: NamespaceIdentity,
    prompt: Sequence[int],
    steps: int,
    *,
    deadline_s: float = 60.0,
    **kwargs: Any,
) -> tuple[list[int], GenerateFinal]:
    """Generate to the end (routed, unless ``worker=``) and check the tokens against the oracle."""
    tokens, final = await within(
        client.complete(namespace, prompt, greedy(steps), deadline_s=deadline_s, **kwargs), deadline_s, "a generation"
    )
    assert final.usage.generated_tokens == len(tokens) == steps
    assert tokens == await oracle.greedy_off_loop(prompt, steps), "a completed generation differs from the uninterrupted run"
    return tokens, final


# --------------------------------------------------------------------------- (b) no leak


async def assert_no_leak(client: AsyncClient, address: str, timeout_s: float = 15.0) -> None:
    """Once idle the worker at ``address`` holds no page, and every pool and index is consistent."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await client.worker_stats(address, timeout_s=10)
        in_use = sum(t.in_use_pages for t in stats.tiers)
        if in_use == 0 and stats.queue_depth == 0 and stats.num_running_seqs == 0:
            break
        assert time.monotonic() < deadline, f"{address} still holds pages when idle: {stats}"
        await asyncio.sleep(0.05)
    result = await client.check_integrity(address, timeout_s=10)
    assert result.is_ok, f"{address}: {result.problems}"
    for tier in stats.tiers:
        assert tier.free_pages + tier.cached_pages + tier.in_use_pages == tier.total_pages, tier


# --------------------------------------------------------------------------- (d) convergence


async def directory_view(reader: Directory, digests: Sequence[bytes]) -> dict[str, int]:
    """Directory entries per worker over ``digests`` (a page in two tiers counts once)."""
    counts: dict[str, int] = {}
    for digest in digests:
        stats = await reader.stats(digest)
        for worker, n in stats.entries_by_worker.items():
            counts[worker] = counts.get(worker, 0) + n
    return counts


async def _inventory_matches(reader: Directory, worker_id: str, inventories: list[NamespaceInventory]) -> str | None:
    """None when every page of the inventory is routable to the worker at its depth and fastest tier."""
    pages: dict[bytes, dict[bytes, tuple[bytes, int, Tier]]] = {}
    for inventory in inventories:
        by_key = pages.setdefault(inventory.namespace_digest, {})
        for page in inventory.pages:
            old = by_key.get(page.page_key)
            tier = inventory.tier if old is None else min(old[2], inventory.tier)
            by_key[page.page_key] = (page.parent_key, page.depth, tier)
    for digest, by_key in pages.items():
        parents = {parent for parent, _, _ in by_key.values()}
        for leaf in (key for key in by_key if key not in parents):  # a leaf's chain covers its ancestors
            chain = [leaf]
            while len(chain) < by_key[leaf][1]:
                parent = by_key[chain[-1]][0]
                if parent not in by_key:
                    return f"{worker_id} holds a page whose parent it does not hold (an orphan)"
                chain.append(parent)
            chain.reverse()
            result = await reader.lookup(digest, chain)
            mine = [m for m in result.matches if m.worker == worker_id]
            want = bytes(by_key[k][2] for k in chain)
            got = bytes(mine[0].tiers) if mine else b""
            if got != want:
                return f"{worker_id}: a chain of depth {len(chain)} is listed in tiers {list(got)}, held in {list(want)}"
    return None


@dataclass
class Expected:
    """What the directory should list for one worker: its inventory (in-process workers) or
    just its page count (worker processes, from Stats)."""

    worker_id: str
    inventories: list[NamespaceInventory] | None = None
    num_pages: int | None = None


async def assert_converged(
    reader: Directory,
    expected: Callable[[], Awaitable[list[Expected]]],
    *,
    digests: Sequence[bytes] = (),
    gone: Sequence[str] = (),
    timeout_s: float = CONVERGE_TIMEOUT_S,
) -> None:
    """Wait (bounded) until the directory lists exactly what every worker holds, and nothing of
    ``gone`` workers. ``expected`` is re-read while waiting (page events are still landing);
    directory entries are counted over the inventories' namespaces and ``digests``."""
    deadline = time.monotonic() + timeout_s
    problem = "not checked"
    while time.monotonic() < deadline:
        await reader.refresh_workers(revive=True)
        wanted = await expected()
        all_digests = {inv.namespace_digest for e in wanted for inv in (e.inventories or ())} | set(digests)
        problem = await _converged_problem(reader, wanted, sorted(all_digests), gone)
        if problem is None:
            for digest in all_digests:
                await reader.check_integrity(digest)
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the directory did not converge to the workers' inventories in {timeout_s:g} s: {problem}")


async def _converged_problem(reader: Directory, wanted: Sequence[Expected], digests: list[bytes], gone) -> str | None:
    counts = await directory_view(reader, digests)
    held = [e for e in wanted if e.num_pages or any(inv.pages for inv in e.inventories or ())]
    if not held:
        return "no worker holds a page: nothing to compare (a test bug)"
    for worker in gone:
        if counts.get(worker):
            return f"{worker} is gone but still holds {counts[worker]} directory entries"
    for e in wanted:
        if e.inventories is not None:
            held = len({(inv.namespace_digest, p.page_key) for inv in e.inventories for p in inv.pages})
            if counts.get(e.worker_id, 0) != held:
                return f"{e.worker_id}: the directory lists {counts.get(e.worker_id, 0)} pages, it holds {held}"
            problem = await _inventory_matches(reader, e.worker_id, e.inventories)
            if problem is not None:
                return problem
        elif e.num_pages is not None and counts.get(e.worker_id, 0) != e.num_pages:
            return f"{e.worker_id}: the directory lists {counts.get(e.worker_id, 0)} pages, it holds {e.num_pages}"
    return None


async def stats_pages(client: AsyncClient, address: str) -> int:
    """Pages a worker process holds in any tier (cached or in use), from its Stats."""
    stats = await client.worker_stats(address, timeout_s=10)
    return sum(t.cached_pages + t.in_use_pages for t in stats.tiers)


# --------------------------------------------------------------------------- processes


@dataclass
class LocalWorker:
    """A worker in this process: engine thread, gRPC server, WorkerLink to the controller."""

    server: WorkerServer
    link: WorkerLink

    @property
    def worker_id(self) -> str:
        return self.server.worker_id

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def engine(self) -> Engine:
        return self.server.engine

    async def inventory(self) -> list[NamespaceInventory]:
        return await self.server.loop.inventory()

    async def expected(self) -> Expected:
        return Expected(self.worker_id, inventories=await self.inventory())

    async def stop(self) -> None:
        """Stop as a process exit would: link, server, engine thread, then the pools (the NVMe
        directory lock is released for the next worker)."""
        await bounded_teardown(self.link.stop(), "worker link stop")
        await bounded_teardown(self.server.stop(0), "worker server stop")
        self.engine.close()


async def start_local_worker(
    engine: Engine,
    controller_address: str,
    worker_id: str,
    *,
    server_options: dict[str, Any] | None = None,
    **link_options: Any,
) -> LocalWorker:
    # The link's token also answers the controller's address proof (with authentication on).
    server_options = {"identity_token": link_options.get("token"), **(server_options or {})}
    server = await serve_worker(engine, worker_id=worker_id, **server_options)
    options = dict(heartbeat_interval_s=HEARTBEAT_S, batch_interval_s=0.02, max_backoff_s=0.2)
    options.update(link_options)
    link = WorkerLink(
        server.loop,
        controller_address=controller_address,
        worker_id=server.worker_id,
        address=server.address,
        boot_id=server.boot_id,
        tickets=server.tickets,
        **options,
    )
    link.start()
    return LocalWorker(server, link)


@dataclass
class ProcessWorker:
    """``python -m kvtier.worker`` (or ``script`` run with the same flags) in its own process."""

    worker_id: str
    args: list[str]
    log_path: Path
    script: str | None = None
    process: subprocess.Popen | None = None
    address: str | None = None
    _log: Any = field(default=None, repr=False)
    _log_offset: int = 0

    def start(self) -> None:
        """Start the process. Its output reaches the log through a pipe this process drains, so
        a file size limit set inside the worker (RLIMIT_FSIZE) never applies to its log."""
        command = [sys.executable, "-c", self.script, *self.args] if self.script else [
            sys.executable, "-m", "kvtier.worker", *self.args]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop/kill)
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)},
        )
        threading.Thread(target=_copy, args=(self.process.stdout, self._log), daemon=True).start()
        self.address = None
        self._log_offset = self.log_path.stat().st_size  # a restart appends: read only what follows

    async def wait_serving(self, timeout_s: float = 90.0) -> str:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        pattern = re.compile(rf"kvtier worker {re.escape(self.worker_id)} serving on (\S+)")
        while True:
            matches = pattern.findall(self.log_path.read_bytes()[self._log_offset :].decode(errors="replace"))
            if matches:
                self.address = matches[-1]
                return self.address
            assert self.process.poll() is None, f"worker {self.worker_id} exited: {self.log_tail()}"
            assert time.monotonic() < deadline, f"worker {self.worker_id} did not start: {self.log_tail()}"
            await asyncio.sleep(0.1)

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def kill(self) -> None:
        """SIGKILL: no goodbye to the controller, no flush."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self._close_log()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        self._log = None  # the copying thread closes it at the pipe's end


def _copy(pipe: Any, log: Any) -> None:
    with pipe, log:
        for line in pipe:
            log.write(line)
            log.flush()


def worker_args(
    checkpoint: Path,
    controller_address: str,
    worker_id: str,
    state_dir: Path,
    *,
    hbm_pages: int = 256,
    dram_pages: int = 0,
    nvme_pages: int = 0,
    nvme_dir: Path | None = None,
) -> list[str]:
    from kvtier.tiers.nvme.format import slot_bytes_for

    geometry = page_geometry()
    args = [
        "--model", str(checkpoint), "--controller", controller_address, "--worker-id", worker_id,
        "--device", "cpu", "--block-size", str(PAGE_SIZE), "--state-dir", str(state_dir),
        "--hbm-bytes", str(hbm_pages * geometry.page_bytes), "--dram-bytes", str(dram_pages * geometry.page_bytes),
        "--heartbeat-interval-s", str(HEARTBEAT_S),
    ]
    if nvme_pages:
        args += ["--nvme-bytes", str(nvme_pages * slot_bytes_for(geometry)), "--nvme-dir", str(nvme_dir)]
    return args


def page_geometry():
    from kvtier.cache.page_pool import PoolGeometry
    from kvtier.engine.model.loader import TINY_LLAMA_CONFIG

    c = TINY_LLAMA_CONFIG
    return PoolGeometry(c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"], PAGE_SIZE, torch.float32)


# --------------------------------------------------------------------------- NVMe files


@dataclass(frozen=True)
class SlotOnDisk:
    """A slot holding a complete page, found by reading the slot files (format: kvtier.tiers.nvme.format)."""

    path: Path
    offset: int  # of the slot's payload
    page_key: bytes


def complete_slots(nvme_dir: Path) -> list[SlotOnDisk]:
    from kvtier.tiers.nvme.format import ALIGN, HEADER_BYTES, SlotState, group_layout

    layout = group_layout(page_geometry())
    found = []
    for path in sorted(nvme_dir.glob("slots-*.kvt")):
        with open(path, "rb") as f:
            size = path.stat().st_size
            for block in range(ALIGN, size - HEADER_BYTES + 1, layout.group_bytes):
                for j in range(layout.slots_per_group):
                    payload = block + HEADER_BYTES + j * layout.payload_bytes
                    if payload + layout.payload_bytes > size:
                        break
                    f.seek(block + j * layout.record_bytes)
                    header = f.read(64)
                    state = int.from_bytes(header[10:12], "little")
                    if header[:8] == b"KVTSLOT\0" and state == SlotState.COMPLETE:
                        found.append(SlotOnDisk(path, payload, header[48:64]))
    assert all(s.offset % ALIGN == 0 for s in found)
    return found


def flip_payload_byte(slot: SlotOnDisk, at: int = 100) -> None:
    """One bit of the page's bytes flips on the device: the header still claims the old checksum."""
    with open(slot.path, "r+b") as f:
        f.seek(slot.offset + at)
        byte = f.read(1)
        f.seek(slot.offset + at)
        f.write(bytes([byte[0] ^ 0x01]))


def tear_payload(slot: SlotOnDisk) -> None:
    """A write torn by a crash: the header went out complete, the second half of the page did not."""
    page_bytes = page_geometry().page_bytes
    with open(slot.path, "r+b") as f:
        f.seek(slot.offset + page_bytes // 2)
        f.write(bytes(page_bytes - page_bytes // 2))


# --------------------------------------------------------------------------- controller


async def redis_reader(url: str) -> tuple[aredis.Redis, Directory]:
    """A read-only view of the directory; reconnects by itself after a Redis restart."""
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    client = aredis.Redis.from_url(
        url, retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 5), retry_on_error=[RedisConnectionError]
    )
    return client, Directory(client, fence_token=None)


async def bounded_teardown(awaitable: Any, what: str, timeout_s: float = 20.0) -> None:
    """Await a teardown step, but never for longer than ``timeout_s``: gRPC's asyncio server
    can wait forever on its poller thread during shutdown (grpc/grpc#40989), and one stuck
    teardown must not eat the test timeout of the rest of the session. Tests assert their
    post-conditions before teardown, so nothing they check is skipped."""
    try:
        await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        logging.getLogger("tests.faults").warning("teardown step %r took over %.0f s; left behind", what, timeout_s)


async def stop_controller(controller: Any) -> None:
    await bounded_teardown(controller.stop(0), "controller stop")


async def cancel_leftovers() -> None:
    """Cancel the tasks a stopped stack left on this loop (gRPC reads, link retries)."""
    current = asyncio.current_task()
    leftovers = [t for t in asyncio.all_tasks() if t is not current]
    for task in leftovers:
        task.cancel()
    with contextlib.suppress(Exception):
        await bounded_teardown(asyncio.gather(*leftovers, return_exceptions=True), "leftover tasks")
