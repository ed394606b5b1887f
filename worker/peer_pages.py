"""Page groups: a worker's cached pages exported for a peer, verified and installed by it.

    holder                                       receiver
    copy_pages(request)        engine thread     verify_group(group, keys, parent)   any thread
      the longest cached prefix of the keys,       key chain and checksum of every page
      of the named namespace only (a key of        ─► the verified pages, up to the first bad one
      another namespace refuses the request):    install_pages(...)                  engine thread
      bytes from HBM, DRAM or NVMe                 HBM while it has free pages, else DRAM;
    seal_group(group)          any thread          radix insert → page events → directory
      the checksum of each page

A page group is plain numpy (bytes ``[n, page_bytes]`` uint8, checksums ``[n]`` uint64, tokens
``[n, page_size]`` int32), so any transport carries it without a conversion: the Ray object
store zero-copy, a gRPC stream as raw bytes.

No partial page reaches the receiver's index: a page is inserted only after its whole payload
arrived and its checksum and key matched, and pages after a bad one are not inserted at all
(the index is prefix-closed). The caller recomputes what was not installed.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.cache.page_pool import PageId
from kvtier.cache.radix import RadixNode
from kvtier.domain.errors import InvalidArgument, PermissionDenied
from kvtier.domain.hashing import NamespaceDigest, NamespaceIdentity, PageKey, next_key, root_key, short
from kvtier.domain.tiers import Tier
from kvtier.engine.engine import Engine
from kvtier.tiers.checksum import page_checksums
from kvtier.tiers.nvme.format import SlotId, SlotLocation
from kvtier.worker.page_events import PageEvents

MAX_EXPORT_PAGES = 4096  # one request; a longer prefix is fetched in several


@dataclass(frozen=True, slots=True)
class ExportRequest:
    """Pages of namespace ``digest`` under ``keys`` (a chain, first key first), for the worker
    authenticated by ``credential`` (its bearer token; None when the holder runs without auth)."""

    digest: NamespaceDigest
    keys: tuple[PageKey, ...]
    credential: str | None = None

    def validate(self) -> None:
        if len(self.digest) != 16:
            raise InvalidArgument(f"namespace_digest must be 16 bytes, got {len(self.digest)}",
                                  field="namespace_digest")
        if not 0 < len(self.keys) <= MAX_EXPORT_PAGES:
            raise InvalidArgument(f"keys must name 1..{MAX_EXPORT_PAGES} pages, got {len(self.keys)}", field="keys")


@dataclass(frozen=True, slots=True)
class RankRequest:
    """The holder's most valuable pages of namespace ``digest``, at most ``max_pages``, as
    chains: a drain migration asks this of the draining worker."""

    digest: NamespaceDigest
    max_pages: int
    credential: str | None = None

    def validate(self) -> None:
        if len(self.digest) != 16:
            raise InvalidArgument(f"namespace_digest must be 16 bytes, got {len(self.digest)}",
                                  field="namespace_digest")
        if self.max_pages < 1:
            raise InvalidArgument(f"max_pages must be >= 1, got {self.max_pages}", field="max_pages")


@dataclass(frozen=True, slots=True, eq=False)
class PageGroup:
    """The first ``num_pages`` of an export request's keys, as the holder had them."""

    digest: NamespaceDigest
    keys: tuple[PageKey, ...]
    tokens: np.ndarray  # int32 [n, page_size]
    checksums: np.ndarray  # uint64 [n]
    data: np.ndarray  # uint8 [n, page_bytes]
    # The namespace's identity fields, for a receiver that has not served it yet (a migration or
    # a replica); the receiver installs only when they derive ``digest`` there too.
    identity: NamespaceIdentity | None = None

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    @property
    def num_bytes(self) -> int:
        return int(self.data.nbytes)


@dataclass(frozen=True, slots=True)
class Verified:
    """The pages of a group that passed, from its first page on, and why the next one did not."""

    num_pages: int
    problem: str | None = None  # None: every page passed


@dataclass(frozen=True, slots=True)
class Installed:
    num_pages: int  # newly inserted
    num_present: int  # already cached here (skipped)
    tier: Tier | None  # of the last page inserted


# ---- holder ---------------------------------------------------------------------------


def export_pages(engine: Engine, page_events: PageEvents, request: ExportRequest) -> PageGroup:
    """The longest cached prefix of ``request.keys`` (engine thread): ``copy_pages`` then
    ``seal_group``."""
    return seal_group(*copy_pages(engine, page_events, request))


def copy_pages(engine: Engine, page_events: PageEvents, request: ExportRequest) -> tuple[PageGroup, list[int | None]]:
    """The bytes of the longest cached prefix of ``request.keys`` (engine thread), and the
    checksum each page below HBM carries (None for a page copied from HBM: ``seal_group``
    takes it, on any thread). Raises ``PermissionDenied`` when one of those pages belongs to
    another namespace: nothing of it leaves the worker."""
    request.validate()
    nodes = []
    for key in request.keys:
        node = engine.index.get(key)
        if node is None:
            break
        if page_events.digests.get(key) != request.digest:
            raise PermissionDenied(
                f"page {short(key)} is not a page of namespace {short(request.digest)}; a worker exports "
                "only the pages of the namespace a fetch names", field="namespace_digest")
        nodes.append(node)
    geometry = engine.geometry
    data = np.empty((len(nodes), geometry.page_bytes), dtype=np.uint8)
    tokens = np.empty((len(nodes), geometry.page_size), dtype=np.int32)
    stored: list[int | None] = []
    tiers = engine.tiers
    for i, node in enumerate(nodes):
        tokens[i] = node.tokens
        if node.tier is Tier.HBM:
            data[i] = _page_bytes(engine.pool.tensor[node.page])
            stored.append(None)
        elif node.tier is Tier.DRAM:
            assert tiers is not None and tiers.dram is not None
            data[i] = _page_bytes(tiers.dram.tensor[node.page])
            stored.append(node.checksum)
        else:
            assert tiers is not None and tiers.nvme is not None
            data[i] = _read_slot(tiers.nvme.locate(SlotId(node.page)), geometry.page_bytes)
            stored.append(node.checksum)
    sums = np.zeros(len(nodes), dtype=np.uint64)
    return PageGroup(request.digest, tuple(n.key for n in nodes), tokens, sums, data,
                     page_events.identities().get(request.digest)), stored


def seal_group(group: PageGroup, stored: list[int | None]) -> PageGroup:
    """``group`` with the checksum of each page: the one taken when the page left HBM where
    ``stored`` has it (it vouches end to end), else computed from the bytes (any thread)."""
    sums = group.checksums
    if any(checksum is None for checksum in stored):
        sums = page_checksums(torch.from_numpy(group.data)).numpy().view(np.uint64).copy()
    for i, checksum in enumerate(stored):
        if checksum is not None:
            sums[i] = np.uint64(checksum)
    return dataclasses.replace(group, checksums=sums)


def rank_chains(engine: Engine, page_events: PageEvents, request: RankRequest) -> list[tuple[PageKey, ...]]:
    """The namespace's cached pages worth the most by the eviction policy's value (the order
    eviction keeps them in: higher priority stays longer), each with its ancestors (a page is
    useless without them), up to ``request.max_pages`` pages in all; as root-first chains, one
    per chosen page that no other chosen page descends from, most valuable first (engine thread)."""
    request.validate()
    policy = engine.index.policy
    nodes = sorted(page_events.nodes_of({request.digest}), key=policy.priority, reverse=True)
    chosen: dict[PageKey, RadixNode] = {}
    ends: list[RadixNode] = []
    for node in nodes:
        if node.key in chosen:
            continue
        path = []
        walk: RadixNode | None = node
        while walk is not None and walk.key not in chosen:
            path.append(walk)
            walk = walk.parent
        if len(chosen) + len(path) > request.max_pages:
            continue
        chosen.update((n.key, n) for n in path)
        ends.append(node)
    chains = []
    for end in ends:
        if any(child.key in chosen for child in end.children.values()):
            continue  # a chosen descendant's chain covers it
        chain: list[PageKey] = []
        walk = end
        while walk is not None:
            chain.append(walk.key)
            walk = walk.parent
        chains.append(tuple(reversed(chain)))
    return chains


def _page_bytes(page: torch.Tensor) -> np.ndarray:
    return page.detach().reshape(-1).view(torch.uint8).cpu().numpy()


def _read_slot(location: SlotLocation, num_bytes: int) -> np.ndarray:
    with open(location.path, "rb") as file:
        raw = os.pread(file.fileno(), num_bytes, location.payload_offset)
    return np.frombuffer(raw, dtype=np.uint8)


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over ``array`` without a copy. A group pulled from the Ray object store is
    read-only shared memory; it is only ever read here, so torch's warning about that is moot."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(array))


# ---- receiver -------------------------------------------------------------------------


def verify_group(group: PageGroup, keys: tuple[PageKey, ...], parent: PageKey) -> Verified:
    """Check ``group`` against the keys the receiver asked for (any thread): each page must be
    the next requested key, its tokens must hash to that key under its parent, and its bytes
    must match its checksum. ``parent`` is the key before ``keys[0]`` (the namespace root key
    for the first page of a prompt)."""
    n = group.num_pages
    if n > len(keys) or group.keys != keys[:n]:
        return Verified(0, "the holder sent pages that were not asked for")
    if group.data.shape[0] != n or group.checksums.shape[0] != n or group.tokens.shape[0] != n:
        return Verified(0, "the page group's arrays do not have one row per page")
    sums = page_checksums(_tensor(group.data)).numpy().view(np.uint64)
    for i, key in enumerate(group.keys):
        if next_key(parent, group.tokens[i].tolist()) != key:
            return Verified(i, f"page {short(key)}: its tokens do not hash to its key")
        if sums[i] != group.checksums[i]:
            return Verified(i, f"page {short(key)}: checksum mismatch (the bytes changed in transit)")
        parent = key
    return Verified(n)


def install_pages(engine: Engine, page_events: PageEvents, identity: NamespaceIdentity, group: PageGroup,
                  num_pages: int, parent: PageKey) -> Installed:
    """Insert the first ``num_pages`` verified pages of ``group`` (engine thread): into free HBM
    pages while there are any, then into DRAM (a chain never gets faster going down). Stops at
    the first page that finds no room or no cached parent; takes no page from anyone."""
    digest = engine.digest_for(identity)
    if digest != group.digest:
        raise PermissionDenied("the page group is of another namespace than the request", field="namespace")
    page_events.admitted(digest, identity)
    index, tiers = engine.index, engine.tiers
    dram = tiers.dram if tiers is not None else None
    installed = present = 0
    tier: Tier | None = None
    floor = Tier.HBM
    parent_key: PageKey | None = None if parent == root_key(digest) else parent
    for i in range(num_pages):
        key = group.keys[i]
        node = index.get(key)
        if node is not None:
            present += 1
            floor = max(floor, node.tier)
            parent_key = key
            continue
        tokens = group.tokens[i].tolist()
        if floor is Tier.HBM and engine.pool.num_free > 0:
            page = engine.pool.allocate()
            assert page is not None
            engine.pool.tensor[page].reshape(-1).view(torch.uint8).copy_(_tensor(group.data[i]))
            node = index.insert(key, parent_key, page, tokens, digest, tier=Tier.HBM)
            engine.pool.release(page)  # the index's now (cached), or free again when not inserted
        elif dram is not None and dram.num_free > 0:
            floor = Tier.DRAM
            dpage = dram.allocate()
            assert dpage is not None
            dram.tensor[dpage].reshape(-1).view(torch.uint8).copy_(_tensor(group.data[i]))
            checksum = int(group.checksums[i])
            dram.set_checksums([dpage], [checksum])
            node = index.insert(key, parent_key, dpage, tokens, digest, tier=Tier.DRAM, checksum=checksum)
            if node is not None:
                dram.mark_cached(PageId(dpage))
            dram.release(PageId(dpage))
        else:
            break
        if node is None:
            break
        installed += 1
        tier = node.tier
        parent_key = key
    return Installed(installed, present, tier)
