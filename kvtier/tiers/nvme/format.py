"""Slot format of the NVMe tier: file layout, slot records, errors, geometry arithmetic.

Layout of ``<directory>/slots-NNN.kvt`` (format version 2; every number little-endian)::

    offset 0                  file superblock (4096 B): magic, version, geometry, slot range,
                              slots per group, record bytes
    4096 + g * group_bytes    slot group g of this file:
                                header block  4096 B: one record of 4096 / G bytes per slot
                                G payloads    page_bytes rounded up to 4096 each, zero padded

    record  0  magic "KVTSLOT\\0"   8  version u16      10 state u16        12 slot u32
           16  generation u64      24  payload_bytes u64                   32 payload_checksum u64
           40  algorithm u16       42  num_tokens u16  44 flags u32 (bit 0: has parent)
           48  page key 16 B       64  namespace digest 16 B               80 parent key 16 B
           96  record crc32 over [0, 96) + tokens       128 tokens int32 x num_tokens

G (slots per group) follows from the geometry: small pages share a header block, so a
group's payloads are one contiguous extent (32 KiB pages: G = 8, 512-byte records, 1.6 %
of the device bytes in headers where version 1 spent 12.5 %, and a run of slots reads as
two iovec segments per 8 pages instead of two per page); pages of 256 KiB and more keep
one 4096-byte header block each (G = 1). The last group of a file may be short.

Write protocol: one ``pwritev`` per run of consecutive slots carries header blocks and
payloads together; each record is written COMPLETE with the payload's checksum. A header
block shared with slots outside the run is read, changed in the run's records only, and
written back under that group's lock (a run that covers a whole group owns its block:
no other writer touches those records), so unchanged records are rewritten byte for byte
(records are whole 512-byte sectors or more: a sector torn by power loss holds records
of the run only). Nothing relies on the order in which the device persists sectors: a
slot counts as recovered only if its record crc, its state and the checksum of its
payload all agree, so a write torn by a
crash or power loss is discarded at recovery, and a read always verifies the payload
anyway. With ``SyncPolicy.DATA`` each write call ends with ``fdatasync`` (acknowledged
pages survive power loss; costs a device flush per call); the default ``NONE`` survives a
process crash and leaves power loss to the checksums (pages written shortly before are
lost, never served corrupt). A freed slot's header is rewritten FREE by ``flush_frees``
(off the engine thread), so a dropped page does not come back at the next start, unless
an allocation hands the slot out first: then the next write replaces the header (a
crash before it brings the dropped page back, verified and under its own key, as a
crash before the flush would). ``<directory>/lock`` holds an exclusive ``flock``.
"""

from __future__ import annotations

import enum
import errno
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, NewType

import numpy as np

from kvtier.cache.page_pool import PoolGeometry
from kvtier.domain.errors import (
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from kvtier.domain.hashing import KEY_BYTES, NamespaceDigest, PageKey
from kvtier.tiers.checksum import CHECKSUM_ALGORITHM

SlotId = NewType("SlotId", int)

ALIGN = 4096
HEADER_BYTES = ALIGN  # one header block: the records of one slot group
FORMAT_VERSION = 2
MAX_TOKENS_PER_SLOT = (HEADER_BYTES - 128) // 4
MIN_RECORD_BYTES = 512  # a sector: a record is never split across two
# Slots share a header block until a group's payloads reach this size (32 KiB pages: 8).
GROUP_PAYLOAD_BYTES = 256 << 10
DEFAULT_FILE_BYTES = 1 << 30
SLOT_MAGIC = b"KVTSLOT\0"
FILE_MAGIC = b"KVTFILE\0"
RECORD = struct.Struct("<8sHHIQQQHHI16s16s16s")  # 96 bytes, then crc32 at 96
SUPERBLOCK = struct.Struct("<8sHHIIIQQIIII16sII")
TOKENS_AT = 128
FILE_NAME_RE = re.compile(r"^slots-(\d{3,})\.kvt$")
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
IOV_MAX = 1020
ZERO_HEADER = bytes(HEADER_BYTES)
# The fixed header fields as one numpy record per 4096-byte header (same offsets as
# RECORD): a run of headers is encoded with a few column assignments, not a pack per slot.
RECORD_FIELDS = (
    ("magic", "S8", 0), ("version", "<u2", 8), ("state", "<u2", 10), ("slot", "<u4", 12),
    ("generation", "<u8", 16), ("payload_bytes", "<u8", 24), ("checksum", "<u8", 32),
    ("algorithm", "<u2", 40), ("num_tokens", "<u2", 42), ("flags", "<u4", 44),
    ("key", "S16", 48), ("namespace", "S16", 64), ("parent", "S16", 80), ("crc", "<u4", RECORD.size),
)  # fmt: skip


def record_dtype(record_bytes: int) -> np.dtype:
    return np.dtype(
        {
            "names": [name for name, _, _ in RECORD_FIELDS],
            "formats": [fmt for _, fmt, _ in RECORD_FIELDS],
            "offsets": [at for _, _, at in RECORD_FIELDS],
            "itemsize": record_bytes,
        }
    )


MASK64 = (1 << 64) - 1
HUGE_FROM_BYTES = 1 << 20


class DiskFull(ResourceExhausted):
    """The NVMe directory ran out of space or hit a file size limit; the pool is unchanged
    (the slots of the failed call are free again) and the caller drops the pages instead."""


class NvmeIOError(Unavailable):
    """The device failed an I/O for another reason (EIO, ...); the slots of the call are free."""


class SyncPolicy(enum.Enum):
    NONE = "none"  # survives a process crash; power loss may lose (never corrupt) recent pages
    DATA = "data"  # fdatasync after every write call: acknowledged pages survive power loss


class SlotState(enum.IntEnum):
    """On-disk state. EMPTY is what a preallocated, never written slot reads as (zeros)."""

    EMPTY = 0
    FREE = 1
    COMPLETE = 2


class SlotVerdict(enum.Enum):
    """Outcome of reading one slot. Only OK bytes may be used."""

    OK = "ok"
    CHECKSUM_MISMATCH = "payload checksum mismatch"
    HEADER_CORRUPT = "header corrupt"
    NOT_COMPLETE = "slot not complete"
    WRONG_PAGE = "slot holds another page"
    SHORT_READ = "short read (file truncated)"

    @property
    def ok(self) -> bool:
        return self is SlotVerdict.OK


@dataclass(slots=True)
class SlotHeader:
    slot: int
    state: SlotState
    generation: int
    payload_bytes: int
    payload_checksum: int
    key: bytes
    namespace: bytes
    parent_key: PageKey | None = None
    tokens: tuple[int, ...] = ()
    algorithm: int = CHECKSUM_ALGORITHM

    def encode(self) -> bytes:
        """The header's significant bytes (fields, crc, tokens); the rest of the 4096 is zero."""
        if len(self.tokens) > MAX_TOKENS_PER_SLOT:
            raise InvalidArgument(
                f"a slot header holds at most {MAX_TOKENS_PER_SLOT} tokens, got {len(self.tokens)}"
            )
        fixed = RECORD.pack(
            SLOT_MAGIC,
            FORMAT_VERSION,
            int(self.state),
            self.slot,
            self.generation,
            self.payload_bytes,
            self.payload_checksum,
            self.algorithm,
            len(self.tokens),
            1 if self.parent_key is not None else 0,
            self.key,
            self.namespace,
            self.parent_key or bytes(KEY_BYTES),
        )
        tokens = np.asarray(self.tokens, dtype="<i4").tobytes() if self.tokens else b""
        crc = zlib.crc32(tokens, zlib.crc32(fixed))
        return fixed + crc.to_bytes(4, "little") + bytes(TOKENS_AT - RECORD.size - 4) + tokens

    def encode_into(self, buf: memoryview) -> bytes:
        """Write the header into a record (``buf``: 512 to 4096 bytes, the rest zeroed);
        returns its significant bytes."""
        encoded = self.encode()
        if not len(encoded) <= len(buf) <= HEADER_BYTES:
            raise ValueError(f"a {len(encoded)}-byte header does not fit a {len(buf)}-byte record")
        buf[: len(encoded)] = encoded
        buf[len(encoded) :] = ZERO_HEADER[len(encoded) : len(buf)]
        return encoded

    @classmethod
    def decode(cls, buf: memoryview | bytes) -> SlotHeader | None:
        """The header in ``buf``, ``None`` for a never-written (all-zero magic) slot; raises
        ``ValueError`` naming the fault when the bytes are not a valid header."""
        fixed = bytes(buf[: RECORD.size])
        magic, version, state, slot, gen, nbytes, cks, algo, ntok, flags, key, ns, parent = RECORD.unpack(
            fixed
        )
        if magic == bytes(8):
            return None
        if magic != SLOT_MAGIC:
            raise ValueError("bad magic")
        if version != FORMAT_VERSION:
            raise ValueError(f"format version {version}, this build reads {FORMAT_VERSION}")
        if ntok > MAX_TOKENS_PER_SLOT or TOKENS_AT + 4 * ntok > len(buf):
            raise ValueError("token count out of range")
        tokens = bytes(buf[TOKENS_AT : TOKENS_AT + 4 * ntok])
        stored = int.from_bytes(buf[RECORD.size : RECORD.size + 4], "little")
        if zlib.crc32(tokens, zlib.crc32(fixed)) != stored:
            raise ValueError("header checksum mismatch")
        if state not in SlotState._value2member_map_:
            raise ValueError(f"unknown state {state}")
        return cls(
            slot=slot,
            state=SlotState(state),
            generation=gen,
            payload_bytes=nbytes,
            payload_checksum=cks,
            key=key,
            namespace=ns,
            parent_key=PageKey(parent) if flags & 1 else None,
            tokens=tuple(np.frombuffer(tokens, dtype="<i4").tolist()),
            algorithm=algo,
        )


class SlotLocation(NamedTuple):
    path: Path
    record_offset: int  # the slot's header record (inside its group's header block)
    payload_offset: int


@dataclass(slots=True)
class SlotEntry:
    key: PageKey
    namespace: NamespaceDigest
    checksum: int
    generation: int
    header: bytes  # significant header bytes as written: a read that finds them is intact


# In-memory slot states. RELEASING: freed, but its header on disk still says COMPLETE
# until ``flush_frees`` rewrites it. ``allocate_many`` may hand it out before that,
# taking it off the releasing list under the lock (so no rewrite can land on the next
# page's header): the write that fills it replaces the stale header anyway.
SLOT_FREE, SLOT_RESERVED, SLOT_STORED, SLOT_RELEASING = 0, 1, 2, 3


class GroupLayout(NamedTuple):
    """How slots of one geometry sit on disk: ``slots_per_group`` records share a header block."""

    slots_per_group: int
    record_bytes: int
    payload_bytes: int

    @property
    def group_bytes(self) -> int:
        return HEADER_BYTES + self.slots_per_group * self.payload_bytes

    @property
    def max_tokens(self) -> int:
        return min(MAX_TOKENS_PER_SLOT, (self.record_bytes - TOKENS_AT) // 4)


def group_layout(geometry: PoolGeometry) -> GroupLayout:
    """Slots per header block for ``geometry``: as many as keep a group's payloads within
    ``GROUP_PAYLOAD_BYTES``, while a record (a power of two, at least one sector) still holds
    a full page of tokens."""
    payload = round_up(geometry.page_bytes, ALIGN)
    record = MIN_RECORD_BYTES
    while record < min(HEADER_BYTES, TOKENS_AT + 4 * geometry.page_size):
        record *= 2
    group = 1
    while group * 2 <= HEADER_BYTES // record and group * 2 * payload <= GROUP_PAYLOAD_BYTES:
        group *= 2
    return GroupLayout(group, HEADER_BYTES // group, payload)


def slot_bytes_for(geometry: PoolGeometry) -> int:
    """Device bytes per slot: its payload and its share of a header block (a file's short last
    group and the superblock add at most 8 KiB per file)."""
    layout = group_layout(geometry)
    return layout.payload_bytes + layout.record_bytes


def slots_for_bytes(capacity_bytes: int, geometry: PoolGeometry) -> int:
    """How many page slots ``capacity_bytes`` of disk holds (headers and padding included)."""
    return max(0, capacity_bytes) // slot_bytes_for(geometry)


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def check_header(raw: memoryview | None, slot: int, entry: SlotEntry, page_bytes: int) -> SlotVerdict:
    if raw is None:
        return SlotVerdict.SHORT_READ
    if raw[: len(entry.header)] == entry.header:
        return SlotVerdict.OK  # byte for byte what was written (one compare, no decode)
    try:
        header = SlotHeader.decode(raw)
    except ValueError:
        return SlotVerdict.HEADER_CORRUPT
    if header is None or header.state is not SlotState.COMPLETE:
        return SlotVerdict.NOT_COMPLETE
    if header.payload_bytes != page_bytes:
        return SlotVerdict.HEADER_CORRUPT
    if (
        header.slot != slot
        or header.key != entry.key
        or header.namespace != entry.namespace
        or header.generation != entry.generation
        or header.payload_checksum != entry.checksum
    ):
        return SlotVerdict.WRONG_PAGE
    return SlotVerdict.OK

