"""Shutdown sequences where one failing step never skips the rest.

A process that stops its background work, closes its Redis clients and then stops its gRPC
server must stop the server even when an earlier step raised or the stop itself was
cancelled (a ``wait_for`` that timed out, Ctrl-C): otherwise the port stays bound, the
server keeps answering from half-closed state, and gRPC later tries to shut it down from a
finalizer on an event loop that is gone. ``run_steps`` runs every step in order, logs each
failure, and re-raises the first one (a cancellation included) once all have run.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable

Step = tuple[str, Callable[[], Awaitable[object] | object]]


class _Failures:
    """The steps that failed so far: each logged, the first kept to be re-raised."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self.log, self.what = log, what
        self.first: BaseException | None = None

    def note(self, name: str, exc: BaseException) -> None:
        if self.first is None:
            self.first = exc
        if isinstance(exc, Exception):
            self.log.error("%s: %s failed; going on with the rest", self.what, name, exc_info=exc)
        else:
            self.log.warning("%s: %s interrupted (%s); going on with the rest", self.what, name, type(exc).__name__)

    def raise_first(self) -> None:
        if self.first is not None:
            raise self.first


async def run_steps(steps: Iterable[Step], *, log: logging.Logger, what: str) -> None:
    """Run each ``(name, step)`` in order; a step may be sync or async.

    A step that raises (``CancelledError`` too) is logged and the next one still runs; the
    first such exception is re-raised after the last step, so a cancelled stop still ends
    cancelled and a failed one still reports its failure.
    """
    failures = _Failures(log, what)
    for name, step in steps:
        try:
            result = step()
            if inspect.isawaitable(result):
                await result
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the other steps
            failures.note(name, exc)
    failures.raise_first()


def run_steps_sync(steps: Iterable[tuple[str, Callable[[], object]]], *, log: logging.Logger, what: str) -> None:
    """``run_steps`` for synchronous steps, from a thread with no event loop of its own."""
    failures = _Failures(log, what)
    for name, step in steps:
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the other steps
            failures.note(name, exc)
    failures.raise_first()
