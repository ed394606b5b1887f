"""Logging set-up: text and JSON lines, structured fields, run ids, token redaction."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from kvtier.domain.errors import ConfigError
from kvtier.runtime.log import bind_run_id, get_logger, redact_tokens, setup_logging


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    kvtier_level = logging.getLogger("kvtier").level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("kvtier").setLevel(kvtier_level)


def test_json_lines_carry_fields_and_run_id(restore_logging: None) -> None:
    stream = io.StringIO()
    setup_logging("debug", json=True, stream=stream)
    log = get_logger("worker.engine")
    with bind_run_id("run-1"):
        log.debug("pages demoted", extra={"num_pages": 4, "tokens": redact_tokens([1, 2, 3])})
    log.info("outside")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["logger"] == "kvtier.worker.engine" and first["level"] == "debug"
    assert first["msg"] == "pages demoted" and first["num_pages"] == 4
    assert first["run_id"] == "run-1" and first["tokens"] == "<3 tokens>"
    assert "run_id" not in second


def test_text_lines_and_idempotent_setup(restore_logging: None) -> None:
    stream = io.StringIO()
    setup_logging("info", stream=io.StringIO())
    setup_logging("info", stream=stream)  # replaces the first handler instead of adding a second
    log = get_logger("kvtier.controller")
    log.debug("hidden")
    log.warning("lease lost", extra={"worker": "w1", "reason": "timed out"})
    (line,) = stream.getvalue().splitlines()
    assert 'WARNING kvtier.controller: lease lost worker=w1 reason="timed out"' in line


def test_other_libraries_stay_at_warning(restore_logging: None) -> None:
    stream = io.StringIO()
    setup_logging("debug", stream=stream)
    logging.getLogger("grpc").info("chatter")
    assert stream.getvalue() == ""


def test_bad_level_and_redaction() -> None:
    with pytest.raises(ConfigError, match="log_level must be one of debug, info, warning, error, got 'loud'"):
        setup_logging("loud")
    assert redact_tokens([7]) == "<1 token>"
    assert redact_tokens(None) == "<0 tokens>"
