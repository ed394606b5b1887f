"""Logging for every kvtier process: one set-up call, text or JSON lines, structured fields.

Structured fields go in ``extra=`` (``log.info("pages demoted", extra={"num_pages": 4})``)
and come out as ``key=value`` in text or as keys of the JSON object. A request's run id
(DESIGN §9) is bound once with ``bind_run_id`` and stamped on every record logged in
that context, including by asyncio tasks started inside it (they copy the context).

Token ids and prompt or completion text never go into logs (DESIGN §5.11): log counts,
ids, and page keys shortened with ``kvtier.domain.hashing.short``. ``redact_tokens`` renders a
sequence as "<N tokens>" for the places where logging it whole would be tempting. Nothing
here inspects messages; the rule is kept by review and by using these helpers.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json as jsonlib
import logging
import sys
from collections.abc import Iterator, Sized
from typing import Any, TextIO

from kvtier.domain.errors import ConfigError

LOG_LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
ROOT_LOGGER = "kvtier"

_run_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvtier_run_id", default=None)
# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "run_id",
}


def get_logger(name: str) -> logging.Logger:
    """A logger under ``kvtier.`` so one level setting governs every kvtier module."""
    if name == ROOT_LOGGER or name.startswith(ROOT_LOGGER + "."):
        return logging.getLogger(name)
    return logging.getLogger(f"{ROOT_LOGGER}.{name}")


def redact_tokens(tokens: Sized | None) -> str:
    """How a token sequence may appear in a log line, error or span: ``"<N tokens>"``."""
    count = 0 if tokens is None else len(tokens)
    return f"<{count} token{'' if count == 1 else 's'}>"


@contextlib.contextmanager
def bind_run_id(run_id: str) -> Iterator[None]:
    token = _run_id.set(run_id)
    try:
        yield
    finally:
        _run_id.reset(token)


def current_run_id() -> str | None:
    return _run_id.get()


class RunIdFilter(logging.Filter):
    """Stamps the bound run id on each record (``extra={"run_id": ...}`` wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "run_id", None) is None:
            record.run_id = _run_id.get()
        return True


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD_ATTRS and not k.startswith("_")}


def _timestamp(record: logging.LogRecord) -> str:
    when = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class TextFormatter(logging.Formatter):
    """``2025-01-01T12:00:00.000Z INFO kvtier.worker: pages demoted num_pages=4 run=ab12``"""

    def format(self, record: logging.LogRecord) -> str:
        parts = [f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}"]
        for key, value in _fields(record).items():
            text = str(value)
            parts.append(f"{key}={jsonlib.dumps(text) if ' ' in text else text}")
        if run_id := getattr(record, "run_id", None):
            parts.append(f"run={run_id}")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers; extra fields become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if run_id := getattr(record, "run_id", None):
            entry["run_id"] = run_id
        entry.update(_fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return jsonlib.dumps(entry, default=str)


class _KvtierHandler(logging.StreamHandler):
    """Marks the handler ``setup_logging`` owns, so calling it again replaces it."""


def setup_logging(level: str = "info", json: bool = False, *, stream: TextIO | None = None) -> None:
    """Route every log record to ``stream`` (stderr) as text or JSON lines.

    kvtier loggers log at ``level``; other libraries (grpc, ray, redis) at warning or
    above, so asking for debug does not bury kvtier's lines under theirs. Idempotent.
    """
    numeric = LOG_LEVELS.get(str(level).lower())
    if numeric is None:
        raise ConfigError(
            f"log_level must be one of {', '.join(LOG_LEVELS)}, got {level!r}", field="log_level"
        )
    handler = _KvtierHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    handler.addFilter(RunIdFilter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _KvtierHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(numeric, logging.WARNING))
    logging.getLogger(ROOT_LOGGER).setLevel(numeric)
