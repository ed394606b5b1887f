"""Whether a live directory lists exactly what one worker caches (the failover tests' oracle)."""

from __future__ import annotations

from typing import Any

from kvtier.controller.directory import Directory
from kvtier.domain.tiers import Tier


async def directory_matches_inventory(reader: Directory, worker: Any) -> bool:
    """Every page the worker caches is routable to it at its depth and tier; nothing else is listed."""
    await reader.refresh_workers(revive=True)
    inventories = await worker.loop.inventory()
    by_ns: dict[bytes, dict[bytes, tuple[bytes, int, Tier]]] = {}
    for inventory in inventories:
        pages = by_ns.setdefault(inventory.namespace_digest, {})
        for page in inventory.pages:
            pages[page.page_key] = (page.parent_key, page.depth, inventory.tier)
    for digest, pages in by_ns.items():
        stats = await reader.stats(digest)
        if stats.num_entries != len(pages) or stats.entries_by_worker != {worker.worker_id: len(pages)}:
            return False
        for key, (_, depth, tier) in pages.items():
            chain = [key]
            while len(chain) < depth:
                chain.append(pages[chain[-1]][0])
            result = await reader.lookup(digest, chain[::-1])
            expected = [(worker.worker_id, bytes([tier] * depth))]
            if [(m.worker, bytes(m.tiers)) for m in result.matches] != expected:
                return False
    return bool(by_ns)
