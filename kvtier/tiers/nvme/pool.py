"""The NVMe tier: fixed-size page slots in preallocated files (DESIGN §6, decision record 0002).

``NvmePool`` opens and locks the slot files and holds the slot table; its concepts live beside
it: the on-disk format (``format``), slot allocation (``slots``), positional I/O (``io``) and
recovery after a restart (``recovery``).

Concurrency: ``write_pages``/``read_pages`` run in transfer worker threads while the
engine thread allocates and frees; the slot table is guarded by one lock and the I/O
runs outside it (positional I/O needs no shared file offset). A caller never frees a
slot that has a read or write in flight.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvtier.cache.page_pool import PoolGeometry
from kvtier.domain.errors import (
    ConfigError,
)
from kvtier.tiers.nvme.format import (
    ALIGN,
    DEFAULT_FILE_BYTES,
    FILE_MAGIC,
    FILE_NAME_RE,
    FORMAT_VERSION,
    HEADER_BYTES,
    NO_SPACE_ERRNOS,
    SLOT_FREE,
    SUPERBLOCK,
    DiskFull,
    SlotEntry,
    SlotId,
    SlotLocation,
    SyncPolicy,
    group_layout,
    record_dtype,
    slot_bytes_for,
)
from kvtier.tiers.nvme.io import Scratch, SlotIO, Span, aligned_buffer
from kvtier.tiers.nvme.recovery import SlotRecovery
from kvtier.tiers.nvme.slots import SlotTable


class NvmePool(SlotTable, SlotIO, SlotRecovery):
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
        # Whole groups per run where possible, up to max_io_bytes: one 16 MiB run of 32 KiB pages
        # is 512 slots. A run whose iovecs exceed IOV_MAX (pages scattered in memory: a payload
        # and a pad per slot) goes out in several calls (io.preadv_all, io.pwritev_all).
        per_io = max(1, max_io_bytes // self.payload_bytes)
        self.max_slots_per_io = max(1, per_io - per_io % self.slots_per_group or per_io)
        self._record = record_dtype(self.record_bytes)
        # Striped locks for header blocks shared between runs (see Span.shared).
        self._group_locks = [threading.Lock() for _ in range(64)]
        self._verify_on_recover = verify_payload_on_recover
        self._lock = threading.Lock()
        self._scratch = Scratch(self.record_bytes)
        self._zero_pad = aligned_buffer(self.payload_bytes - self.page_bytes or ALIGN)
        self._state = [SLOT_FREE] * num_slots
        # What each stored slot's record must say (arrays, so a read checks a run of records
        # and payload checksums in a few whole-array operations): generation, payload checksum
        # and record crc, valid where _is_stored.
        self._is_stored = np.zeros(num_slots, dtype=bool)
        self._expect_generation = np.zeros(num_slots, dtype=np.uint64)
        self._expect_checksum = np.zeros(num_slots, dtype=np.uint64)
        self._expect_crc = np.zeros(num_slots, dtype=np.uint32)
        self._entries: dict[SlotId, SlotEntry] = {}
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
        body = SUPERBLOCK.pack(
            FILE_MAGIC,
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
            g.dtype_name.encode()[:16],
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
        present = sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := FILE_NAME_RE.match(p.name)))
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
        if found[:8] == FILE_MAGIC and found[8:10] != expected[8:10]:
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
            if exc.errno in NO_SPACE_ERRNOS:
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
        probe = aligned_buffer(ALIGN)
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

    def _span(self, first_slot: int, num_slots: int) -> Span:
        index, first = divmod(first_slot, self.slots_per_file)
        end = first + num_slots
        assert end <= self.slots_in_file(index), "a run never crosses a file boundary"
        g_size, n_file = self.slots_per_group, self.slots_in_file(index)
        groups = range(first // g_size, (end - 1) // g_size + 1)
        shared = tuple(
            g for g in (groups[0], groups[-1]) if first > g * g_size or end < min(n_file, (g + 1) * g_size)
        )
        return Span(self._fds[index], index, first, end, groups, tuple(sorted(set(shared))))

    def _locks_for(self, file_index: int, groups: Sequence[int]) -> list[threading.Lock]:
        stripes = {(file_index * 7919 + g) % len(self._group_locks) for g in groups}
        return [self._group_locks[i] for i in sorted(stripes)]

