"""A busy machine on demand: ``--busy`` burns one core for a benchmark's duration.

A ratio that holds only on an idle machine does not hold. Every benchmark takes ``--busy``:
one extra process spins on the arithmetic of a Python loop, pinned to the machine's last
core where the platform allows, from before the first measurement to after the last. It is
bounded twice: the benchmark stops it when it ends (``busy_core`` exits), and it stops by
itself after ``max_s`` whatever happens to its parent. The JSON output records ``busy``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess

DEFAULT_MAX_S = 3600.0


def add_busy_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--busy", action="store_true",
        help="burn one core in a second process for the whole run (a busy machine; bounded by time)",
    )


def _burn(max_s: float, core: int | None) -> None:
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    deadline = time.monotonic() + max_s
    x = 0
    while time.monotonic() < deadline:
        for i in range(10_000):
            x = (x * 31 + i) % 1_000_003


@contextmanager
def busy_core(enabled: bool, *, max_s: float = DEFAULT_MAX_S) -> Iterator[BaseProcess | None]:
    """While inside, a process burns one core (the last one the scheduler lets us use); ``None``
    when not ``enabled``. The process ends when the block exits, or after ``max_s`` on its own."""
    if not enabled:
        yield None
        return
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_burn, args=(max_s, cores[-1] if cores else None), daemon=True, name="kvtier-busy")
    proc.start()
    try:
        yield proc
    finally:
        proc.terminate()
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
