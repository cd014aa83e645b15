"""Logging for tllm's commands: one handler on the "tllm" and "uvicorn" loggers (never the
root logger, so a program embedding tllm keeps its own setup), text or JSON lines, the
current request's id on every line logged while serving it, and secrets redacted.

Library use configures nothing: tllm's records propagate to whatever the program set up."""
from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
from dataclasses import asdict, dataclass
from typing import TextIO

LOGGERS = ("tllm", "uvicorn")
UVICORN_OWN = ("uvicorn", "uvicorn.error", "uvicorn.access")   # handlers: uvicorn's or ours
LEVELS = ("critical", "error", "warning", "info", "debug")
FORMATS = ("text", "json")
SECRET_QUERY = re.compile(
    r"(?i)([?&](?:api[_-]?key|key|token|access_token|session|signature|sig|password|secret)=)"
    r"[^&\s\"]*")

# The id of the HTTP request being served (set by the server's request-id middleware); a
# context variable, so each request's task sees its own.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("tllm_request_id",
                                                                        default=None)


@dataclass(frozen=True)
class LogSettings:
    """What `configure_logging` was given (an engine process applies the same)."""

    level: str = "info"
    format: str = "text"


def redact(text: str) -> str:
    """The text with the values of secret-looking query parameters replaced by ***."""
    return SECRET_QUERY.sub(r"\1***", text)


def current_request_id() -> str | None:
    return REQUEST_ID.get()


class RedactSecrets(logging.Filter):
    """Replaces the values of secret-looking query parameters in a log record's text."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        return True


class RequestIdFilter(logging.Filter):
    """Stamps each record with the current request's id (None outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    """`2025-01-02 03:04:05,678 INFO tllm.serve.x [req-id] message`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(rid)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        record.rid = f" [{request_id}]" if request_id else ""
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, request_id when
    known, `fields` given as extra={"fields": {...}} (numbers for machines), exc_info."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = {"time": f"{seconds}.{int(record.msecs):03d}Z", "level": record.levelname,
                "logger": record.name, "message": redact(record.getMessage())}
        request_id = getattr(record, "request_id", None)
        if request_id:
            line["request_id"] = request_id
        line.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            line["exc_info"] = redact(self.formatException(record.exc_info))
        return json.dumps(line, default=str)


class TllmHandler(logging.StreamHandler):
    """The handler configure_logging installs; it remembers its settings."""

    def __init__(self, settings: LogSettings, stream: TextIO | None = None) -> None:
        super().__init__(stream or sys.stderr)
        self.settings = settings
        self.setFormatter(JsonFormatter() if settings.format == "json" else TextFormatter())
        self.addFilter(RequestIdFilter())


def add_log_args(group) -> None:
    """--log-level and --log-format, for a command that calls configure_logging."""
    group.add_argument("--log-level", default="info", choices=LEVELS,
                       help="tllm's and uvicorn's log level (default info)")
    group.add_argument("--log-format", default="text", choices=FORMATS,
                       help="text lines, or JSON lines (time, level, logger, message, "
                            "request_id) for a log collector (default text)")


def configure_logging(level: str = "info", format: str = "text",
                      stream: TextIO | None = None) -> TllmHandler:
    """Log tllm's and uvicorn's records at `level` and above to stderr (or `stream`), as
    `format` lines. Calling it again replaces the earlier setup. They stop propagating to
    the root logger, so a root handler someone added does not print each line twice."""
    if level not in LEVELS or format not in FORMATS:
        raise ValueError(f"log level {level!r} / format {format!r}: expected one of "
                         f"{LEVELS} / {FORMATS}")
    handler = TllmHandler(LogSettings(level, format), stream)
    for name in UVICORN_OWN:    # uvicorn's default setup (dictConfig) may have run already
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, TllmHandler)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level.upper())
        logger.propagate = False
    return handler


def unconfigure_logging() -> None:
    """Undo configure_logging (tests; a program that wants tllm's records back)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, TllmHandler)]:
            logger.removeHandler(old)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True


def active_settings(name: str = "tllm") -> LogSettings | None:
    """The settings configure_logging installed on logger `name` (None: it did not)."""
    for handler in logging.getLogger(name).handlers:
        if isinstance(handler, TllmHandler):
            return handler.settings
    return None


def apply_settings(settings: LogSettings | None) -> None:
    """In a child process (the engine's): the parent's setup, if it had one."""
    if settings is not None:
        configure_logging(**asdict(settings))
