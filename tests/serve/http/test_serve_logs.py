"""The server's logs: X-Request-Id given or made, returned on every response and on the log
lines of its request; the periodic stats line (ticked by hand, no sleeping); the engine's
start-up summary; `tllm serve`'s logging flags."""
from __future__ import annotations

import io
import json
import logging
import types

import httpx
import pytest

from tllm.cli import build_parser
from tllm.llmapi.engine import engine_summary
from tllm.log import TllmHandler, configure_logging, unconfigure_logging
from tllm.serve.context import ServerConfig
from tllm.serve.http.server import uvicorn_config
from tllm.serve.http.metrics import ServerMetrics
from tllm.serve.http.app import build_app
from tllm.serve.http.request_ids import accepted_request_id
from tllm.serve.http.stats_log import GENERATION_TOKENS, PROMPT_TOKENS, StatsLogger, server_stats
from tllm.serve.testing import FakeLLM, ServerThread

COMPLETION = {"model": "fake", "prompt": "hi", "max_tokens": 3}


@pytest.fixture()
def log():
    stream = io.StringIO()
    configure_logging("debug", "json", stream)
    yield stream
    unconfigure_logging()


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@pytest.fixture()
def fake():
    return FakeLLM()


@pytest.fixture()
def http(log, fake):
    app = build_app(fake, ServerConfig(model="fake", api_key="sesame"))
    with ServerThread(app, log_level="info") as server:     # info: the access log too
        with httpx.Client(base_url=server.base_url, timeout=10,
                          headers={"Authorization": "Bearer sesame"}) as client:
            yield client


def test_a_given_request_id_is_returned_and_logged(http, log):
    response = http.post("/v1/completions", json=COMPLETION,
                         headers={"X-Request-Id": "client-42"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "client-42"
    mine = [line for line in _lines(log) if line.get("request_id") == "client-42"]
    messages = " | ".join(line["message"] for line in mine)
    assert "submitted as engine request(s) 0" in messages     # HTTP id -> engine id
    assert "POST /v1/completions" in messages                 # the access log
    assert all(set(line) >= {"time", "level", "logger", "message"} for line in mine)


@pytest.mark.parametrize("given", [None, "x" * 129, "has space", "tab\tin", "é"])
def test_a_request_id_is_made_when_missing_or_unfit(http, given):
    headers = {} if given is None else {"X-Request-Id": given.encode("utf-8")}
    response = http.get("/v1/models", headers=headers)
    made = response.headers["x-request-id"]
    assert made != given and made.startswith("req-") and len(made) <= 128


def test_errors_carry_the_request_id(http, fake, log):
    assert http.get("/nowhere").headers["x-request-id"].startswith("req-")
    refused = http.get("/v1/models", headers={"Authorization": "Bearer wrong",
                                              "X-Request-Id": "r-401"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "r-401"
    fake.fail_with = RuntimeError("boom")
    failed = http.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "r-500"})
    assert failed.status_code == 500 and failed.headers["x-request-id"] == "r-500"
    assert "r-500" in failed.json()["error"]["message"]     # the id to look up in the log
    [error] = [line for line in _lines(log) if line["level"] == "ERROR"]
    assert error["request_id"] == "r-500" and "RuntimeError: boom" in error["exc_info"]


def test_accepted_request_ids():
    assert accepted_request_id(b"abc-DEF_1.2:3") == "abc-DEF_1.2:3"
    assert accepted_request_id(b"x" * 128) == "x" * 128
    for unfit in (None, b"", b"x" * 129, b"a b", b"a\nb", b"\x7f", "é".encode()):
        assert accepted_request_id(unfit) is None


def _stats(running=0, waiting=0, free=100, prompt=0, generated=0, preempted=0) -> dict:
    return {"num_running": running, "num_waiting": waiting, "kv_blocks_total": 100,
            "kv_blocks_free": free, "num_preemptions": preempted,
            PROMPT_TOKENS: prompt, GENERATION_TOKENS: generated}


def test_stats_line_while_busy_then_quiet(log):
    now = [0.0]
    stats_log = StatsLogger(clock=lambda: now[0])
    assert stats_log.tick(_stats()) is None           # the first reading starts the interval
    now[0] = 10.0
    assert stats_log.tick(_stats()) is None           # idle: nothing
    now[0] = 20.0
    line = stats_log.tick(_stats(running=3, waiting=1, free=75, prompt=1000, generated=500,
                                 preempted=2))
    assert line == ("running 3, waiting 1, KV cache 25.0% used, prompt 100.0 tok/s, "
                    "generation 50.0 tok/s, 2 preempted")
    now[0] = 30.0
    assert "generation 10.0 tok/s" in stats_log.tick(_stats(prompt=1000, generated=600,
                                                            preempted=2))   # went idle
    now[0] = 40.0
    assert stats_log.tick(_stats(prompt=1000, generated=600, preempted=2)) is None
    busy, idle = [line for line in _lines(log) if line["logger"] == "tllm.serve.http.stats_log"]
    assert busy["num_running"] == 3 and busy["kv_usage_pct"] == 25.0
    assert busy["prompt_tokens_per_s"] == 100.0 and idle["generation_tokens_per_s"] == 10.0


def test_server_stats_reads_the_engine_and_the_token_counters(fake):
    metrics = ServerMetrics("fake", fake.get_stats)
    metrics.track([7, 5], 1).on_tokens(0, 3)
    stats = server_stats(fake, metrics)()
    assert stats[PROMPT_TOKENS] == 12 and stats[GENERATION_TOKENS] == 3
    assert stats["kv_blocks_total"] == 1000


def test_stats_logger_without_an_interval_starts_no_thread():
    stats_log = StatsLogger(lambda: _stats(), interval_s=0).start()
    assert stats_log._thread is None
    stats_log.close()


def test_start_up_summary_names_kv_capacity():
    args = types.SimpleNamespace(model="smollm2", world_size=1, max_batch_size=64,
                                 max_num_tokens=8192)
    kv = types.SimpleNamespace(capacity_tokens=131072, num_blocks=4096, tokens_per_block=32,
                               dtype="torch.bfloat16")
    graphs = types.SimpleNamespace(graphs={1: None, 2: None, 4: None})
    parts = types.SimpleNamespace(dtype="torch.bfloat16", device="cuda:0", kv_cache=kv,
                                  max_seq_len=4096, graphs=graphs, piecewise=None)
    line, fields = engine_summary(args, parts)
    assert "KV cache 131072 tokens (4096 blocks of 32, bfloat16)" in line
    assert "max batch size 64, max_num_tokens 8192" in line
    assert "bfloat16 on cuda:0" in line and "decode batch sizes [1, 2, 4]" in line
    assert fields["kv_capacity_tokens"] == 131072
    parts.graphs = None
    assert engine_summary(args, parts)[1]["cuda_graphs"] == "none"


def test_serve_flags():
    args = build_parser().parse_args(["serve", "--log-format", "json", "--log-level", "debug",
                                      "--log-stats-interval", "0"])
    assert (args.log_format, args.log_level, args.log_stats_interval) == ("json", "debug", 0)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.log_format, defaults.log_stats_interval) == ("text", 10.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-stats-interval", "-1"])


def test_uvicorn_keeps_our_handler(log):
    config = uvicorn_config(build_app(FakeLLM(), ServerConfig(model="fake")))
    assert config.log_config is None
    ours = [h for h in logging.getLogger("uvicorn").handlers if isinstance(h, TllmHandler)]
    assert [h.settings.format for h in ours] == ["json"]     # (pytest adds its own too)
