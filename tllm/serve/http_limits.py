"""Limits on what a client may make the server wait for or hold: the request head under a
size cap, the body within a deadline and under a size cap (an ASGI middleware, since uvicorn
has no body-read timeout), and uvicorn's own limits on incomplete heads and idle
connections."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tllm.serve.errors import APIError

DEFAULT_BODY_READ_TIMEOUT_S = 10.0
DEFAULT_MAX_HEADER_BYTES = 16 << 10     # h11's own default, made explicit
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5        # uvicorn's default


def uvicorn_options(config) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for a ServerConfig's connection limits (h11 refuses a
    head still incomplete past max_header_bytes; RequestLimits, one that arrived whole)."""
    return {"h11_max_incomplete_event_size": config.max_header_bytes,
            "timeout_keep_alive": config.keep_alive_timeout_s}


class RequestLimits:
    """431 for a request line + headers over `max_header_bytes`. Then reads a request's whole
    body before the app runs: 408 (and the connection closed) if it has not all arrived
    `read_timeout_s` after the headers, 413 past `max_bytes` (declared or sent). The app
    then gets the body in one message; later receive() calls go to the server, so
    disconnects are still seen. A request without a Content-Type is taken as JSON."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float,
                 max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_head(scope)
            first = await self._read_body(scope, receive)
        except APIError as error:
            await error.response()(scope, receive, send)
            return
        if _header(scope, b"content-type") is None:  # a body without a type is JSON
            scope = {**scope, "headers": [*scope.get("headers", ()),
                                          (b"content-type", b"application/json")]}
        is_replayed = False

        async def replay() -> Message:
            nonlocal is_replayed
            if is_replayed:
                return await receive()
            is_replayed = True
            return first

        await self.app(scope, replay, send)

    def _check_head(self, scope: Scope) -> None:
        size = (len(scope.get("raw_path") or scope["path"]) + len(scope.get("query_string", b""))
                + sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ())))
        if size > self.max_header_bytes:
            raise APIError(431, f"the request line and headers are larger than "
                           f"{self.max_header_bytes} bytes", code="headers_too_large",
                           headers={"Connection": "close"})

    async def _read_body(self, scope: Scope, receive: Receive) -> Message:
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            raise _too_large(self.max_bytes)
        body = bytearray()
        deadline = time.monotonic() + self.read_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within "
                               f"{self.read_timeout_s:g} s", code="request_timeout",
                               headers={"Connection": "close"}) from None
            if message["type"] != "http.request":
                return message  # the client went away: the app sees the disconnect
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                raise _too_large(self.max_bytes)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": bytes(body), "more_body": False}


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than {max_bytes} bytes",
                    code="request_too_large", headers={"Connection": "close"})
