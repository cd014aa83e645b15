"""The one place that builds uvicorn's configuration, for every server tllm starts (text,
visual, router, disaggregated front, and the tests' servers), with what uvicorn lacks
against slow and idle clients:

- a header-read timeout: uvicorn's keep-alive timer is reset by every byte received and is
  not armed before a connection's first request, so a head trickled a byte at a time, or
  nothing at all, held a connection for ever. Here a connection without a request is closed
  after the keep-alive timeout (before its first request too), and a request head must be
  complete within the header-read timeout of its first byte (else 408 and close);
- a cap on open connections: past it the connection idle longest (no request in progress:
  silent, or a head still arriving) is closed to make room, so idle sockets cannot lock
  clients out; when every connection has a request in progress the new one gets a 503.
  (uvicorn's own limit_concurrency answers 503 to every new request once idle sockets fill
  it, which is the lock-out itself);
- refusals the client can read: a request h11 cannot parse (a 431 for a head past
  --max-header-bytes, else a 400) and the 503 get an OpenAI-shaped error, then a lingering
  close (our side shut, the client's further bytes read and dropped until it hangs up or
  LINGER_S pass). uvicorn closed at once, and a client still sending its head then got a
  reset that could destroy the answer before it read it;
- access-log lines with query secrets (api_key, signature, ...) redacted;
- a shutdown (Ctrl-C, SIGTERM) that lets open requests finish for the graceful timeout and
  then ends the rest with an error (a stream: an error event, then [DONE]) instead of
  cutting their connections (GracefulServer), and returns quietly (run_until_stopped).
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
import sys
import threading
import time
from typing import Callable, Protocol

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

# redact: re-exported (tests and older callers import it from here)
from tllm.log import RedactSecrets, active_settings, redact  # noqa: F401
from tllm.serve.http.limits import HttpLimits

logger = logging.getLogger(__name__)
LINGER_S = 2.0          # a refused connection's lingering close waits this long at most
WARN_EVERY_S = 10.0     # the cap's warning, at most this often (a flood would fill the log)


DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


def uvicorn_config(app, *, host: str = "127.0.0.1", port: int = 8000,
                   log_level: str = "info", **overrides) -> uvicorn.Config:
    """uvicorn.Config for an app built by tllm, with its limits (app.state.http_limits)."""
    limits = limits_of(app)
    options = dict(host=host, port=port, log_level=log_level, lifespan="off",
                   timeout_graceful_shutdown=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   http=functools.partial(LimitedH11Protocol, guard=ConnectionGuard(limits)),
                   h11_max_incomplete_event_size=limits.max_header_bytes,
                   timeout_keep_alive=limits.keep_alive_timeout_s)
    if active_settings("uvicorn") is not None:  # `tllm serve` set up logging: keep its handler
        options["log_config"] = None
    config = uvicorn.Config(app, **{**options, **overrides})
    redact_access_log()     # after Config(), which (re)configures uvicorn's loggers
    return config


def limits_of(app) -> HttpLimits:
    """The limits an app was built with (install_request_limits), else the defaults."""
    return getattr(getattr(app, "state", None), "http_limits", None) or HttpLimits()


def build_server(app, *, host: str, port: int, log_level: str,
                 shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> GracefulServer:
    """A uvicorn server for a command-line `tllm serve ...` (the open-file limit raised to
    fit its connection cap)."""
    raise_open_file_limit(limits_of(app).max_connections)
    return GracefulServer(uvicorn_config(app, host=host, port=port, log_level=log_level,
                                         timeout_graceful_shutdown=shutdown_timeout_s))


def run_uvicorn(app, *, host: str, port: int, log_level: str) -> uvicorn.Server:
    """Serve the app until Ctrl-C or SIGTERM; the server, for its state."""
    server = build_server(app, host=host, port=port, log_level=log_level)
    run_until_stopped(server.run)
    return server


def run_until_stopped(run: Callable[[], object]) -> None:
    """Run a uvicorn server (`run`: its run, or one with gRPC beside it) until a Ctrl-C or a
    SIGTERM has shut it down, then return. uvicorn raises the signal it caught again once
    it has shut down: Ctrl-C then arrives as KeyboardInterrupt, and SIGTERM's default
    action would kill the process before the caller shuts its engine down."""
    is_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if is_main else None
    try:
        run()
    except KeyboardInterrupt:
        pass
    finally:
        if is_main:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


class Drain(Protocol):
    """An app's open requests, as its server's shutdown sees them (`app.state.drain`)."""

    @property
    def num_open(self) -> int: ...

    def stop_admitting(self) -> None: ...

    def end_open(self) -> None: ...


class GracefulServer(uvicorn.Server):
    """uvicorn's server, whose shutdown first drains the app's open requests (an app with
    `app.state.drain`): no new connection is accepted and new requests get 503, those open
    get the graceful timeout to finish, and the rest are ended with an error (a stream: an
    error event, then [DONE]) rather than cancelled when uvicorn's own wait runs out, which
    cut their connections and logged a traceback each. A second Ctrl-C ends them at once."""

    async def shutdown(self, sockets=None) -> None:
        drain = getattr(getattr(self.config.app, "state", None), "drain", None)
        if drain is not None:
            await self._drain(drain)
        await super().shutdown(sockets)

    async def _drain(self, drain: Drain) -> None:
        for server in self.servers:
            server.close()      # stop accepting; uvicorn's shutdown closes them too
        drain.stop_admitting()
        timeout_s = self.config.timeout_graceful_shutdown
        deadline = time.monotonic() + (float("inf") if timeout_s is None else timeout_s)
        if drain.num_open:
            logger.info("shutting down: %d open request(s) get %s s to finish (Ctrl-C again "
                        "ends them now)", drain.num_open, timeout_s)
        while drain.num_open and not self.force_exit and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if drain.num_open:
            logger.warning("shutting down: ending %d open request(s) with an error",
                           drain.num_open)
            drain.end_open()


def raise_open_file_limit(max_connections: int, headroom: int = 256) -> None:
    """Raise the soft open-file limit to fit the connection cap (as vLLM raises it): past
    it accept() fails and the server stops taking connections for a while."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + headroom
    if soft < wanted and (hard == resource.RLIM_INFINITY or soft < hard):
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft < wanted:
        print(f"warning: the open-file limit ({soft}) is below --max-connections "
              f"{max_connections} + {headroom}: raise it (ulimit -n) or lower the cap",
              file=sys.stderr)


class ConnectionGuard:
    """The connection cap of one server, shared by its connections."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self._warned_at = -WARN_EVERY_S

    def make_room(self, connections: set, now: float) -> bool:
        """Whether a new connection may open: under the cap, or once the connection idle
        longest is closed."""
        if len(connections) < self.limits.max_connections:
            return True
        open_ones = [c for c in connections
                     if c.transport is not None and not c.transport.is_closing()]
        if len(open_ones) < self.limits.max_connections:
            return True     # the others are closing already
        idle = [c for c in open_ones if isinstance(c, LimitedH11Protocol) and c.is_idle]
        self._warn(now, len(open_ones), bool(idle))
        if not idle:
            return False
        min(idle, key=lambda c: c.idle_since).close_idle()
        return True

    def _warn(self, now: float, num_open: int, can_evict: bool) -> None:
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            action = ("closing the longest-idle one" if can_evict
                      else "refusing new ones (503): every connection has a request")
            logger.warning("%d connections open (--max-connections): %s", num_open, action)


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the keep-alive timeout applied before a connection's
    first request, a header-read timeout, the connection cap (ConnectionGuard) and
    lingering closes (module docstring)."""

    def __init__(self, *args, guard: ConnectionGuard, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.idle_since = 0.0
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._raw_transport: asyncio.Transport | None = None

    @property
    def is_idle(self) -> bool:
        """No request in progress: silent, or the next request's head still arriving."""
        return self.cycle is None or self.cycle.response_complete

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.idle_since = self.loop.time()
        self._raw_transport = transport
        if not self.guard.make_room(self.connections, self.idle_since):
            self.transport = transport
            transport.write(_SERVICE_UNAVAILABLE)
            self.linger()
            return
        super().connection_made(_LingeringTransport(transport, self))
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return      # answered: dropped until the client hangs up
        super().data_received(data)
        if not self.is_idle or self.transport.is_closing():
            self._cancel_head_timer()
        elif self._head_timer is None:     # the first bytes of a head: it has this long
            self._head_timer = self.loop.call_later(
                self.guard.limits.header_read_timeout_s, self._head_timed_out)

    def on_response_complete(self) -> None:
        self.idle_since = self.loop.time()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse (its message stays in uvicorn's
        log): an OpenAI-shaped 431 for a head past --max-header-bytes, else a 400; then a
        lingering close."""
        head_bytes = len(self.conn.trailing_data[0])
        too_large = head_bytes > self.guard.limits.max_header_bytes
        self.transport.write(_HEAD_TOO_LARGE if too_large else _BAD_REQUEST)
        self.linger()

    @property
    def lingering(self) -> bool:
        return self._linger_timer is not None

    def request_still_arriving(self) -> bool:
        """Whether the client may still be sending: a body not all read (an answer sent
        before it, as a 431 or 413 is), or part of a head."""
        their_state = self.conn.their_state
        return their_state is h11.SEND_BODY or (their_state is h11.IDLE
                                                and bool(self.conn.trailing_data[0]))

    def linger(self) -> None:
        """Close after an answer without a reset: shut our side (the answer, then FIN),
        drop what the client still sends, close when it hangs up or after LINGER_S."""
        transport = self._raw_transport
        if self.lingering or transport.is_closing():
            return
        self._cancel_head_timer()
        if transport.can_write_eof():
            transport.write_eof()
        transport.resume_reading()      # uvicorn's flow control may have paused it
        self._linger_timer = self.loop.call_later(LINGER_S, transport.close)

    def close_idle(self) -> None:
        """Close a connection without a request in progress (to make room)."""
        self._cancel_head_timer()
        self.timeout_keep_alive_handler()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.is_idle or self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            # a head is incomplete: say why we close
            self.transport.write(_REQUEST_TIMEOUT)
        self.timeout_keep_alive_handler()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


class _LingeringTransport:
    """A connection's transport as uvicorn's protocol sees it: a close() while the client
    may still be sending (an answer sent before its body was read) becomes the protocol's
    lingering close; everything else is the transport's."""

    def __init__(self, transport: asyncio.Transport, protocol: LimitedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def close(self) -> None:
        if self._protocol.request_still_arriving():
            self._protocol.linger()
        else:
            self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing() or self._protocol.lingering


def _raw_error(status: str, message: str, code: str, type_: str) -> bytes:
    """A whole HTTP response with an OpenAI-shaped error, for a connection without a request
    that h11 could answer."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": code}}).encode()
    headers = ["content-type: application/json", "connection: close",
               f"content-length: {len(body)}"]
    if status.startswith("503"):
        headers.append("retry-after: 1")
    head = "".join(f"{line}\r\n" for line in [f"HTTP/1.1 {status}", *headers, ""])
    return head.encode() + body


_REQUEST_TIMEOUT = _raw_error("408 Request Timeout", "the request line and headers did not "
                              "arrive within --header-read-timeout", "request_timeout",
                              "invalid_request_error")
_BAD_REQUEST = _raw_error("400 Bad Request", "the request is not valid HTTP/1.1",
                          "invalid_http", "invalid_request_error")
_HEAD_TOO_LARGE = _raw_error("431 Request Header Fields Too Large", "the request line and "
                             "headers are larger than --max-header-bytes", "headers_too_large",
                             "invalid_request_error")
_SERVICE_UNAVAILABLE = _raw_error("503 Service Unavailable", "too many open connections "
                                  "(--max-connections), each with a request in progress",
                                  "too_many_connections", "service_unavailable")


def redact_access_log() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactSecrets) for f in access.filters):
        access.addFilter(RedactSecrets())
