"""Positional vectored I/O of NVMe slots: runs of consecutive slots, the iovecs of a run, and
``preadv``/``pwritev`` repeated until a whole iovec list is through. The reader
(``reader``) and writer (``writer``) call ``preadv_all``/``pwritev_all`` through this module,
so one patch here slows every disk access (the slow-disk fault test does that).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.tiers.nvme.buffers import Pages
from kvtier.tiers.nvme.files import SlotFiles, Span
from kvtier.tiers.nvme.format import ALIGN, HEADER_BYTES, IOV_MAX


class Runs:
    """How a call's slots go to disk: grouped into runs of consecutive slots of one file (at
    most ``max_slots_per_io`` each), straight into page memory where O_DIRECT allows."""

    def __init__(self, files: SlotFiles, max_slots_per_io: int) -> None:
        self._files = files
        self.max_slots_per_io = max_slots_per_io

    def split(self, slots: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """Positions into ``slots``, grouped into runs of consecutive slots in one file (at
        most ``max_slots_per_io`` each), in slot order."""
        ids = np.asarray(slots, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        ordered = ids[order]
        # Cut at file boundaries and at multiples of max_slots_per_io (a multiple of the
        # group size, so the calls of one long run share no header block).
        local = ordered[1:] % self._files.slots_per_file
        breaks = (np.diff(ordered) != 1) | (local == 0) | (local % self.max_slots_per_io == 0)
        return np.split(order, np.flatnonzero(breaks) + 1)

    def can_target(
        self, pages: torch.Tensor | Sequence[torch.Tensor], run: Sequence[int] | np.ndarray, rows: np.ndarray | None
    ) -> bool:
        """Whether I/O can go straight to the memory of the run's pages. O_DIRECT wants
        aligned addresses and lengths; otherwise the run bounces through an aligned buffer."""
        if not self._files.is_direct:
            return True
        if self._files.page_bytes % 512:
            return False
        if isinstance(pages, torch.Tensor):  # a run [n, ...] or a pool: every page aligned alike
            return pages.data_ptr() % ALIGN == 0 and self._files.page_bytes % ALIGN == 0
        return all(pages[i].data_ptr() % ALIGN == 0 for i in run)

    def iov(
        self,
        span: Span,
        positions: list[int],
        source: Pages,
        blocks: memoryview,
        staging: memoryview | None,
        pad: memoryview,
    ) -> list[memoryview]:
        """The iovecs of one run from its first header block (or, when the run starts inside a
        group, its first payload) on: each group's block, then its payloads, merged into
        one segment where the pages are consecutive rows of one tensor (``pad`` after each
        page whose size is not a multiple of 4096; ``staging`` instead of the pages when
        the run bounces)."""
        f = self._files
        g_size, p_bytes, page_bytes = f.slots_per_group, f.payload_bytes, f.page_bytes
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
                iov.append(source.view(positions[a]))
                if len(pad):
                    iov.append(pad)
        return iov


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


def pwritev_all(fd: int, iov: list[memoryview], offset: int) -> None:
    if _vectored_all(os.pwritev, fd, iov, offset) < sum(len(b) for b in iov):
        raise OSError(errno.EIO, "pwritev wrote nothing")


def preadv_all(fd: int, iov: list[memoryview], offset: int) -> int:
    """Bytes read; fewer than asked only at end of file."""
    return _vectored_all(os.preadv, fd, iov, offset)


def _vectored_all(call: Callable[[int, list[memoryview], int], int], fd: int, iov: list[memoryview], offset: int) -> int:
    """Repeat a positional vectored ``call`` until ``iov`` is through or it moves no byte; bytes
    moved. Each call takes at most ``IOV_MAX`` buffers (the kernel refuses more)."""
    total = sum(len(b) for b in iov)
    done = 0
    while done < total:
        rest = _advance(iov, done) if done else iov
        n = call(fd, rest[:IOV_MAX], offset + done)
        if n == 0:
            break
        done += n
    return done
