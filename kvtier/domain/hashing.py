"""Namespace digests and chained page keys (DESIGN §5 decisions 2–3).

    key_0 = H(namespace_digest)
    key_i = H(key_{i-1} ‖ le_int32(tokens of page i))        H = BLAKE2b-128

Keys are stable across processes and machines (never Python's ``hash``). Only full
pages get keys; the partial tail of a sequence is private to it.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import astuple, dataclass, fields
from typing import NewType, overload

import numpy as np

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.kv_dtype import KV_ELEMENT_TYPES, parse_kv_dtype

PageKey = NewType("PageKey", bytes)
"""16-byte BLAKE2b digest identifying one full page together with its whole prefix."""

NamespaceDigest = NewType("NamespaceDigest", bytes)

KEY_BYTES = 16
KV_DTYPES = KV_ELEMENT_TYPES  # element types; a namespace's kv_dtype may also name an FP8 scheme


@dataclass(frozen=True, slots=True)
class NamespaceIdentity:
    """Every input that changes the KV bytes or who may see them.

    The server derives the digest from these fields; clients never send a digest.
    ``tenant`` comes from the authenticated principal, not from the payload alone.
    ``policy_epoch`` is bumped by invalidation so old keys become unreachable at once.
    ``kv_dtype`` is a ``kvtier.domain.kv_dtype`` name: an FP8 cache names its format and scale
    granularity (``fp8_e4m3@page-head``), a cache that demotes in another format names both
    (``bf16/fp8_e4m3@page-head``), so caches whose bytes or values differ never share pages.
    """

    model_id: str
    weights_digest: str = ""
    tokenizer_digest: str = ""
    adapter: str = ""
    rope_config: str = ""
    kv_dtype: str = "fp32"
    page_size: int = 16
    tenant: str = ""
    policy_epoch: int = 0

    def validate(self) -> None:
        if not self.model_id:
            raise InvalidArgument("namespace.model_id must not be empty", field="namespace.model_id")
        parse_kv_dtype(self.kv_dtype, field="namespace.kv_dtype")
        if self.page_size < 1:
            raise InvalidArgument(
                f"namespace.page_size must be >= 1, got {self.page_size}", field="namespace.page_size"
            )
        if self.policy_epoch < 0:
            raise InvalidArgument("namespace.policy_epoch must be >= 0", field="namespace.policy_epoch")


@functools.lru_cache(maxsize=4096)
def namespace_digest(identity: NamespaceIdentity) -> NamespaceDigest:
    """BLAKE2b-128 over a length-prefixed encoding of every identity field, in order.

    Length prefixes make the encoding unambiguous ("ab"+"c" differs from "a"+"bc").
    Cached: identities are frozen, and Route derives the digest on every request.
    """
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvtier-ns-v1")
    for f, value in zip(fields(identity), astuple(identity), strict=True):
        encoded = str(value).encode("utf-8")
        h.update(f.name.encode("ascii"))
        h.update(len(encoded).to_bytes(4, "little"))
        h.update(encoded)
    return NamespaceDigest(h.digest())


@functools.lru_cache(maxsize=4096)
def root_key(digest: NamespaceDigest) -> PageKey:
    return PageKey(hashlib.blake2b(digest, digest_size=KEY_BYTES).digest())


def next_key(parent: PageKey, page_tokens: Sequence[int]) -> PageKey:
    encoded = np.asarray(page_tokens, dtype="<i4").tobytes()
    return PageKey(hashlib.blake2b(parent + encoded, digest_size=KEY_BYTES).digest())


def page_keys(digest: NamespaceDigest, token_ids: Sequence[int], page_size: int) -> list[PageKey]:
    """Keys of every *full* page of ``token_ids`` (the partial tail gets none)."""
    if page_size < 1:
        raise InvalidArgument(f"page_size must be >= 1, got {page_size}", field="page_size")
    num_full = len(token_ids) // page_size
    # One conversion for the whole prefix; each page hashes a slice of it.
    encoded = np.asarray(token_ids[: num_full * page_size], dtype="<i4").tobytes()
    step = 4 * page_size
    keys: list[PageKey] = []
    parent = root_key(digest)
    for start in range(0, num_full * step, step):
        parent = PageKey(hashlib.blake2b(parent + encoded[start : start + step], digest_size=KEY_BYTES).digest())
        keys.append(parent)
    return keys


class PackedKeys(Sequence[PageKey]):
    """Page keys end to end in one ``bytes`` (``KEY_BYTES`` each): a sequence that cuts a key out
    only when one is asked for. A long prefix's keys cross a process boundary, or go to Redis,
    as one object (``packed``) rather than one per page."""

    __slots__ = ("packed",)

    def __init__(self, packed: bytes) -> None:
        if len(packed) % KEY_BYTES:
            raise InvalidArgument(f"packed page keys must be a multiple of {KEY_BYTES} bytes, got {len(packed)}",
                                  field="page_keys")
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed) // KEY_BYTES

    @overload
    def __getitem__(self, index: int) -> PageKey: ...

    @overload
    def __getitem__(self, index: slice) -> PackedKeys: ...

    def __getitem__(self, index: int | slice) -> PageKey | PackedKeys:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("packed page keys slice with step 1 only")
            return PackedKeys(self.packed[start * KEY_BYTES:max(start, stop) * KEY_BYTES])
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return PageKey(self.packed[index * KEY_BYTES:(index + 1) * KEY_BYTES])

    def __iter__(self) -> Iterator[PageKey]:
        packed = self.packed
        return (PageKey(packed[i:i + KEY_BYTES]) for i in range(0, len(packed), KEY_BYTES))


def short(key: bytes) -> str:
    """First 8 hex digits: the only form of a key that may appear in logs and metrics."""
    return key[:4].hex()
