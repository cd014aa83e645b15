"""Issue 14, finding 11: engine supervision. When the engine process dies (SIGKILL), /health
says so at once, in-flight requests end with 503 (a stream with an error event), and the
server restarts the engine, whose greedy answers are the same as before; with
--exit-on-engine-failure the server exits with status 1 instead. The restart policy (bounded
attempts in a row, backoff, giving up) on an engine double."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from tests.serve.helpers import assert_openai_error, wait_until_idle
from tests.serve.test_serve_cli_args import SERVE, _wait_healthy, free_port
from tllm import KvCacheConfig
from tllm.llmapi.process_llm import ProcessLLM
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.http.supervisor import EngineSupervisor, RestartPolicy
from tllm.serve.testing import ServerThread

DUMMY = "dummy:smollm2-135m"    # random weights in SmolLM2's shape: no model file to parse
DUMMY_KWARGS = dict(max_seq_len=128, max_batch_size=8,
                    kv_cache_config=KvCacheConfig(max_tokens=2048))
GREEDY = {"model": "m", "prompt": [1, 17, 400, 9000], "max_tokens": 8, "temperature": 0,
          "ignore_eos": True}
LONG = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 120, "ignore_eos": True}


def wait_for(condition, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.01)
    return time.monotonic() - start


@pytest.mark.slow
def test_a_killed_engine_fails_in_flight_requests_and_is_restarted(caplog):
    caplog.set_level(logging.WARNING, logger="tllm.serve.http.supervisor")
    with ProcessLLM(DUMMY, **DUMMY_KWARGS) as llm, \
            ServerThread(build_app(llm, ServerConfig(model="m"))) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as http:
        before = http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
        old_pid = llm.pid
        unstreamed: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: unstreamed.append(
            http.post("/v1/completions", json=LONG)))
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # it runs
            waiter.start()
            wait_for(lambda: llm.get_stats()["num_running"] == 2, 10, "both requests run")
            os.kill(old_pid, signal.SIGKILL)
            seconds = wait_for(lambda: http.get("/health").status_code == 503, 1.0,
                               "/health says so")
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data:")]
        print(f"/health answered 503 {seconds:.3f} s after the kill")
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_unavailable"
        waiter.join(timeout=10)
        assert_openai_error(unstreamed[0], 503)
        health = assert_openai_error(http.get("/health"), 503)
        assert "exited with code -9" in health["message"]
        assert_openai_error(http.post("/v1/completions", json=GREEDY), 503)

        seconds = wait_for(lambda: http.get("/health").status_code == 200, 60, "restarted")
        print(f"engine healthy again {seconds:.1f} s later")
        assert llm.pid != old_pid and app_supervisor(server).num_restarts == 1
        after = http.post("/v1/completions", json=GREEDY)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == before
        wait_until_idle(llm)
    logged = [r.getMessage() for r in caplog.records]
    assert any("restarting it (attempt 1 of 3)" in m for m in logged), logged
    assert any("engine restarted in" in m for m in logged), logged


def app_supervisor(server: ServerThread) -> EngineSupervisor:
    return server.app.state.ctx.supervisor


@pytest.mark.slow
def test_exit_on_engine_failure_exits_non_zero():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVE, "serve", DUMMY, "--port", str(port),
                             "--max-seq-len", "64", "--kv-cache-tokens", "1024",
                             "--exit-on-engine-failure", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            _wait_healthy(client, proc)
            [engine] = [child for child in psutil.Process(proc.pid).children()
                        if "spawn_main" in " ".join(child.cmdline())]
            engine.send_signal(signal.SIGKILL)
            output = proc.communicate(timeout=30)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, output
    assert "exiting (--exit-on-engine-failure)" in output, output


class DyingLLM:
    """An engine double that is dead until `restart()` has been called `fail_starts` + 1
    times (the first fail_starts raise)."""

    def __init__(self, fail_starts: int = 0, can_restart: bool = True) -> None:
        self.is_alive = False
        self.exitcode = -9
        self.fail_starts = fail_starts
        self.num_starts = 0
        if not can_restart:
            self.restart = None

    def restart(self) -> None:
        self.num_starts += 1
        if self.num_starts <= self.fail_starts:
            raise RuntimeError("no memory")
        self.is_alive = True


def supervise(llm, **policy) -> tuple[EngineSupervisor, list[str]]:
    fatal: list[str] = []
    supervisor = EngineSupervisor(llm, RestartPolicy(backoff_s=0.01, **policy), poll_s=0.01)
    supervisor.on_fatal = fatal.append
    supervisor.start()
    return supervisor, fatal


def test_restarts_until_one_start_succeeds(caplog):
    llm = DyingLLM(fail_starts=2)
    supervisor, fatal = supervise(llm, max_restarts=3)
    wait_for(lambda: llm.is_alive, 5, "restarted")
    supervisor.close()
    assert llm.num_starts == 3 and not fatal and supervisor.num_restarts == 1
    assert supervisor.status() is None
    assert sum("failed: RuntimeError: no memory" in r.getMessage() for r in caplog.records) == 2


def test_gives_up_after_max_restarts_in_a_row():
    llm = DyingLLM(fail_starts=10)
    supervisor, fatal = supervise(llm, max_restarts=3)
    wait_for(lambda: fatal, 5, "gave up")
    supervisor.close()
    assert llm.num_starts == 3 and "3 restarts in a row failed" in fatal[0]
    assert supervisor.status() == fatal[0] == supervisor.fatal_reason


def test_a_crash_loop_is_bounded_too():
    """An engine that starts and dies again before it has run stable_s counts each restart
    against the same bound."""
    llm = DyingLLM()
    supervisor, fatal = supervise(llm, max_restarts=2, stable_s=60)
    for _ in range(2):
        wait_for(lambda: llm.is_alive, 5, "restarted")
        llm.is_alive = False
    wait_for(lambda: fatal, 5, "gave up")
    supervisor.close()
    assert llm.num_starts == 2


@pytest.mark.parametrize("policy,can_restart,reason", [
    ({"exit_on_failure": True}, True, "--exit-on-engine-failure"),
    ({}, False, "cannot be restarted")])
def test_exits_instead_of_restarting(policy, can_restart, reason):
    llm = DyingLLM(can_restart=can_restart)
    supervisor, fatal = supervise(llm, **policy)
    wait_for(lambda: fatal, 5, "gave up")
    supervisor.close()
    assert llm.num_starts == 0 and reason in fatal[0]
    assert "exited with code -9" in fatal[0]


def test_backoff_doubles_up_to_its_cap():
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=5.0)
    assert [policy.delay_s(k) for k in range(1, 7)] == [0, 1, 2, 4, 5, 5]


def test_supervision_flags():
    from tests.serve.test_serve_cli_args import parse
    from tllm.serve.cli_args import server_config
    config = server_config(parse(), "m")
    assert not config.exit_on_engine_failure and config.max_engine_restarts == 3
    config = server_config(parse("--exit-on-engine-failure", "--max-engine-restarts", "5"), "m")
    assert config.exit_on_engine_failure and config.max_engine_restarts == 5
