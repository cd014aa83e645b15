"""Graceful shutdown (issue 38): on Ctrl-C or SIGTERM the server stops taking requests (503,
/health says so), lets open ones finish for the shutdown timeout, then ends the rest with
an error (a stream: an error event in OpenAI's shape, then [DONE]) rather than cutting
their connections; the process logs no traceback and no native "leaked" warnings, and
exits 0 after shutting its engine down."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.serve.helpers import assert_openai_error
from tests.serve.test_serve_cli_args import _wait_healthy, free_port
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import FakeLLM, ServerThread

LONG = {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True, "stream": True}


def read_stream(client: httpx.Client, body: dict, started: threading.Event,
                events: list[str]) -> None:
    """The stream's `data:` payloads into events; `started` set at the first one."""
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                started.set()


def stream_in_thread(base_url: str, body: dict) -> tuple[threading.Thread, list[str]]:
    """Start the stream; return once its first event has come."""
    events: list[str] = []
    started = threading.Event()
    client = httpx.Client(base_url=base_url, timeout=30)
    thread = threading.Thread(target=lambda: (read_stream(client, body, started, events),
                                              client.close()), daemon=True)
    thread.start()
    assert started.wait(20), "the stream did not start"
    return thread, events


def assert_ended_with_error(events: list[str]) -> None:
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable"


def test_open_requests_finish_or_end_with_an_error_event():
    llm = FakeLLM(token_delay_s=0.05)
    with ServerThread(build_app(llm, ServerConfig(model="fake"))) as server, \
            httpx.Client(base_url=server.base_url, timeout=10) as idle:
        assert idle.get("/health").status_code == 200     # a connection kept open
        long, long_events = stream_in_thread(server.base_url, {**LONG, "max_tokens": 400})
        short, short_events = stream_in_thread(server.base_url, {**LONG, "max_tokens": 8})
        server.server.should_exit = True
        deadline = time.monotonic() + 5
        while (health := idle.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "/health did not say it"
        assert "shutting down" in assert_openai_error(health, 503)["message"]
        refused = idle.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert assert_openai_error(refused, 503)["code"] == "server_shutting_down"
        short.join(10)
        long.join(10)
    assert short_events[-1] == "[DONE]"
    assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
    assert_ended_with_error(long_events)
    assert llm.num_steps < 200 and not llm.active    # the long one was aborted


@pytest.mark.slow
@pytest.mark.parametrize("sig,flags", [(signal.SIGINT, ()),
                                       (signal.SIGTERM, ("--no-engine-process",))])
def test_a_stopped_server_sends_done_and_exits_quietly(sig, flags):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tllm.cli", "serve", "dummy:smollm2-135m", "--port", str(port),
         "--max-seq-len", "256", "--kv-cache-tokens", "1024", "--shutdown-timeout", "0.2",
         *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            _wait_healthy(client, proc)
        stream, events = stream_in_thread(f"http://127.0.0.1:{port}", LONG)
        proc.send_signal(sig)
        stream.join(30)
        output = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert_ended_with_error(events)
    assert proc.returncode == 0, output
    assert "Traceback" not in output and "leaked" not in output, output
    assert "ending 1 open request(s) with an error" in output, output
