"""tllm.log: the handler on tllm's and uvicorn's loggers (not the root's), text and JSON
lines, the request id on lines logged while serving a request, secrets redacted."""
from __future__ import annotations

import io
import json
import logging

import pytest

from tllm.log import (REQUEST_ID, LogSettings, TllmHandler, active_settings, apply_settings,
                      configure_logging, unconfigure_logging)


@pytest.fixture()
def stream():
    yield io.StringIO()
    unconfigure_logging()


def _json_lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_parse_with_their_fields(stream):
    configure_logging("info", "json", stream)
    token = REQUEST_ID.set("req-abc")
    try:
        logging.getLogger("tllm.serve.x").info("hello %s", "there", extra={"fields": {"n": 3}})
    finally:
        REQUEST_ID.reset(token)
    logging.getLogger("uvicorn.error").warning("from uvicorn")
    logging.getLogger("tllm.serve.x").debug("below the level")
    first, second = _json_lines(stream)
    assert first["level"] == "INFO" and first["logger"] == "tllm.serve.x"
    assert first["message"] == "hello there" and first["request_id"] == "req-abc"
    assert first["n"] == 3 and first["time"].endswith("Z")
    assert second["logger"] == "uvicorn.error" and "request_id" not in second


def test_exceptions_and_secrets(stream):
    configure_logging("info", "json", stream)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("tllm").exception("GET /dashboard?api_key=hunter2&x=1")
    [line] = _json_lines(stream)
    assert "hunter2" not in stream.getvalue()
    assert line["message"] == "GET /dashboard?api_key=***&x=1"
    assert "RuntimeError: boom" in line["exc_info"]


def test_text_lines_name_the_request(stream):
    configure_logging("debug", "text", stream)
    token = REQUEST_ID.set("r1")
    try:
        logging.getLogger("tllm.a").debug("inside")
    finally:
        REQUEST_ID.reset(token)
    logging.getLogger("tllm.a").info("outside")
    inside, outside = stream.getvalue().splitlines()
    assert " DEBUG tllm.a [r1] inside" in inside
    assert outside.endswith(" INFO tllm.a outside")


def test_configured_once_and_never_on_the_root(stream):
    root_handlers = list(logging.getLogger().handlers)
    configure_logging("info", "text", stream)
    configure_logging("warning", "json", stream)    # replaces the first
    for name in ("tllm", "uvicorn"):
        logger = logging.getLogger(name)
        assert [type(h) for h in logger.handlers] == [TllmHandler]
        assert logger.level == logging.WARNING and not logger.propagate
    assert logging.getLogger().handlers == root_handlers
    assert active_settings() == LogSettings("warning", "json")
    unconfigure_logging()
    assert active_settings() is None and logging.getLogger("tllm").propagate


def test_an_engine_process_applies_the_servers_settings(stream):
    apply_settings(None)
    assert active_settings() is None
    apply_settings(LogSettings("debug", "json"))
    assert active_settings("uvicorn") == LogSettings("debug", "json")


def test_unknown_level_or_format():
    with pytest.raises(ValueError):
        configure_logging("loud")
    with pytest.raises(ValueError):
        configure_logging("info", "xml")
