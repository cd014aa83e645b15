"""Issue 31, item 4: connections time out and are capped, on every kind of server. A head
trickled a byte at a time is cut at the header-read timeout (408); a silent connection is
closed after the keep-alive timeout, before its first request too; a stalled body gets 408
on every server (the visual ones had no body-read timeout); a flood of idle sockets past
--max-connections closes the longest-idle ones, so a client is still answered; when every
connection has a request in progress, a new one gets a 503."""
from __future__ import annotations

import select
import socket
import time

import httpx
import pytest

from tests.serve.every_server import BODY_ROUTE, KINDS, serve
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import FakeLLM, ServerThread

HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"


def _read_until_closed(sock: socket.socket, wait_s: float) -> bytes:
    """What the server sends until it closes the connection (fails past wait_s)."""
    sock.settimeout(wait_s)
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        except TimeoutError:
            raise AssertionError(f"still open after {wait_s} s: {received!r}") from None
        if not chunk:
            return received
        received += chunk


@pytest.mark.parametrize("kind", KINDS)
def test_a_trickled_head_is_cut_at_the_header_read_timeout(kind):
    with serve(kind, header_read_timeout_s=0.5) as server:
        sock = socket.create_connection(("127.0.0.1", server.port))
        start, received = time.monotonic(), b""
        for byte in HEAD:      # a byte every 0.1 s: each used to restart uvicorn's timer
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            if select.select([sock], [], [], 0.1)[0]:
                received = _read_until_closed(sock, wait_s=2)
                break
        seconds = time.monotonic() - start
        sock.close()
        assert received.startswith(b"HTTP/1.1 408") and b"request_timeout" in received
        assert 0.4 < seconds < 1.5, seconds
        with httpx.Client(base_url=server.base_url, timeout=10) as client:  # serves on
            assert client.get("/openapi.json").status_code == 200


@pytest.mark.parametrize("kind", ["text", "router"])
def test_a_silent_connection_is_closed_after_the_keep_alive_timeout(kind):
    with serve(kind, keep_alive_timeout_s=0.3) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            start = time.monotonic()
            assert _read_until_closed(sock, wait_s=3) == b""
            assert 0.25 < time.monotonic() - start < 1.5


@pytest.mark.parametrize("kind", KINDS)
def test_a_stalled_body_gets_408_on_every_server(kind):
    with serve(kind, body_read_timeout_s=0.3) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(f"POST {BODY_ROUTE[kind]} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         f"application/json\r\nContent-Length: 100\r\n\r\n{{".encode())
            received = _read_until_closed(sock, wait_s=3)
        assert received.startswith(b"HTTP/1.1 408"), received


def test_a_flood_of_idle_connections_does_not_lock_clients_out():
    with serve("text", max_connections=50) as server:
        flood = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(200)]
        try:
            with httpx.Client(base_url=server.base_url, timeout=10) as client:
                assert client.get("/health").status_code == 200
                assert client.post("/v1/completions", json={"prompt": "hi",
                                                            "max_tokens": 2}).status_code == 200
            num_closed = _count_closed(flood, at_least=150, wait_s=5)
        finally:
            for sock in flood:
                sock.close()
    assert num_closed >= 150


def _count_closed(sockets: list[socket.socket], at_least: int, wait_s: float) -> int:
    closed: set[socket.socket] = set()
    deadline = time.monotonic() + wait_s
    while len(closed) < at_least and time.monotonic() < deadline:
        for sock in select.select([s for s in sockets if s not in closed], [], [], 0.1)[0]:
            try:
                sock.recv(1)
            except ConnectionResetError:
                pass
            closed.add(sock)     # readable without a request: EOF (or a reset)
    return len(closed)


def test_past_the_cap_with_every_connection_busy_a_new_one_gets_503():
    llm = FakeLLM(token_delay_s=0.05)
    stream = {"prompt": "hi", "max_tokens": 400, "stream": True}
    with ServerThread(build_app(llm, ServerConfig(model="fake", max_connections=2))) as server:
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            with client.stream("POST", "/v1/completions", json=stream), \
                    client.stream("POST", "/v1/completions", json=stream):
                with socket.create_connection(("127.0.0.1", server.port)) as sock:
                    received = _read_until_closed(sock, wait_s=3)
                assert received.startswith(b"HTTP/1.1 503"), received
                assert b"too_many_connections" in received and b"retry-after: 1" in received
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            assert client.get("/health").status_code == 200     # the streams have gone
