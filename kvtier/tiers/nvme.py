"""The NVMe tier: fixed-size page slots in preallocated files (DESIGN §6, decision record 0002).

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

Concurrency: ``write_pages``/``read_pages`` run in transfer worker threads while the
engine thread allocates and frees; the slot table is guarded by one lock and the I/O
runs outside it (positional I/O needs no shared file offset). A caller never frees a
slot that has a read or write in flight.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import heapq
import math
import mmap
import os
import re
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, NewType

import numpy as np
import torch

from kvtier.cache.page_pool import PoolGeometry
from kvtier.domain.errors import (
    ConfigError,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from kvtier.domain.hashing import KEY_BYTES, NamespaceDigest, PageKey
from kvtier.tiers import copy as page_copy
from kvtier.tiers.checksum import CHECKSUM_ALGORITHM, page_checksums, to_unsigned
from kvtier.tiers.dram import CAN_ADVISE_HUGE_PAGES, HUGE_PAGE_BYTES, aligned_host_tensor

SlotId = NewType("SlotId", int)

ALIGN = 4096
HEADER_BYTES = ALIGN  # one header block: the records of one slot group
FORMAT_VERSION = 2
MAX_TOKENS_PER_SLOT = (HEADER_BYTES - 128) // 4
MIN_RECORD_BYTES = 512  # a sector: a record is never split across two
# Slots share a header block until a group's payloads reach this size (32 KiB pages: 8).
GROUP_PAYLOAD_BYTES = 256 << 10
DEFAULT_FILE_BYTES = 1 << 30
_SLOT_MAGIC = b"KVTSLOT\0"
_FILE_MAGIC = b"KVTFILE\0"
_HEADER = struct.Struct("<8sHHIQQQHHI16s16s16s")  # 96 bytes, then crc32 at 96
_SUPER = struct.Struct("<8sHHIIIQQIIII16sII")
_TOKENS_AT = 128
_FILE_RE = re.compile(r"^slots-(\d{3,})\.kvt$")
_NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_IOV_MAX = 1020
_ZERO_HEADER = bytes(HEADER_BYTES)
# The fixed header fields as one numpy record per 4096-byte header (same offsets as
# _HEADER): a run of headers is encoded with a few column assignments, not a pack per slot.
_HEADER_FIELDS = (
    ("magic", "S8", 0), ("version", "<u2", 8), ("state", "<u2", 10), ("slot", "<u4", 12),
    ("generation", "<u8", 16), ("payload_bytes", "<u8", 24), ("checksum", "<u8", 32),
    ("algorithm", "<u2", 40), ("num_tokens", "<u2", 42), ("flags", "<u4", 44),
    ("key", "S16", 48), ("namespace", "S16", 64), ("parent", "S16", 80), ("crc", "<u4", _HEADER.size),
)  # fmt: skip


def _record_dtype(record_bytes: int) -> np.dtype:
    return np.dtype(
        {
            "names": [name for name, _, _ in _HEADER_FIELDS],
            "formats": [fmt for _, fmt, _ in _HEADER_FIELDS],
            "offsets": [at for _, _, at in _HEADER_FIELDS],
            "itemsize": record_bytes,
        }
    )


_MASK64 = (1 << 64) - 1
_HUGE_FROM_BYTES = 1 << 20


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
        fixed = _HEADER.pack(
            _SLOT_MAGIC,
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
        return fixed + crc.to_bytes(4, "little") + bytes(_TOKENS_AT - _HEADER.size - 4) + tokens

    def encode_into(self, buf: memoryview) -> bytes:
        """Write the header into a record (``buf``: 512 to 4096 bytes, the rest zeroed);
        returns its significant bytes."""
        encoded = self.encode()
        if not len(encoded) <= len(buf) <= HEADER_BYTES:
            raise ValueError(f"a {len(encoded)}-byte header does not fit a {len(buf)}-byte record")
        buf[: len(encoded)] = encoded
        buf[len(encoded) :] = _ZERO_HEADER[len(encoded) : len(buf)]
        return encoded

    @classmethod
    def decode(cls, buf: memoryview | bytes) -> SlotHeader | None:
        """The header in ``buf``, ``None`` for a never-written (all-zero magic) slot; raises
        ``ValueError`` naming the fault when the bytes are not a valid header."""
        fixed = bytes(buf[: _HEADER.size])
        magic, version, state, slot, gen, nbytes, cks, algo, ntok, flags, key, ns, parent = _HEADER.unpack(
            fixed
        )
        if magic == bytes(8):
            return None
        if magic != _SLOT_MAGIC:
            raise ValueError("bad magic")
        if version != FORMAT_VERSION:
            raise ValueError(f"format version {version}, this build reads {FORMAT_VERSION}")
        if ntok > MAX_TOKENS_PER_SLOT or _TOKENS_AT + 4 * ntok > len(buf):
            raise ValueError("token count out of range")
        tokens = bytes(buf[_TOKENS_AT : _TOKENS_AT + 4 * ntok])
        stored = int.from_bytes(buf[_HEADER.size : _HEADER.size + 4], "little")
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


class RecoveredPage(NamedTuple):
    slot: SlotId
    key: PageKey
    namespace: NamespaceDigest
    checksum: int
    generation: int
    parent_key: PageKey | None
    tokens: tuple[int, ...]


@dataclass(slots=True)
class RecoveryReport:
    recovered: list[RecoveredPage] = field(default_factory=list)
    discarded: list[tuple[SlotId, str]] = field(default_factory=list)
    num_empty: int = 0  # never written or freed: nothing to recover, nothing lost


class NvmeCounts(NamedTuple):
    total: int
    free: int
    reserved: int  # allocated, not written yet
    stored: int
    releasing: int = 0  # freed, header rewrite pending (allocatable: the next write replaces it)


@dataclass(slots=True)
class _Entry:
    key: PageKey
    namespace: NamespaceDigest
    checksum: int
    generation: int
    header: bytes  # significant header bytes as written: a read that finds them is intact


# In-memory slot states. RELEASING: freed, but its header on disk still says COMPLETE
# until ``flush_frees`` rewrites it. ``allocate_many`` may hand it out before that,
# taking it off the releasing list under the lock (so no rewrite can land on the next
# page's header): the write that fills it replaces the stale header anyway.
_FREE, _RESERVED, _STORED, _RELEASING = 0, 1, 2, 3


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
        return min(MAX_TOKENS_PER_SLOT, (self.record_bytes - _TOKENS_AT) // 4)


def group_layout(geometry: PoolGeometry) -> GroupLayout:
    """Slots per header block for ``geometry``: as many as keep a group's payloads within
    ``GROUP_PAYLOAD_BYTES``, while a record (a power of two, at least one sector) still holds
    a full page of tokens."""
    payload = _round_up(geometry.page_bytes, ALIGN)
    record = MIN_RECORD_BYTES
    while record < min(HEADER_BYTES, _TOKENS_AT + 4 * geometry.page_size):
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


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _aligned_buffer(num_bytes: int) -> memoryview:
    """Zeroed, page-aligned memory for O_DIRECT. From 1 MiB up it is whole transparent huge
    pages (rounded up to 2 MiB): the device reads into huge pages 1.5-2.5x faster than into
    4 KiB ones on the CI VM (decision 0002)."""
    if num_bytes < _HUGE_FROM_BYTES or not CAN_ADVISE_HUGE_PAGES:
        return memoryview(mmap.mmap(-1, max(ALIGN, _round_up(num_bytes, ALIGN))))  # page aligned
    return memoryview(aligned_host_tensor(_round_up(num_bytes, HUGE_PAGE_BYTES)).numpy())


def _byte_view(t: torch.Tensor) -> memoryview:
    if t.device.type != "cpu":
        raise InvalidArgument(f"NVMe I/O needs host tensors, got one on {t.device}; stage through DRAM")
    if not t.is_contiguous():
        raise InvalidArgument("NVMe I/O needs contiguous page tensors")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _Pages(NamedTuple):
    """Byte views of the pages of one call, and where they are adjacent in memory: with
    ``whole`` (one tensor's bytes) page ``i`` is row ``rows[i]`` of it, so consecutive rows go
    out as one iovec segment."""

    views: list[memoryview]
    whole: memoryview | None
    rows: np.ndarray | None


def _page_views(
    pages: torch.Tensor | Sequence[torch.Tensor], n: int, page_bytes: int, rows: np.ndarray | None = None
) -> _Pages:
    """Zero-copy byte views of ``n`` pages: one conversion for a tensor (a run ``[n, ...]``,
    or a pool ``[N, ...]`` whose pages ``rows`` are meant), slices of it per page."""
    if isinstance(pages, torch.Tensor):
        whole = _byte_view(pages)
        if rows is None:
            if len(whole) != n * page_bytes:
                raise InvalidArgument(
                    f"{n} pages of {page_bytes} bytes expected, got a tensor of {len(whole)} bytes"
                )
            views = [whole[i * page_bytes : (i + 1) * page_bytes] for i in range(n)]
            return _Pages(views, whole, np.arange(n, dtype=np.int64))
        num_rows = pages.shape[0] if pages.dim() else 0
        if len(whole) != num_rows * page_bytes:
            raise InvalidArgument(f"a pool of {page_bytes}-byte pages expected, got {tuple(pages.shape)}")
        if len(rows) and not (0 <= int(rows.min()) and int(rows.max()) < num_rows):
            raise InvalidArgument(f"page rows out of range [0, {num_rows})", field="rows")
        views = [whole[r * page_bytes : (r + 1) * page_bytes] for r in rows.tolist()]
        return _Pages(views, whole, rows)
    if rows is not None:
        raise InvalidArgument("rows select pages of one pool tensor, got a list of pages", field="rows")
    views = [_byte_view(p) for p in pages]
    bad = [len(v) for v in views if len(v) != page_bytes]
    if bad:
        raise InvalidArgument(f"a page of {bad[0]} bytes, the pool's pages have {page_bytes}")
    return _Pages(views, None, None)


class _HeaderFields(NamedTuple):
    """What the headers of one ``write_pages`` call say, indexed by position in the call."""

    slots: np.ndarray  # int64
    generations: np.ndarray  # uint64
    checksums: np.ndarray  # uint64
    keys: Sequence[bytes]
    namespaces: Sequence[bytes]
    parents: Sequence[bytes | None] | None
    tokens: Sequence[Sequence[int]] | None


class _Scratch(threading.local):
    """Per-thread aligned buffers for header blocks and bounce copies (grown, never shrunk)."""

    def __init__(self, record_bytes: int) -> None:
        self.record_bytes = record_bytes
        self.headers = _aligned_buffer(ALIGN)
        self.staging = _aligned_buffer(ALIGN)
        self.encoded = _aligned_buffer(ALIGN)
        self.encoded_dirty = 0  # bytes at the start of each encoded record that may be non-zero

    def encode_area(self, num_records: int) -> tuple[memoryview, np.ndarray]:
        """Records to encode into, as bytes and as ``[num_records, record_bytes]`` uint8, zero
        beyond the first ``encoded_dirty`` bytes of each (only encoders write here)."""
        num_bytes = num_records * self.record_bytes
        if len(self.encoded) < num_bytes:
            self.encoded = _aligned_buffer(num_bytes)  # anonymous maps start zeroed
            self.encoded_dirty = 0
        view = memoryview(self.encoded)[:num_bytes]
        return view, np.frombuffer(self.encoded, dtype=np.uint8, count=num_bytes).reshape(num_records, -1)

    def header_area(self, num_bytes: int) -> memoryview:
        if len(self.headers) < num_bytes:
            self.headers = _aligned_buffer(num_bytes)
        return memoryview(self.headers)[:num_bytes]

    def staging_area(self, num_bytes: int) -> memoryview:
        if len(self.staging) < num_bytes:
            self.staging = _aligned_buffer(num_bytes)
        return memoryview(self.staging)[:num_bytes]


class _Span(NamedTuple):
    """One run's slots ``[first, end)`` of one file, by local index, and the header blocks
    they touch: ``groups`` (local group ids), which of them the run shares with other slots
    (``shared``: read, changed and written back under the group's lock)."""

    fd: int
    file_index: int
    first: int
    end: int
    groups: range
    shared: tuple[int, ...]


class NvmePool:
    """Page slots on local disk. Slot lifecycle (in memory; the disk state follows it):

        free --allocate--> reserved --write_pages--> stored --free--> releasing
         ^ ^                 │ ^                                         │ │
         │ └─ free, DiskFull ┘ └──────── allocate (when free is short) ──┘ │
         └──────────────── flush_frees (header rewritten FREE) ────────────┘

    Contract: ``write_pages`` takes reserved slots and makes them stored; on ``DiskFull``
    or ``NvmeIOError`` every slot of that call is free again (the pool took the release).
    ``read_pages`` takes stored slots and never frees. Each allocation is freed once.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        num_slots: int,
        geometry: PoolGeometry,
        *,
        create: bool = True,
        sync: SyncPolicy = SyncPolicy.NONE,
        slots_per_file: int | None = None,
        direct_io: bool | None = None,
        verify_payload_on_recover: bool = True,
        max_io_bytes: int = 16 << 20,
    ) -> None:
        if num_slots < 1:
            raise ConfigError(f"nvme num_slots must be >= 1, got {num_slots}", field="nvme.num_slots")
        self.directory = Path(directory)
        self.geometry = geometry
        self.num_slots = num_slots
        self.sync = sync
        self.page_bytes = geometry.page_bytes
        self.layout = layout = group_layout(geometry)
        self.payload_bytes = layout.payload_bytes
        self.slots_per_group = layout.slots_per_group
        self.record_bytes = layout.record_bytes
        self.group_bytes = layout.group_bytes
        self.max_tokens_per_slot = layout.max_tokens
        self.slot_bytes = slot_bytes_for(geometry)
        self.slots_per_file = slots_per_file or max(1, min(num_slots, DEFAULT_FILE_BYTES // self.slot_bytes))
        # Whole groups per call where possible; iovecs: a header block per group, a payload
        # and a pad per slot at most.
        per_io = min(max(1, max_io_bytes // self.payload_bytes), _IOV_MAX // 3)
        self.max_slots_per_io = max(1, per_io - per_io % self.slots_per_group or per_io)
        self._record = _record_dtype(self.record_bytes)
        # Striped locks for header blocks shared between runs (see _Span.shared).
        self._group_locks = [threading.Lock() for _ in range(64)]
        self._verify_on_recover = verify_payload_on_recover
        self._lock = threading.Lock()
        self._scratch = _Scratch(self.record_bytes)
        self._zero_pad = _aligned_buffer(self.payload_bytes - self.page_bytes or ALIGN)
        self._state = [_FREE] * num_slots
        # What each stored slot's record must say (arrays, so a read checks a run of records
        # and payload checksums in a few whole-array operations): generation, payload checksum
        # and record crc, valid where _is_stored.
        self._is_stored = np.zeros(num_slots, dtype=bool)
        self._expect_generation = np.zeros(num_slots, dtype=np.uint64)
        self._expect_checksum = np.zeros(num_slots, dtype=np.uint64)
        self._expect_crc = np.zeros(num_slots, dtype=np.uint32)
        self._entries: dict[SlotId, _Entry] = {}
        self._by_key: dict[tuple[bytes, bytes], SlotId] = {}
        self._free: list[SlotId] = []
        self._releasing: list[SlotId] = []
        # Reserved slots handed out while releasing: their disk header still names the
        # freed page until written; freed unwritten, they go back to releasing, not free.
        self._stale: set[SlotId] = set()
        self._next_generation = 1
        self._fds: list[int] = []
        self._lock_fd: int | None = None
        self.is_direct = False
        self._open_files(create, direct_io)
        self.recovery = self.recover()

    # ---- files ------------------------------------------------------------------------
    @property
    def num_files(self) -> int:
        return math.ceil(self.num_slots / self.slots_per_file)

    def _file_path(self, index: int) -> Path:
        return self.directory / f"slots-{index:03d}.kvt"

    def _superblock(self, index: int) -> bytes:
        first = index * self.slots_per_file
        g = self.geometry
        body = _SUPER.pack(
            _FILE_MAGIC,
            FORMAT_VERSION,
            0,
            index,
            first,
            min(self.slots_per_file, self.num_slots - first),
            self.slot_bytes,
            self.page_bytes,
            g.num_layers,
            g.kv_heads,
            g.head_dim,
            g.page_size,
            str(g.dtype).removeprefix("torch.").encode()[:16],
            self.slots_per_group,
            self.record_bytes,
        )
        return body + zlib.crc32(body).to_bytes(4, "little")

    def _open_files(self, create: bool, direct_io: bool | None) -> None:
        if create:
            self.directory.mkdir(parents=True, exist_ok=True)
        elif not self.directory.is_dir():
            raise ConfigError(
                f"nvme directory {self.directory} does not exist; create it or pass create=True"
            )
        self._take_directory_lock()
        present = sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := _FILE_RE.match(p.name)))
        extra = [i for i in present if i >= self.num_files]
        if extra:
            raise ConfigError(
                f"{self.directory} holds slot file {self._file_path(extra[0]).name} beyond the "
                f"{self.num_files} files that {self.num_slots} slots need; use the capacity it was "
                "created with or an empty directory",
                field="nvme.capacity_bytes",
            )
        want_direct = direct_io is not False and hasattr(os, "O_DIRECT")
        created: list[Path] = []
        try:
            for index in range(self.num_files):
                path = self._file_path(index)
                if index not in present and not create:
                    raise ConfigError(f"slot file {path} is missing and create=False")
                fd = self._open_one(path, index, fresh=index not in present, created=created)
                self._fds.append(fd)
            self.is_direct = want_direct and self._switch_to_direct()
            if direct_io and not self.is_direct:
                raise ConfigError(f"O_DIRECT is not supported on {self.directory}", field="nvme.direct_io")
        except BaseException:
            self.close()
            for path in created:
                path.unlink(missing_ok=True)
            raise

    def _open_one(self, path: Path, index: int, *, fresh: bool, created: list[Path]) -> int:
        expected = self._superblock(index)
        file_bytes = self.file_bytes(index)
        if fresh:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            created.append(path)
            try:
                self._preallocate(fd, path, file_bytes)
            except BaseException:
                os.close(fd)
                raise
            os.pwrite(fd, expected, 0)
            os.fsync(fd)
            return fd
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        found = os.pread(fd, len(expected), 0)
        if found[:8] == _FILE_MAGIC and found[8:10] != expected[8:10]:
            os.close(fd)
            version = int.from_bytes(found[8:10], "little")
            raise ConfigError(
                f"{path} has slot format version {version}, this build reads {FORMAT_VERSION}; point "
                "nvme.dir at an empty directory or delete its slot files (their pages are recomputed)",
                field="nvme.dir",
            )
        if found != expected:
            os.close(fd)
            raise ConfigError(
                f"{path} was created for another geometry or capacity (superblock differs); point "
                "nvme.dir at an empty directory or delete its slot files",
                field="nvme.dir",
            )
        if os.fstat(fd).st_size < file_bytes:
            # A truncated file: give the lost tail back its extents (they read as empty
            # slots); the slot cut in the middle fails its checksum at recovery.
            self._preallocate(fd, path, file_bytes)
        return fd

    def _take_directory_lock(self) -> None:
        """One pool per directory: two writers would hand the same slot to two pages."""
        fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"nvme directory {self.directory} is in use by another pool (process or worker); give each "
                "worker its own directory",
                field="nvme.dir",
            ) from None
        self._lock_fd = fd

    @staticmethod
    def _preallocate(fd: int, path: Path, file_bytes: int) -> None:
        try:
            os.posix_fallocate(fd, 0, file_bytes)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise DiskFull(
                    f"cannot preallocate {file_bytes} bytes for {path}: {os.strerror(exc.errno)}; free disk "
                    "space or lower the NVMe capacity",
                    field="nvme.capacity_bytes",
                ) from exc
            raise

    def _switch_to_direct(self) -> bool:
        """Reopen every file with O_DIRECT when the filesystem takes it (tmpfs and some
        overlays refuse it with EINVAL, at open or at the first I/O)."""
        direct: list[int] = []
        probe = _aligned_buffer(ALIGN)
        try:
            for index in range(self.num_files):
                fd = os.open(self._file_path(index), os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
                direct.append(fd)
                os.preadv(fd, [probe], 0)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            for fd in direct:
                os.close(fd)
            return False
        for fd in self._fds:
            os.close(fd)
        self._fds = direct
        return True

    def close(self) -> None:
        if self._fds:
            self.flush_frees()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> NvmePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def slots_in_file(self, index: int) -> int:
        return min(self.slots_per_file, self.num_slots - index * self.slots_per_file)

    def file_bytes(self, index: int) -> int:
        """Size of slot file ``index``: superblock, whole groups, and a short last group."""
        n = self.slots_in_file(index)
        full, rest = divmod(n, self.slots_per_group)
        return ALIGN + full * self.group_bytes + (HEADER_BYTES + rest * self.payload_bytes if rest else 0)

    def _header_offset(self, i: int) -> int:
        """File offset of the header block of local slot ``i``'s group."""
        return ALIGN + (i // self.slots_per_group) * self.group_bytes

    def _payload_offset(self, i: int) -> int:
        g, j = divmod(i, self.slots_per_group)
        return ALIGN + g * self.group_bytes + HEADER_BYTES + j * self.payload_bytes

    def locate(self, slot: SlotId | int) -> SlotLocation:
        """Where ``slot``'s record and payload are on disk (for tools and fault tests)."""
        index, i = divmod(int(slot), self.slots_per_file)
        record_at = self._header_offset(i) + (i % self.slots_per_group) * self.record_bytes
        return SlotLocation(self._file_path(index), record_at, self._payload_offset(i))

    def _span(self, first_slot: int, num_slots: int) -> _Span:
        index, first = divmod(first_slot, self.slots_per_file)
        end = first + num_slots
        assert end <= self.slots_in_file(index), "a run never crosses a file boundary"
        g_size, n_file = self.slots_per_group, self.slots_in_file(index)
        groups = range(first // g_size, (end - 1) // g_size + 1)
        shared = tuple(
            g for g in (groups[0], groups[-1]) if first > g * g_size or end < min(n_file, (g + 1) * g_size)
        )
        return _Span(self._fds[index], index, first, end, groups, tuple(sorted(set(shared))))

    def _locks_for(self, file_index: int, groups: Sequence[int]) -> list[threading.Lock]:
        stripes = {(file_index * 7919 + g) % len(self._group_locks) for g in groups}
        return [self._group_locks[i] for i in sorted(stripes)]

    # ---- allocation -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Slots an allocation can get (releasing ones included: it flushes them)."""
        return len(self._free) + len(self._releasing)

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    def counts(self) -> NvmeCounts:
        with self._lock:
            stored = len(self._entries)
            free, releasing = len(self._free), len(self._releasing)
            return NvmeCounts(
                self.num_slots, free, self.num_slots - free - releasing - stored, stored, releasing
            )

    def allocate(self) -> SlotId | None:
        got = self.allocate_many(1)
        return got[0] if got else None

    def allocate_many(self, n: int) -> list[SlotId] | None:
        """``n`` reserved slots, lowest free ids first (so they tend to form runs), then
        releasing ones, or ``None`` when fewer than ``n`` are free (all or nothing).

        A releasing slot is handed out without its FREE rewrite (no I/O on the caller's
        thread): its stale COMPLETE header names the freed page, verified and under its
        own key, until the next write replaces it, which is what a crash before the
        flush would have left anyway."""
        with self._lock:
            if n > len(self._free) + len(self._releasing):
                return None
            slots = [heapq.heappop(self._free) for _ in range(min(n, len(self._free)))]
            short = n - len(slots)
            if short:
                self._releasing.sort()
                slots.extend(self._releasing[:short])
                self._stale.update(self._releasing[:short])
                del self._releasing[:short]
            for s in slots:
                self._state[s] = _RESERVED
            return slots

    def free(self, slot: SlotId) -> None:
        """Give back a reserved or stored slot. No I/O: a stored slot is RELEASING until
        ``flush_frees`` marks its header FREE (the transfer engine's disk lane does that
        before each NVMe job) or ``allocate_many`` hands it out again, so a free on the
        engine thread never waits for the disk. A crash before the flush brings the page
        back at the next start, verified and under its own key: never wrong bytes."""
        with self._lock:
            state = self._state[slot]
            if state in (_FREE, _RELEASING):
                raise IntegrityError(f"free of nvme slot {slot} that is already free")
            entry = self._entries.pop(slot, None)
            if entry is not None:
                del self._by_key[(entry.key, entry.namespace)]
                self._is_stored[slot] = False
            if entry is not None or slot in self._stale:
                self._stale.discard(slot)
                self._state[slot] = _RELEASING
                self._releasing.append(slot)
            else:
                self._state[slot] = _FREE
                heapq.heappush(self._free, slot)

    def flush_frees(self) -> int:
        """Mark every releasing slot FREE on disk and make it allocatable; returns how many."""
        with self._lock:
            batch, self._releasing = self._releasing, []
            generations = [self._take_generation() for _ in batch]
        if batch:
            self._invalidate(batch, generations)
        with self._lock:
            for slot in batch:
                self._state[slot] = _FREE
                heapq.heappush(self._free, slot)
        return len(batch)

    def entry(self, slot: SlotId) -> tuple[PageKey, NamespaceDigest, int] | None:
        """``(key, namespace, checksum)`` of a stored slot, ``None`` otherwise."""
        with self._lock:
            e = self._entries.get(slot)
            return (e.key, e.namespace, e.checksum) if e else None

    def is_reserved(self, slot: SlotId) -> bool:
        """Allocated and not written yet: a valid target for ``write_pages``."""
        with self._lock:
            return self._state[slot] == _RESERVED

    def reserved_mask(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """``is_reserved`` for many slots under one lock (bool array)."""
        ids = np.asarray(slots, dtype=np.int64).tolist()
        with self._lock:
            state = self._state
            return np.fromiter((state[s] == _RESERVED for s in ids), dtype=bool, count=len(ids))

    def stored_mask(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """Whether each slot holds a page (``entry`` is not None), under one lock."""
        ids = np.asarray(slots, dtype=np.int64)
        with self._lock:
            return self._is_stored[ids]

    def lookup(self, key: PageKey, namespace: NamespaceDigest) -> SlotId | None:
        with self._lock:
            return self._by_key.get((key, namespace))

    def _take_generation(self) -> int:
        g = self._next_generation
        self._next_generation += 1
        return g

    def _invalidate(self, slots: Sequence[int], generations: Sequence[int]) -> None:
        """Rewrite the records of ``slots`` FREE, one read-change-write per header block."""
        by_block: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        g_size = self.slots_per_group
        for slot, generation in zip(slots, generations, strict=True):
            index, i = divmod(int(slot), self.slots_per_file)
            by_block.setdefault((index, i // g_size), []).append((int(slot), i % g_size, int(generation)))
        block = self._scratch.header_area(HEADER_BYTES)
        zero = bytes(KEY_BYTES)
        r = self.record_bytes
        for (index, group), items in sorted(by_block.items()):
            offset = ALIGN + group * self.group_bytes
            (lock,) = self._locks_for(index, [group])
            with lock:
                try:
                    if g_size > 1 and _preadv_all(self._fds[index], [block], offset) < HEADER_BYTES:
                        block[:] = _ZERO_HEADER
                    for slot, j, generation in items:
                        header = SlotHeader(slot, SlotState.FREE, generation, 0, 0, zero, zero)
                        header.encode_into(block[j * r : (j + 1) * r])
                    os.pwritev(self._fds[index], [block], offset)
                except OSError:
                    # Best effort: a stale COMPLETE record only brings back a verified,
                    # content-addressed page at the next start, never wrong bytes.
                    pass

    # ---- I/O --------------------------------------------------------------------------
    def _runs(self, slots: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """Positions into ``slots``, grouped into runs of consecutive slots in one file (at
        most ``max_slots_per_io`` each), in slot order."""
        ids = np.asarray(slots, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        ordered = ids[order]
        # Cut at file boundaries and at multiples of max_slots_per_io (a multiple of the
        # group size, so the calls of one long run share no header block).
        local = ordered[1:] % self.slots_per_file
        breaks = (np.diff(ordered) != 1) | (local == 0) | (local % self.max_slots_per_io == 0)
        return np.split(order, np.flatnonzero(breaks) + 1)

    def _can_target(
        self, pages: torch.Tensor | Sequence[torch.Tensor], run: Sequence[int], rows: np.ndarray | None
    ) -> bool:
        """Whether I/O can go straight to the memory of the run's pages. O_DIRECT wants
        aligned addresses and lengths; otherwise the run bounces through an aligned buffer."""
        if not self.is_direct:
            return True
        if self.page_bytes % 512:
            return False
        if isinstance(pages, torch.Tensor):  # a run [n, ...] or a pool: every page aligned alike
            return pages.data_ptr() % ALIGN == 0 and self.page_bytes % ALIGN == 0
        return all(pages[i].data_ptr() % ALIGN == 0 for i in run)

    def write_pages(
        self,
        slots: Sequence[SlotId],
        pages: torch.Tensor | Sequence[torch.Tensor],
        keys: Sequence[PageKey],
        namespaces: Sequence[NamespaceDigest],
        checksums: Sequence[int] | np.ndarray,
        *,
        parents: Sequence[PageKey | None] | None = None,
        tokens: Sequence[Sequence[int]] | None = None,
        rows: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        """Store page i (host memory) in reserved ``slots[i]``. Page i is ``pages[i]`` of a
        run tensor ``[n, ...]`` or a list, or, with ``rows``, ``pages[rows[i]]`` of a pool
        tensor (no per-page tensor is made).

        Consecutive slots go out in one ``pwritev`` each, headers encoded per run in one
        batch. ``checksums`` are the values taken when the pages left HBM; they are stored,
        not recomputed, so corruption in between is caught at promotion rather than
        laundered here. Raises ``DiskFull``/``NvmeIOError`` with every slot of the call
        free again.
        """
        n = len(slots)
        row_ids = None if rows is None else np.asarray(rows, dtype=np.int64)
        for name, seq in (
            ("pages" if row_ids is None else "rows", pages if row_ids is None else row_ids),
            ("keys", keys),
            ("namespaces", namespaces),
            ("checksums", checksums),
            ("parents", parents if parents is not None else slots),
            ("tokens", tokens if tokens is not None else slots),
        ):
            if len(seq) != n:
                raise InvalidArgument(f"write_pages: {n} slots but {len(seq)} {name}", field=name)
        if tokens is not None:
            longest = max((len(t) for t in tokens), default=0)
            if longest > self.max_tokens_per_slot:
                raise InvalidArgument(
                    f"a slot record of this geometry holds at most {self.max_tokens_per_slot} tokens, "
                    f"got {longest}",
                    field="tokens",
                )
        if isinstance(checksums, np.ndarray) and checksums.dtype in (np.uint64, np.int64):
            sums = checksums.astype(np.int64, copy=False).view(np.uint64)
        else:
            sums = np.array([int(c) & _MASK64 for c in checksums], dtype=np.uint64)
        slot_ids = np.asarray(slots, dtype=np.int64)
        with self._lock:
            for s, key, ns in zip(slot_ids.tolist(), keys, namespaces, strict=True):
                if self._state[s] != _RESERVED:
                    raise InvalidArgument(f"write_pages: nvme slot {s} is not reserved (allocate it first)")
                other = self._by_key.get((key, ns))
                if other is not None:
                    raise InvalidArgument(f"write_pages: page already stored in nvme slot {other}")
            first_generation = self._next_generation
            self._next_generation += n
        generations = np.arange(first_generation, first_generation + n, dtype=np.uint64)
        source = _page_views(pages, n, self.page_bytes, row_ids)
        fields = _HeaderFields(slot_ids, generations, sums, keys, namespaces, parents, tokens)
        written = 0
        encoded: list[bytes] = [b""] * n
        crcs = np.zeros(n, dtype=np.uint32)
        touched: set[int] = set()
        try:
            for run in self._runs(slot_ids):
                span = self._span(int(slot_ids[run[0]]), len(run))
                direct = self._can_target(pages, run, row_ids)
                run_headers, run_crcs = self._write_run(span, fields, run, source, direct)
                crcs[run] = run_crcs
                for i, h in zip(run.tolist(), run_headers, strict=True):
                    encoded[i] = h
                written += len(run)
                touched.add(span.fd)
            if self.sync is SyncPolicy.DATA:
                for fd in touched:
                    os.fdatasync(fd)
        except OSError as exc:
            # The failing run may have landed in part (a short write): mark every slot of
            # the call FREE on disk so none of it comes back at the next start.
            self._invalidate(slot_ids.tolist(), generations.tolist())
            with self._lock:
                for s in slot_ids.tolist():
                    self._state[s] = _FREE
                    heapq.heappush(self._free, SlotId(s))
                    self._stale.discard(SlotId(s))
            where = f"{written} of {n} pages written to {self.directory} before the failure"
            if exc.errno in _NO_SPACE:
                raise DiskFull(
                    f"NVMe tier out of space ({os.strerror(exc.errno)}); {where}; the pages "
                    "were not stored, drop them or free slots"
                ) from exc
            raise NvmeIOError(f"NVMe write failed ({exc}); {where}") from exc
        with self._lock:
            self._is_stored[slot_ids] = True
            self._expect_generation[slot_ids] = generations
            self._expect_checksum[slot_ids] = sums
            self._expect_crc[slot_ids] = crcs
            columns = zip(slot_ids.tolist(), generations.tolist(), sums.tolist(), strict=True)
            for i, (s, g, c) in enumerate(columns):
                self._stale.discard(SlotId(s))
                self._state[s] = _STORED
                self._entries[SlotId(s)] = _Entry(keys[i], namespaces[i], c, g, encoded[i])
                self._by_key[(keys[i], namespaces[i])] = SlotId(s)

    def _write_run(
        self, span: _Span, fields: _HeaderFields, run: np.ndarray, source: _Pages, direct: bool
    ) -> tuple[list[bytes], np.ndarray]:
        """Write one run of slots (header blocks and payloads, one ``pwritev``, plus the
        header block before the run's first payload when the run starts inside a group);
        returns each record's significant bytes and crc."""
        k = len(run)
        g_size, r_bytes, p_bytes = self.slots_per_group, self.record_bytes, self.payload_bytes
        table, encoded = self._encode_headers(fields, run)
        crcs = table.reshape(-1).view(self._record)["crc"].copy()
        num_groups = len(span.groups)
        blocks = self._scratch.header_area(num_groups * HEADER_BYTES)
        records = np.frombuffer(blocks, dtype=np.uint8).reshape(num_groups * g_size, r_bytes)
        base = span.groups[0] * g_size
        lead = span.first % g_size != 0  # the first group's block sits before slots not ours
        pad = memoryview(self._zero_pad)[: p_bytes - self.page_bytes]
        staging = None if direct else self._scratch.staging_area(k * p_bytes)
        positions = run.tolist()
        locks = self._locks_for(span.file_index, span.shared)
        for lock in locks:
            lock.acquire()
        try:
            for gi, g in enumerate(span.groups):
                block = blocks[gi * HEADER_BYTES : (gi + 1) * HEADER_BYTES]
                offset = ALIGN + g * self.group_bytes
                if g not in span.shared or _preadv_all(span.fd, [block], offset) < HEADER_BYTES:
                    records[gi * g_size : (gi + 1) * g_size] = 0
            records[span.first - base : span.end - base] = table
            if staging is not None:
                for j, i in enumerate(positions):
                    area = staging[j * p_bytes : (j + 1) * p_bytes]
                    area[: self.page_bytes] = source.views[i]
                    area[self.page_bytes :] = pad
            iov = self._run_iov(span, positions, source, blocks, staging, pad)
            start = self._payload_offset(span.first) if lead else self._header_offset(span.first)
            _pwritev_all(span.fd, iov, start)
            if lead:
                _pwritev_all(span.fd, [blocks[:HEADER_BYTES]], self._header_offset(span.first))
        finally:
            for lock in reversed(locks):
                lock.release()
        return encoded, crcs

    def _run_iov(
        self,
        span: _Span,
        positions: list[int],
        source: _Pages,
        blocks: memoryview,
        staging: memoryview | None,
        pad: memoryview,
    ) -> list[memoryview]:
        """The iovecs of one run from its first header block (or, when the run starts inside a
        group, its first payload) on: each group's block, then its payloads, merged into
        one segment where the pages are consecutive rows of one tensor (``pad`` after each
        page whose size is not a multiple of 4096; ``staging`` instead of the pages when
        the run bounces)."""
        g_size, p_bytes, page_bytes = self.slots_per_group, self.payload_bytes, self.page_bytes
        first, k = span.first, len(positions)
        local = np.arange(first, first + k)
        # Segments start at every group start (a header block goes before them) and, for
        # pages taken from a tensor, wherever the rows stop being consecutive.
        starts_group = local % g_size == 0
        if staging is None and not len(pad) and source.rows is not None:
            rows = source.rows[positions]
            breaks = starts_group[1:] | (np.diff(rows) != 1)
        else:
            rows = None
            breaks = starts_group[1:] if staging is not None else np.ones(k - 1, dtype=bool)
        cuts = [0, *(np.flatnonzero(breaks) + 1).tolist(), k]
        group_starts = starts_group[cuts[:-1]].tolist()
        base_group = span.groups[0]
        iov: list[memoryview] = []
        for a, b, at_group in zip(cuts[:-1], cuts[1:], group_starts, strict=True):
            if at_group:
                gi = (first + a) // g_size - base_group
                iov.append(blocks[gi * HEADER_BYTES : (gi + 1) * HEADER_BYTES])
            if staging is not None:
                iov.append(staging[a * p_bytes : b * p_bytes])
            elif rows is not None:
                assert source.whole is not None
                r0 = int(rows[a])
                iov.append(source.whole[r0 * page_bytes : (r0 + b - a) * page_bytes])
            else:
                iov.append(source.views[positions[a]])
                if len(pad):
                    iov.append(pad)
        return iov

    def _encode_headers(self, f: _HeaderFields, run: np.ndarray) -> tuple[np.ndarray, list[bytes]]:
        """COMPLETE records for the slots at positions ``run``, byte for byte what
        ``SlotHeader.encode_into`` writes, in the thread's encode area; returns the area as
        ``[k, record_bytes]`` uint8 and each record's significant bytes."""
        k = len(run)
        scratch = self._scratch
        area, table = scratch.encode_area(k)
        positions = run.tolist()
        counts = np.zeros(k, dtype=np.int64)
        token_rows: list[Sequence[int]] = []
        if f.tokens is not None:
            token_rows = [f.tokens[i] for i in positions]
            counts = np.fromiter((len(t) for t in token_rows), dtype=np.int64, count=k)
        significant = _TOKENS_AT + 4 * counts
        dirty = max(scratch.encoded_dirty, int(significant.max()))
        table[:, :dirty] = 0
        scratch.encoded_dirty = dirty
        rec = table.reshape(-1).view(self._record)
        rec["magic"] = _SLOT_MAGIC
        rec["version"] = FORMAT_VERSION
        rec["state"] = int(SlotState.COMPLETE)
        rec["slot"] = f.slots[run]
        rec["generation"] = f.generations[run]
        rec["payload_bytes"] = self.page_bytes
        rec["checksum"] = f.checksums[run]
        rec["algorithm"] = CHECKSUM_ALGORITHM
        rec["num_tokens"] = counts
        rec["key"] = [f.keys[i] for i in positions]
        rec["namespace"] = [f.namespaces[i] for i in positions]
        if f.parents is not None:
            parents = [f.parents[i] for i in positions]
            rec["flags"] = [p is not None for p in parents]
            rec["parent"] = [p or b"" for p in parents]
        if token_rows:
            ints = table.view("<i4")
            first = _TOKENS_AT // 4
            if counts.min() == counts.max():
                ints[:, first : first + int(counts[0])] = np.asarray(token_rows, dtype="<i4").reshape(k, -1)
            else:
                for j, t in enumerate(token_rows):
                    ints[j, first : first + len(t)] = np.asarray(t, dtype="<i4")
        crcs = np.empty(k, dtype=np.uint32)
        r = self.record_bytes
        ends = significant.tolist()
        for j in range(k):
            base = j * r
            fixed = zlib.crc32(area[base : base + _HEADER.size])
            crcs[j] = zlib.crc32(area[base + _TOKENS_AT : base + ends[j]], fixed)
        rec["crc"] = crcs
        encoded = [bytes(area[j * r : j * r + ends[j]]) for j in range(k)]
        return table, encoded

    def stored_checksums(self, slots: Sequence[SlotId] | np.ndarray) -> np.ndarray:
        """The checksums (uint64) stored with ``slots``, 0 for a slot that holds no page."""
        ids = np.asarray(slots, dtype=np.int64)
        with self._lock:
            return np.where(self._is_stored[ids], self._expect_checksum[ids], np.uint64(0))

    def read_pages(
        self, slots: Sequence[SlotId], out: torch.Tensor | Sequence[torch.Tensor]
    ) -> list[SlotVerdict]:
        """Read stored ``slots[i]`` into ``out[i]`` and verify each one.

        Returns one verdict per slot; bytes of a slot whose verdict is not OK are
        garbage and must not be used (the caller frees the slot and recomputes). A run
        ``out`` tensor ``[n, ...]`` is checksummed in one pass (``kvtier.tiers.copy``).
        """
        n = len(slots)
        if len(out) != n:
            raise InvalidArgument(f"read_pages: {n} slots but {len(out)} output pages", field="out")
        slot_ids = np.asarray(slots, dtype=np.int64)
        with self._lock:
            stored = self._is_stored[slot_ids]
            if not stored.all():
                raise InvalidArgument(f"read_pages: nvme slot {int(slot_ids[~stored][0])} holds no page")
            generations = self._expect_generation[slot_ids]
            checksums = self._expect_checksum[slot_ids]
            crcs = self._expect_crc[slot_ids]
        source = _page_views(out, n, self.page_bytes)
        header_ok = np.zeros(n, dtype=bool)
        suspects: list[tuple[int, memoryview | None]] = []  # (position, record) to look at closely
        for run in self._runs(slot_ids):
            positions = run.tolist()
            span = self._span(int(slot_ids[positions[0]]), len(positions))
            direct = self._can_target(out, positions, None)
            records, complete = self._read_run(span, positions, source, direct)
            # The fast path: the record is the one this pool wrote (same slot, generation,
            # checksum and crc over all its significant bytes).
            rec = records.reshape(-1).view(self._record)
            ok = (
                complete
                & (rec["magic"] == _SLOT_MAGIC)
                & (rec["version"] == FORMAT_VERSION)
                & (rec["state"] == int(SlotState.COMPLETE))
                & (rec["slot"] == slot_ids[run])
                & (rec["generation"] == generations[run])
                & (rec["checksum"] == checksums[run])
                & (rec["crc"] == crcs[run])
            )
            header_ok[run] = ok
            for j in np.flatnonzero(~ok).tolist():
                suspects.append((positions[j], memoryview(records[j]) if complete[j] else None))
        # Verify the bytes where they landed (after any bounce copy): end to end.
        if isinstance(out, torch.Tensor):
            sums = page_copy.checksums(out).numpy().view(np.uint64)
        else:
            sums = np.array([to_unsigned(int(page_checksums(t.reshape(1, -1))[0])) for t in out], np.uint64)
        payload_ok = sums == checksums
        if header_ok.all() and payload_ok.all():
            return [SlotVerdict.OK] * n
        result = [SlotVerdict.OK if p else SlotVerdict.CHECKSUM_MISMATCH for p in payload_ok.tolist()]
        with self._lock:
            entries = {i: self._entries.get(SlotId(int(slot_ids[i]))) for i, _ in suspects}
        for i, raw in suspects:
            entry = entries[i]
            verdict = (
                SlotVerdict.WRONG_PAGE
                if entry is None
                else _check_header(raw, int(slot_ids[i]), entry, self.page_bytes)
            )
            if verdict is not SlotVerdict.OK:
                result[i] = verdict
        return result

    def _read_run(
        self, span: _Span, positions: list[int], source: _Pages, direct: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Read one run (its header blocks and payloads in one ``preadv``, plus the block
        before the first payload when the run starts inside a group); returns the run's
        records (``[k, record_bytes]`` uint8, a copy) and which slots were read in full (the
        file may end early)."""
        k = len(positions)
        g_size, r_bytes, p_bytes = self.slots_per_group, self.record_bytes, self.payload_bytes
        blocks = self._scratch.header_area(len(span.groups) * HEADER_BYTES)
        lead = span.first % g_size != 0
        staging = None if direct else self._scratch.staging_area(k * p_bytes)
        sink = self._scratch.staging_area(p_bytes) if staging is None else None
        pad = (sink or memoryview(b""))[: p_bytes - self.page_bytes]
        iov = self._run_iov(span, positions, source, blocks, staging, pad)
        start = self._payload_offset(span.first) if lead else self._header_offset(span.first)
        num_read = _preadv_all(span.fd, iov, start)
        lead_ok = True
        if lead:
            got = _preadv_all(span.fd, [blocks[:HEADER_BYTES]], self._header_offset(span.first))
            lead_ok = got == HEADER_BYTES
        local = np.arange(span.first, span.end)
        ends = ALIGN + (local // g_size) * self.group_bytes + HEADER_BYTES + (local % g_size + 1) * p_bytes
        complete = (ends - start <= num_read) & lead_ok
        if staging is not None:
            for j in np.flatnonzero(complete).tolist():
                source.views[positions[j]][:] = staging[j * p_bytes : j * p_bytes + self.page_bytes]
        base = span.groups[0] * g_size
        records = np.frombuffer(blocks, dtype=np.uint8).reshape(-1, r_bytes)[local - base]  # a copy
        return records, complete

    # ---- recovery ---------------------------------------------------------------------
    def recover(self) -> RecoveryReport:
        """Rebuild the slot table from disk: every slot whose header is intact, COMPLETE
        and (unless disabled) whose payload matches its checksum comes back with its key
        and namespace; torn or corrupt slots are discarded, their headers marked FREE.

        Called by the constructor; calling it again needs a pool with no reserved slot.
        """
        self.flush_frees()
        with self._lock:
            if any(s == _RESERVED for s in self._state):
                raise FailedPrecondition("recover() while slots are reserved (a write may be in flight)")
            self._state = [_FREE] * self.num_slots
            self._is_stored[:] = False
            self._entries.clear()
            self._by_key.clear()
        report = RecoveryReport()
        best: dict[tuple[bytes, bytes], tuple[SlotId, SlotHeader]] = {}
        bad: list[SlotId] = []
        max_generation = 0
        chunk = self.max_slots_per_io  # a multiple of the group size: chunks hold whole groups
        buf = _aligned_buffer(self._span_bytes(chunk))  # freed with the last reference
        starts = [
            start
            for first in range(0, self.num_slots, self.slots_per_file)
            for start in range(first, min(self.num_slots, first + self.slots_per_file), chunk)
        ]
        for start in starts:
            end = min(self.num_slots, start + chunk, (start // self.slots_per_file + 1) * self.slots_per_file)
            for slot, header, reason in self._scan(list(range(start, end)), buf):
                if header is not None:
                    max_generation = max(max_generation, header.generation)
                if reason is not None:
                    report.discarded.append((SlotId(slot), reason))
                    bad.append(SlotId(slot))
                elif header is None or header.state is not SlotState.COMPLETE:
                    report.num_empty += 1
                else:
                    ident = (header.key, header.namespace)
                    prev = best.get(ident)
                    if prev is None or prev[1].generation < header.generation:
                        if prev is not None:
                            report.discarded.append((prev[0], f"duplicate of slot {slot}"))
                            bad.append(prev[0])
                        best[ident] = (SlotId(slot), header)
                    else:
                        report.discarded.append((SlotId(slot), f"duplicate of slot {prev[0]}"))
                        bad.append(SlotId(slot))
        with self._lock:
            self._next_generation = max(self._next_generation, max_generation + 1)
            for (key, ns), (slot, h) in sorted(best.items(), key=lambda kv: kv[1][0]):
                self._state[slot] = _STORED
                encoded = h.encode()
                self._entries[slot] = _Entry(
                    PageKey(key), NamespaceDigest(ns), h.payload_checksum, h.generation, encoded
                )
                self._is_stored[slot] = True
                self._expect_generation[slot] = h.generation
                self._expect_checksum[slot] = h.payload_checksum
                self._expect_crc[slot] = int.from_bytes(encoded[_HEADER.size : _HEADER.size + 4], "little")
                self._by_key[(key, ns)] = slot
                report.recovered.append(
                    RecoveredPage(
                        slot,
                        PageKey(key),
                        NamespaceDigest(ns),
                        h.payload_checksum,
                        h.generation,
                        h.parent_key,
                        h.tokens,
                    )
                )
            self._free = [SlotId(s) for s in range(self.num_slots) if self._state[s] == _FREE]
            heapq.heapify(self._free)
            generations = [self._take_generation() for _ in bad]
        if bad:
            self._invalidate(bad, generations)
        report.discarded.sort()
        return report

    def _span_bytes(self, num_slots: int) -> int:
        """Bytes from the header block of a group-aligned slot to the end of the payload
        ``num_slots`` slots later."""
        return self._payload_offset(num_slots - 1) + self.payload_bytes - ALIGN

    def _scan(self, slots: list[int], buf: memoryview) -> list[tuple[int, SlotHeader | None, str | None]]:
        """Decode and verify group-aligned consecutive ``slots`` of one file."""
        span = self._span(slots[0], len(slots))
        g_size, r_bytes, p_bytes = self.slots_per_group, self.record_bytes, self.payload_bytes
        start = self._header_offset(span.first)
        view = memoryview(buf)[: self._span_bytes(len(slots))]
        if self._verify_on_recover:
            num_read = _preadv_all(span.fd, [view], start)
            complete = [
                self._payload_offset(span.first + j) + p_bytes - start <= num_read for j in range(len(slots))
            ]
        else:
            complete = []
            for g in span.groups:
                at = (g - span.groups[0]) * self.group_bytes
                got = _preadv_all(span.fd, [view[at : at + HEADER_BYTES]], start + at)
                complete.extend([got == HEADER_BYTES] * min(g_size, span.end - g * g_size))
        out: list[tuple[int, SlotHeader | None, str | None]] = []
        payloads: list[int] = []
        for j, slot in enumerate(slots):
            if not complete[j]:
                out.append((slot, None, SlotVerdict.SHORT_READ.value))
                continue
            at = (j // g_size) * self.group_bytes + (j % g_size) * r_bytes
            try:
                header = SlotHeader.decode(view[at : at + r_bytes])
            except ValueError as exc:
                out.append((slot, None, f"{SlotVerdict.HEADER_CORRUPT.value}: {exc}"))
                continue
            reason = None
            if header is not None and header.state is SlotState.COMPLETE:
                if header.slot != slot:
                    reason = f"{SlotVerdict.WRONG_PAGE.value}: header names slot {header.slot}"
                elif header.payload_bytes != self.page_bytes or header.algorithm != CHECKSUM_ALGORITHM:
                    reason = f"{SlotVerdict.HEADER_CORRUPT.value}: payload size or checksum algorithm differs"
                elif self._verify_on_recover:
                    payloads.append(j)
            out.append((slot, header, reason))
        if payloads:
            whole = torch.frombuffer(buf, dtype=torch.uint8, count=len(view))
            sums: list[int] = []
            for g0 in range(0, len(slots), g_size):
                picked = [j - g0 for j in payloads if g0 <= j < g0 + g_size]
                if picked:
                    at = (g0 // g_size) * self.group_bytes + HEADER_BYTES
                    n_group = min(g_size, len(slots) - g0)
                    pages = whole[at : at + n_group * p_bytes].view(n_group, p_bytes)[:, : self.page_bytes]
                    sums.extend(page_checksums(pages[picked]).tolist())
            for j, value in zip(payloads, sums, strict=True):
                slot, header, _ = out[j]
                assert header is not None
                if to_unsigned(value) != header.payload_checksum:
                    out[j] = (slot, header, SlotVerdict.CHECKSUM_MISMATCH.value)
            del whole
        return out

    # ---- integrity --------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise with the numbers when the slot table does not add up."""
        with self._lock:
            problems: list[str] = []
            free = set(self._free)
            if len(free) != len(self._free):
                problems.append("a slot appears twice in the free list")
            num_free = sum(1 for s in self._state if s == _FREE)
            num_reserved = sum(1 for s in self._state if s == _RESERVED)
            num_stored = sum(1 for s in self._state if s == _STORED)
            num_releasing = sum(1 for s in self._state if s == _RELEASING)
            if any(self._state[s] != _FREE for s in free) or len(free) != num_free:
                problems.append(f"free list has {len(free)} slots, table has {num_free} free")
            releasing = set(self._releasing)
            if (
                len(releasing) != len(self._releasing)
                or len(releasing) != num_releasing
                or any(self._state[s] != _RELEASING for s in releasing)
            ):
                problems.append(f"releasing list has {len(self._releasing)} slots, table has {num_releasing}")
            if set(self._entries) != {s for s in range(self.num_slots) if self._state[s] == _STORED}:
                problems.append(f"{len(self._entries)} entries for {num_stored} stored slots")
            if set(np.flatnonzero(self._is_stored).tolist()) != set(self._entries):
                problems.append(f"{int(self._is_stored.sum())} slots marked stored, {len(self._entries)} entries")
            if len(self._by_key) != len(self._entries) or any(
                self._entries.get(s) is None or (self._entries[s].key, self._entries[s].namespace) != k
                for k, s in self._by_key.items()
            ):
                problems.append("key map disagrees with the slot entries")
            if num_free + num_reserved + num_stored + num_releasing != self.num_slots:
                problems.append(
                    f"free {num_free} + reserved {num_reserved} + stored {num_stored} + releasing "
                    f"{num_releasing} != total {self.num_slots}"
                )
            if any(self._state[s] != _RESERVED for s in self._stale):
                problems.append("a slot with a stale header is tracked but not reserved")
            if any(e.generation >= self._next_generation for e in self._entries.values()):
                problems.append("an entry's generation is not below the next generation")
        if problems:
            raise IntegrityError("nvme pool integrity: " + "; ".join(problems))


def _check_header(raw: memoryview | None, slot: int, entry: _Entry, page_bytes: int) -> SlotVerdict:
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


def _advance(iov: list[memoryview], done: int) -> list[memoryview]:
    """The buffers still to transfer after ``done`` bytes of ``iov`` went through."""
    rest: list[memoryview] = []
    for b in iov:
        if done >= len(b):
            done -= len(b)
            continue
        rest.append(b[done:])
        done = 0
    return rest


def _pwritev_all(fd: int, iov: list[memoryview], offset: int) -> None:
    total = sum(len(b) for b in iov)
    done = 0
    while done < total:
        n = os.pwritev(fd, _advance(iov, done) if done else iov, offset + done)
        if n == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        done += n


def _preadv_all(fd: int, iov: list[memoryview], offset: int) -> int:
    """Bytes read; fewer than asked only at end of file."""
    total = sum(len(b) for b in iov)
    done = 0
    while done < total:
        n = os.preadv(fd, _advance(iov, done) if done else iov, offset + done)
        if n == 0:
            break
        done += n
    return done
