"""Small builders shared by unit tests (tiny pools with a dozen pages)."""

from __future__ import annotations

import torch

from kvtier.cache.page_pool import PagePool, PoolGeometry
from kvtier.cache.radix import RadixIndex
from kvtier.domain.hashing import NamespaceIdentity, namespace_digest, page_keys


def make_pool(num_pages: int = 12, page_size: int = 4, num_layers: int = 2, kv_heads: int = 2, head_dim: int = 4):
    return PagePool(num_pages, PoolGeometry(num_layers, kv_heads, head_dim, page_size, torch.float32))


def make_index(num_pages: int = 12, page_size: int = 4) -> RadixIndex:
    return RadixIndex(make_pool(num_pages, page_size))


def keys_for(tokens: list[int], page_size: int = 4, tenant: str = "t"):
    return page_keys(namespace_digest(NamespaceIdentity(model_id="m", tenant=tenant)), tokens, page_size)
