"""The slot files of the NVMe tier and where each slot lives in them: the files opened,
checked against their superblocks and locked (one pool per directory), O_DIRECT probed, and
the offsets, spans and header-block locks that reads, writes and recovery address slots by.
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
from typing import NamedTuple

from kvtier.cache.page_pool import PoolGeometry
from kvtier.domain.errors import ConfigError
from kvtier.tiers.nvme.buffers import aligned_buffer
from kvtier.tiers.nvme.format import (
    ALIGN,
    FILE_MAGIC,
    FILE_NAME_RE,
    FORMAT_VERSION,
    HEADER_BYTES,
    NO_SPACE_ERRNOS,
    SUPERBLOCK,
    DiskFull,
    GroupLayout,
    SlotId,
    SlotLocation,
    record_dtype,
    slot_bytes_for,
)


class Span(NamedTuple):
    """One run's slots ``[first, end)`` of one file, by local index, and the header blocks
    they touch: ``groups`` (local group ids), which of them the run shares with other slots
    (``shared``: read, changed and written back under the group's lock)."""

    fd: int
    file_index: int
    first: int
    end: int
    groups: range
    shared: tuple[int, ...]


class SlotFiles:
    """The open slot files of one directory and their layout. Owns the file descriptors and
    the directory lock; ``close`` releases both."""

    def __init__(
        self,
        directory: Path,
        num_slots: int,
        geometry: PoolGeometry,
        layout: GroupLayout,
        slots_per_file: int,
        *,
        create: bool,
        direct_io: bool | None,
    ) -> None:
        self.directory = directory
        self.num_slots = num_slots
        self.geometry = geometry
        self.page_bytes = geometry.page_bytes
        self.payload_bytes = layout.payload_bytes
        self.slots_per_group = layout.slots_per_group
        self.record_bytes = layout.record_bytes
        self.group_bytes = layout.group_bytes
        self.slot_bytes = slot_bytes_for(geometry)
        self.slots_per_file = slots_per_file
        self.record = record_dtype(self.record_bytes)
        # Striped locks for header blocks shared between runs (see Span.shared).
        self._group_locks = [threading.Lock() for _ in range(64)]
        self.fds: list[int] = []
        self._lock_fd: int | None = None
        self.is_direct = False
        self._open_files(create, direct_io)

    @property
    def num_files(self) -> int:
        return math.ceil(self.num_slots / self.slots_per_file)

    def file_path(self, index: int) -> Path:
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
                f"{self.directory} holds slot file {self.file_path(extra[0]).name} beyond the "
                f"{self.num_files} files that {self.num_slots} slots need; use the capacity it was "
                "created with or an empty directory",
                field="nvme.capacity_bytes",
            )
        want_direct = direct_io is not False and hasattr(os, "O_DIRECT")
        created: list[Path] = []
        try:
            for index in range(self.num_files):
                path = self.file_path(index)
                if index not in present and not create:
                    raise ConfigError(f"slot file {path} is missing and create=False")
                fd = self._open_one(path, index, fresh=index not in present, created=created)
                self.fds.append(fd)
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
                fd = os.open(self.file_path(index), os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
                direct.append(fd)
                os.preadv(fd, [probe], 0)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            for fd in direct:
                os.close(fd)
            return False
        for fd in self.fds:
            os.close(fd)
        self.fds = direct
        return True

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def slots_in_file(self, index: int) -> int:
        return min(self.slots_per_file, self.num_slots - index * self.slots_per_file)

    def file_bytes(self, index: int) -> int:
        """Size of slot file ``index``: superblock, whole groups, and a short last group."""
        n = self.slots_in_file(index)
        full, rest = divmod(n, self.slots_per_group)
        return ALIGN + full * self.group_bytes + (HEADER_BYTES + rest * self.payload_bytes if rest else 0)

    def header_offset(self, i: int) -> int:
        """File offset of the header block of local slot ``i``'s group."""
        return ALIGN + (i // self.slots_per_group) * self.group_bytes

    def payload_offset(self, i: int) -> int:
        g, j = divmod(i, self.slots_per_group)
        return ALIGN + g * self.group_bytes + HEADER_BYTES + j * self.payload_bytes

    def locate(self, slot: SlotId | int) -> SlotLocation:
        """Where ``slot``'s record and payload are on disk (for tools and fault tests)."""
        index, i = divmod(int(slot), self.slots_per_file)
        record_at = self.header_offset(i) + (i % self.slots_per_group) * self.record_bytes
        return SlotLocation(self.file_path(index), record_at, self.payload_offset(i))

    def span(self, first_slot: int, num_slots: int) -> Span:
        index, first = divmod(first_slot, self.slots_per_file)
        end = first + num_slots
        assert end <= self.slots_in_file(index), "a run never crosses a file boundary"
        g_size, n_file = self.slots_per_group, self.slots_in_file(index)
        groups = range(first // g_size, (end - 1) // g_size + 1)
        shared = tuple(
            g for g in (groups[0], groups[-1]) if first > g * g_size or end < min(n_file, (g + 1) * g_size)
        )
        return Span(self.fds[index], index, first, end, groups, tuple(sorted(set(shared))))

    def locks_for(self, file_index: int, groups: Sequence[int]) -> list[threading.Lock]:
        stripes = {(file_index * 7919 + g) % len(self._group_locks) for g in groups}
        return [self._group_locks[i] for i in sorted(stripes)]


    def span_bytes(self, num_slots: int) -> int:
        """Bytes from the header block of a group-aligned slot to the end of the payload
        ``num_slots`` slots later."""
        return self.payload_offset(num_slots - 1) + self.payload_bytes - ALIGN
