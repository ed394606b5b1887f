"""The transfer engine's lanes: a priority queue and worker threads per lane, and the job each
queued transfer runs as (``kvtier.tiers.transfer_engine``)."""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.tiers.transfer import Transfer, TransferDone


class Cancelled(Exception):
    """Raised inside a running transfer at a run boundary after ``cancel``."""


@dataclass(slots=True, eq=False)
class Job:
    transfer: Transfer
    lane: Lane
    ready_event: Any = None  # torch.cuda.Event recorded at submit (CUDA only)
    running: bool = False
    cancel_requested: bool = False
    done: bool = False
    moved_bytes: int = 0
    charged_bytes: int = 0  # of moved_bytes, already charged to the engine's budget
    dst_released: bool = False
    started_at: float = 0.0
    result: TransferDone | None = None  # held while the job waits on an emulated link
    # Set for a transfer its caller waits on (``run``, ``submit(awaited=True)``): its
    # TransferDone goes here instead of to ``poll_completed``.
    future: Future[TransferDone] | None = None

    @property
    def is_paced(self) -> bool:
        """Background work only: a promotion, or any transfer a caller waits on, is never paced."""
        return self.future is None and not self.transfer.is_promotion


class Lane:
    """Priority queue + worker threads. Cancelled jobs are skipped when popped."""

    def __init__(
        self, name: str, num_threads: int, run: Callable[[Job], None], intra_op_threads: int
    ) -> None:
        self.name = name
        self._intra_op_threads = intra_op_threads
        self._heap: list[tuple[int, int, Job]] = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._run = run
        self.threads = [
            threading.Thread(target=self._loop, name=f"kvtier-{name}-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self.threads:
            t.start()

    def put(self, job: Job) -> None:
        with self._cv:
            heapq.heappush(self._heap, (-job.transfer.priority, next(self._order), job))
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self.threads:
            t.join()

    def _loop(self) -> None:
        # Per-thread with the OpenMP backend. One core per lane thread leaves the rest to
        # decode, and avoids OpenMP barriers on a busy core: a 2 MiB copy_ split over 2
        # threads fell from 18 GB/s to 0.3 GB/s when another process held one of 2 cores.
        torch.set_num_threads(self._intra_op_threads)
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                _, _, job = heapq.heappop(self._heap)
            self._run(job)


