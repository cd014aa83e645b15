"""Limits on what a client may make the server wait for or hold, the same on every server
tllm starts: how many connections stay open, how long a request head and then its body may
take to arrive, how large they may be, how long an idle connection stays. The body's limits
are an ASGI middleware here (uvicorn has no body-read timeout); the connection's are
enforced by the protocol in tllm/serve/http/server.py."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tllm.cli_types import positive_float, positive_int
from tllm.serve.http.errors import APIError

DEFAULT_BODY_READ_TIMEOUT_S = 10.0
DEFAULT_MAX_HEADER_BYTES = 16 << 10     # h11's own default, made explicit


@dataclass(frozen=True)
class HttpLimits:
    """A server's connection and request limits (the flags of add_http_limit_args)."""

    max_connections: int = 1024         # beyond: an idle one is closed, or the new one refused
    header_read_timeout_s: float = 10.0     # a request head, from its first byte
    keep_alive_timeout_s: float = 5.0   # a connection without a request, before or between
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S    # after the head
    max_body_bytes: int = 16 << 20


def add_http_limit_args(group) -> None:
    """The limit flags, for every server's command line."""
    group.add_argument("--max-connections", type=positive_int, default=1024,
                       help="open connections at most: past it, the longest-idle connection "
                            "without a request is closed, or (none idle) the new one gets a "
                            "503 (default 1024)")
    group.add_argument("--header-read-timeout", type=positive_float, default=10.0,
                       help="seconds a request line + headers may take to arrive, from "
                            "their first byte; then 408 and the connection is closed "
                            "(default 10)")
    group.add_argument("--keep-alive-timeout", type=positive_float, default=5.0,
                       help="seconds a connection without a request stays open, before its "
                            "first request as between requests (default 5)")
    group.add_argument("--max-header-bytes", type=positive_int, default=16 << 10,
                       help="largest request line + headers: larger ones get a 431 and the "
                            "connection is closed (default 16 KiB)")
    group.add_argument("--body-read-timeout", type=positive_float, default=10.0,
                       help="seconds a request body may take to arrive after its headers; "
                            "then 408 and the connection is closed (default 10)")
    group.add_argument("--max-body-bytes", type=positive_int, default=16 << 20,
                       help="answer 413 to larger request bodies (default 16 MiB)")


def http_limits_from_args(args) -> HttpLimits:
    return HttpLimits(max_connections=args.max_connections,
                      header_read_timeout_s=args.header_read_timeout,
                      keep_alive_timeout_s=args.keep_alive_timeout,
                      max_header_bytes=args.max_header_bytes,
                      body_read_timeout_s=args.body_read_timeout,
                      max_body_bytes=args.max_body_bytes)


def install_request_limits(app, limits: HttpLimits) -> None:
    """Give the app its request limits (RequestLimits), and keep them on app.state for the
    server that runs it (http_server.uvicorn_config)."""
    app.state.http_limits = limits
    app.add_middleware(RequestLimits, max_bytes=limits.max_body_bytes,
                       read_timeout_s=limits.body_read_timeout_s,
                       max_header_bytes=limits.max_header_bytes)


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
