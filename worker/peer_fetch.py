"""Peer fetch: bring a prompt's pages from the worker that holds them into this worker's tiers.

    Generate with a fetch plan: the request waits outside the engine (``Admission.wait_for_fetch``)
    while, on the asyncio side, PeerFetcher.fetch(identity, prompt, peer, deadline)
        keys of the prompt's full pages; those cached here already are not asked for
        one fetch of a prefix at a time: a concurrent one waits, then asks for what is missing
        per group of FETCH_GROUP_PAGES, GROUPS_IN_FLIGHT at a time:
          transport.pull(peer, ExportRequest) ──► peer: PeerExporter.export (auth, namespace)
          verify_group (a thread)                    engine thread: copy_pages; a thread: seal_group
          engine thread: install_pages → page events → the directory lists both holders
    then the request is admitted as usual: the installed pages are prefix hits. The engine
    keeps stepping throughout; the holder's engine thread only copies the bytes.

A fetch never fails a request. When the peer is gone, refuses, is slower than the deadline, or
a page fails its checksum, the fetch ends with what was verified and installed (often nothing)
and the request recomputes the rest: ``FetchOutcome.problem`` says why, for logs and tests.

The transport is chosen by measurement (decision 0018): ``RayTransport`` pulls the page group
from the holder actor's return value through the Ray object store (one plasma object per
group, pulled in chunks by the receiving node); ``LocalTransport`` calls an exporter in the
same process. Each fetch updates the measured rates the cost model reads
(``kvtier.worker.costs.PeerRates``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.domain.errors import KvtierError, PermissionDenied, Unauthenticated
from kvtier.domain.hashing import NamespaceDigest, NamespaceIdentity, PageKey, page_keys, root_key, short
from kvtier.domain.records import CommandAck, CommandId, FetchCommand, GenerateRequest
from kvtier.rpc.auth import Role, TokenTable, TokenTableFile
from kvtier.runtime.log import get_logger
from kvtier.worker.engine_loop import EngineLoop
from kvtier.worker.peer_pages import (
    MAX_EXPORT_PAGES,
    ExportRequest,
    Installed,
    PageGroup,
    RankRequest,
    copy_pages,
    install_pages,
    rank_chains,
    seal_group,
    verify_group,
)

log = get_logger("kvtier.worker.peer_fetch")

# A fetch takes at most this share of the request's remaining deadline (the rest is left for
# recomputing, should the fetch fail), and at most MAX_FETCH_S without a deadline.
FETCH_DEADLINE_SHARE = 0.5
MAX_FETCH_S = 10.0
# A controller's FetchCommand (drain migration, pin replicas) has no request deadline: each
# group of at most MAX_EXPORT_PAGES pages gets this long.
COMMAND_FETCH_TIMEOUT_S = 60.0
# A fetch asks the peer for groups of at most this many pages, at most GROUPS_IN_FLIGHT at a
# time: the receiver verifies and installs one group while the next is exported and pulled.
FETCH_GROUP_PAGES = 64
GROUPS_IN_FLIGHT = 2


class PeerExporter:
    """The holder's side: exports page groups to authenticated workers only.

    With ``tokens`` the request's credential must be a token of the worker role; without
    (authentication off, loopback deployments) every request is served, as every other call
    of this worker is."""

    def __init__(self, loop: EngineLoop, tokens: TokenTable | TokenTableFile | None = None, *,
                 link_bytes_per_s: float | None = None) -> None:
        self._loop = loop
        self._tokens = tokens
        # An emulated network link (WorkerConfig.emulated_peer_link_bytes_per_s): a group is handed
        # over no sooner than bytes / rate after the export started.
        self._link_bytes_per_s = link_bytes_per_s
        self.num_exported_pages = 0

    def authorize(self, request: ExportRequest | RankRequest) -> None:
        if self._tokens is None:
            return
        principal = self._tokens.authenticate(request.credential or "") if request.credential else None
        if principal is None:
            raise Unauthenticated("a page export needs the bearer token of a worker (its auth_token_file)")
        if principal.role is not Role.WORKER:
            raise PermissionDenied(f"role {principal.role} may not fetch pages; only workers may", field="role")

    async def export(self, request: ExportRequest) -> PageGroup:
        self.authorize(request)
        started = time.perf_counter()
        # The bytes are copied on the engine thread, which owns them; their checksums are taken
        # off it, so the holder's running sequences wait only for the copy.
        copied, stored = await self._loop.call(lambda: copy_pages(self._loop.engine, self._loop.page_events, request))
        group = await asyncio.to_thread(seal_group, copied, stored)
        if self._link_bytes_per_s:
            await asyncio.sleep(max(0.0, group.num_bytes / self._link_bytes_per_s - (time.perf_counter() - started)))
        self.num_exported_pages += group.num_pages
        return group

    async def rank(self, request: RankRequest) -> list[tuple[PageKey, ...]]:
        """The chains of the namespace's most valuable pages (``rank_chains``): keys only."""
        self.authorize(request)
        return await self._loop.call(lambda: rank_chains(self._loop.engine, self._loop.page_events, request))


@dataclass(frozen=True, slots=True)
class PeerOptions:
    """How a worker server fetches from peers and exports to them (``serve_worker``)."""

    transport: PeerTransport | None = None  # None: peers in this process only
    credential: str | None = None  # this worker's bearer token, sent with each fetch
    link_bytes_per_s: float | None = None  # emulated network link of the exports


class PeerTransport(Protocol):
    async def pull(self, peer: str, request: ExportRequest) -> PageGroup: ...

    async def rank(self, peer: str, request: RankRequest) -> list[tuple[PageKey, ...]]: ...


class LocalTransport:
    """Exporters of the same process, by worker id (in-process deployments and tests)."""

    def __init__(self, exporters: Mapping[str, PeerExporter]) -> None:
        self.exporters = exporters

    async def pull(self, peer: str, request: ExportRequest) -> PageGroup:
        exporter = self.exporters.get(peer)
        if exporter is None:
            raise ConnectionError(f"no worker {peer!r} in this process")
        return await exporter.export(request)

    async def rank(self, peer: str, request: RankRequest) -> list[tuple[PageKey, ...]]:
        exporter = self.exporters.get(peer)
        if exporter is None:
            raise ConnectionError(f"no worker {peer!r} in this process")
        return await exporter.rank(request)


class RayTransport:
    """The holder is a Ray actor named ``peer`` (``start_worker_actor(name=worker_id)``); its
    ``export_pages`` return value is the page group in the object store, pulled from there."""

    def __init__(self, namespace: str | None = None) -> None:
        self._namespace = namespace

    async def pull(self, peer: str, request: ExportRequest) -> PageGroup:
        import ray

        actor = ray.get_actor(peer, namespace=self._namespace)
        group: PageGroup = await actor.export_pages.remote(request)
        return group

    async def rank(self, peer: str, request: RankRequest) -> list[tuple[PageKey, ...]]:
        import ray

        actor = ray.get_actor(peer, namespace=self._namespace)
        chains: list[tuple[PageKey, ...]] = await actor.rank_pages.remote(request)
        return chains


@dataclass(frozen=True, slots=True)
class FetchOutcome:
    num_requested: int  # pages asked of the peer
    num_installed: int  # pages inserted here
    num_bytes: int  # received
    elapsed_s: float
    problem: str | None = None  # why fewer pages than asked were installed; None: all were


@dataclass(slots=True, eq=False)
class _Flight:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    num_users: int = 0  # fetches waiting for the lock


class PeerFetcher:
    """The receiver's side. ``credential``: this worker's bearer token, sent with each export."""

    def __init__(self, loop: EngineLoop, transport: PeerTransport, *, credential: str | None = None,
                 worker_id: str | None = None) -> None:
        self._loop = loop
        self._transport = transport
        self._credential = credential
        self._worker_id = worker_id  # a plan naming this worker fetches nothing
        self.rates = loop.costs.fetch  # what the cost model reads (``kvtier.worker.costs``)
        self._flights: dict[PageKey, _Flight] = {}  # fetches of a prefix in progress, by its first page
        self.num_fetches = 0
        self.num_failed = 0
        self.num_fetched_bytes = 0

    @property
    def is_draining(self) -> bool:
        return self._loop.is_draining

    async def fetch(self, identity: NamespaceIdentity, prompt: Sequence[int], peer: str, *,
                    timeout_s: float, num_pages: int | None = None) -> FetchOutcome:
        """Fetch from ``peer`` the prompt's full pages, up to page ``num_pages`` (all by default),
        that are not cached here, within ``timeout_s``. Never raises for the peer's
        trouble: the outcome says what was installed and why not more."""
        started = time.perf_counter()
        if peer == self._worker_id:
            return FetchOutcome(0, 0, 0, 0.0, "the peer is this worker")
        engine = self._loop.engine
        page_size = engine.geometry.page_size

        def local_prefix() -> tuple[NamespaceDigest, list[PageKey], int]:  # engine thread: it owns the engine
            digest = engine.digest_for(identity)
            # The last prompt token is always computed (for its logits): a page holding it is not needed.
            keys = page_keys(digest, list(prompt), page_size)[: (len(prompt) - 1) // page_size]
            return digest, keys, len(engine.cached_chain(keys))

        try:
            digest, keys, num_local = await self._loop.call(local_prefix)
        except KvtierError as exc:  # e.g. too many namespaces: the request itself will say so
            return FetchOutcome(0, 0, 0, time.perf_counter() - started, f"{type(exc).__name__}: {_first_line(exc)}")
        end = len(keys) if num_pages is None else min(len(keys), num_pages)
        if end <= num_local:
            return FetchOutcome(0, 0, 0, time.perf_counter() - started)
        # One fetch of a prefix at a time: concurrent requests for it wait for the first one's
        # pages, then ask only for what it did not bring (the prefix by its first page).
        flight = self._flights.setdefault(keys[0], _Flight())
        flight.num_users += 1
        try:
            if flight.lock.locked():
                async with asyncio.timeout(timeout_s):
                    await flight.lock.acquire()
                num_local = await self._loop.call(lambda: len(engine.cached_chain(keys)))
            else:
                await flight.lock.acquire()
        except TimeoutError:
            self._leave(keys[0], flight)
            return FetchOutcome(end - num_local, 0, 0, time.perf_counter() - started, "timed out")
        finally:
            flight.num_users -= 1
        try:
            remaining_s = timeout_s - (time.perf_counter() - started)
            return await self._pull(identity, digest, keys[:end], num_local, peer, remaining_s, started)
        finally:
            flight.lock.release()
            self._leave(keys[0], flight)

    def _leave(self, first: PageKey, flight: _Flight) -> None:
        if not flight.num_users and not flight.lock.locked():
            self._flights.pop(first, None)

    async def fetch_chain(self, digest: NamespaceDigest, keys: Sequence[PageKey], peer: str, *,
                          timeout_s: float) -> FetchOutcome:
        """Fetch from ``peer`` the pages of the chain ``keys`` (root first) that are not cached
        here: a controller's ``FetchCommand`` (drain migration, pin replicas), where no prompt is
        at hand. The namespace's identity is this worker's own when it has served the namespace,
        else the one the group carries (installed only if it derives ``digest`` here too)."""
        started = time.perf_counter()
        if peer == self._worker_id:
            return FetchOutcome(0, 0, 0, 0.0, "the peer is this worker")
        engine = self._loop.engine
        identity = self._loop.page_events.identities().get(digest)
        num_local = await self._loop.call(lambda: len(engine.cached_chain(list(keys))))
        return await self._pull(identity, digest, list(keys), num_local, peer, timeout_s, started)

    async def ranked_chains(self, digest: NamespaceDigest, peer: str, max_pages: int, *,
                            timeout_s: float) -> list[tuple[PageKey, ...]]:
        """The chains of ``peer``'s most valuable pages of ``digest`` (at most ``max_pages``)."""
        async with asyncio.timeout(timeout_s):
            return await self._transport.rank(peer, RankRequest(digest, max_pages, self._credential))

    async def _pull(self, identity: NamespaceIdentity | None, digest: NamespaceDigest, keys: list[PageKey],
                    num_local: int, peer: str, timeout_s: float, started: float) -> FetchOutcome:
        """Pull ``keys[num_local:]`` (at most ``MAX_EXPORT_PAGES``) from ``peer``, verify and install."""
        # Pages before the first one missing here are not asked for; pages after a gap could not
        # be inserted (the index is prefix-closed), so the fetch starts at the first missing page.
        wanted = tuple(keys[num_local:num_local + MAX_EXPORT_PAGES])
        if not wanted:
            return FetchOutcome(0, 0, 0, time.perf_counter() - started)
        parent = keys[num_local - 1] if num_local else root_key(digest)
        engine = self._loop.engine
        self.num_fetches += 1
        chunks = [wanted[i:i + FETCH_GROUP_PAGES] for i in range(0, len(wanted), FETCH_GROUP_PAGES)]
        pulls: list[asyncio.Future[PageGroup]] = []
        num_installed = num_bytes = 0
        problem: str | None = None
        pulled_at = started
        try:
            async with asyncio.timeout(timeout_s):
                for i, chunk in enumerate(chunks):
                    while len(pulls) < min(i + GROUPS_IN_FLIGHT, len(chunks)):  # the next groups, meanwhile
                        request = ExportRequest(digest, chunks[len(pulls)], self._credential)
                        pulls.append(asyncio.ensure_future(self._transport.pull(peer, request)))
                    group = await pulls[i]
                    pulled_at = time.perf_counter()
                    verified = await asyncio.to_thread(verify_group, group, chunk, parent)
                    named = identity or group.identity
                    if named is None:
                        raise PermissionDenied("the page group names no namespace identity", field="identity")
                    installed: Installed = await self._loop.call(functools.partial(
                        install_pages, engine, self._loop.page_events, named, group, verified.num_pages, parent))
                    num_installed += installed.num_pages
                    num_bytes += group.num_bytes
                    problem = verified.problem
                    if problem is not None:
                        log.warning("a fetched page failed verification; the rest is recomputed", extra={
                            "peer": peer, "namespace": short(digest), "reason": problem})
                    if problem is None and installed.num_pages + installed.num_present < group.num_pages:
                        problem = "no room for every page"
                    if problem is None and group.num_pages < len(chunk):
                        problem = f"the peer holds {i * FETCH_GROUP_PAGES + group.num_pages} of {len(wanted)} pages"
                    if problem is not None:
                        break
                    parent = chunk[-1]
        except Exception as exc:  # the peer's trouble never fails the request
            self.num_failed += 1
            problem = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {_first_line(exc)}"
            log.warning("peer fetch failed; the request recomputes", extra={
                "peer": peer, "namespace": short(digest), "num_pages": len(wanted), "reason": problem})
            return FetchOutcome(len(wanted), num_installed, num_bytes, time.perf_counter() - started, problem)
        finally:
            for pull in pulls:
                if not pull.done():
                    pull.cancel()
                elif not pull.cancelled():
                    pull.exception()  # retrieved: a group after a failed one is not awaited
        self.num_fetched_bytes += num_bytes
        self.rates.record(num_bytes, pulled_at - started)
        return FetchOutcome(len(wanted), num_installed, num_bytes, time.perf_counter() - started, problem)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


def fetch_for_generate(fetcher: PeerFetcher, request: GenerateRequest,
                       time_remaining_s: float | None) -> Callable[[], Awaitable[FetchOutcome]] | None:
    """``request.peer_fetch`` (if any) within its share of the deadline, as ``EngineLoop.submit``
    runs it while the request waits outside the engine; None without a plan."""
    plan = request.peer_fetch
    if plan is None or fetcher.is_draining:  # a draining worker refuses the request right after
        return None
    timeout_s = MAX_FETCH_S if time_remaining_s is None else min(MAX_FETCH_S, FETCH_DEADLINE_SHARE * time_remaining_s)

    async def fetch() -> FetchOutcome:
        outcome = await fetcher.fetch(request.namespace, request.prompt_token_ids, plan.worker_id,
                                      timeout_s=timeout_s, num_pages=plan.num_pages or None)
        log.info("peer fetch before prefill", extra={
            "request_id": request.request_id, "peer": plan.worker_id, "num_requested": outcome.num_requested,
            "num_installed": outcome.num_installed, "num_bytes": outcome.num_bytes,
            "elapsed_ms": round(outcome.elapsed_s * 1000.0, 3), "problem": outcome.problem})
        return outcome

    return fetch


async def fetch_command_ack(fetcher: PeerFetcher | None, command_id: CommandId, command: FetchCommand) -> CommandAck:
    """Carry out a controller's ``FetchCommand``: the chain's pages from the peer (without keys:
    the chains of the peer's most valuable pages, ``max_pages`` in all), a group of at most
    ``MAX_EXPORT_PAGES`` at a time. The ack counts the pages installed and those asked of
    the peer and not installed; a fetch that stopped short answers UNAVAILABLE with the reason."""
    if fetcher is None:
        return CommandAck(command_id, error_code="FAILED_PRECONDITION",
                          error_message="this worker fetches from no peer (no peer transport)")
    if fetcher.is_draining:
        return CommandAck(command_id, error_code="FAILED_PRECONDITION",
                          error_message="this worker is draining and takes no pages")
    num_installed = num_missed = 0
    problem: str | None = None
    try:
        chains = [command.page_keys] if command.page_keys else await fetcher.ranked_chains(
            command.namespace_digest, command.peer_worker_id, command.max_pages, timeout_s=COMMAND_FETCH_TIMEOUT_S)
        for chain in chains:
            while True:
                outcome = await fetcher.fetch_chain(command.namespace_digest, chain, command.peer_worker_id,
                                                    timeout_s=COMMAND_FETCH_TIMEOUT_S)
                num_installed += outcome.num_installed
                num_missed += outcome.num_requested - outcome.num_installed
                problem = outcome.problem
                if problem is not None or outcome.num_requested < MAX_EXPORT_PAGES:
                    break
            if problem is not None:
                break
    except Exception as exc:  # the peer's or this engine's trouble: the ack says so, the link goes on
        problem = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {_first_line(exc)}"
    log.info("fetch command carried out", extra={
        "command_id": command_id, "peer": command.peer_worker_id, "namespace": short(command.namespace_digest),
        "num_installed": num_installed, "num_missed": num_missed, "problem": problem})
    if problem is not None:
        return CommandAck(command_id, num_pages=num_installed, num_skipped_pages=num_missed,
                          error_code="UNAVAILABLE", error_message=f"fetch from {command.peer_worker_id}: {problem}")
    return CommandAck(command_id, num_pages=num_installed)
