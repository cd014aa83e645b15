"""`tllm bench serve` against our server over an engine double: figures, JSON, PNG, request
rate and concurrency; and the statistics on their own."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from tllm.bench.serve import (BenchConfig, BenchRun, RequestResult, arrival_offsets,
                              random_requests)
from tllm.bench.serve_cli import add_bench_serve_parser
from tllm.bench.serve_metrics import percentile, summarize


def bench(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tllm bench")
    add_bench_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *argv])
    return args.run(args)


@pytest.mark.parametrize("rate", ["inf", "200"])
def test_bench_serve_writes_figures_json_and_png(server, tmp_path, capsys, rate):
    result, plot = tmp_path / "result.json", tmp_path / "plot.png"
    code = bench("--base-url", server.base_url, "--num-prompts", "12", "--isl", "16",
                 "--osl", "8", "--random-vocab-size", "256", "--request-rate", rate,
                 "--goodput", "ttft:10000", "tpot:10000", "--result-file", str(result),
                 "--plot-file", str(plot))
    assert code == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "P99 TTFT (ms)" in printed
    summary = json.loads(result.read_text())["summary"]
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["total_input_tokens"] == 12 * 16
    assert summary["total_output_tokens"] == 12 * 8
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    for key in ("p50_ttft_ms", "p90_tpot_ms", "p99_itl_ms", "mean_e2el_ms"):
        assert summary[key] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_max_concurrency_is_respected(server, fake, tmp_path):
    code = bench("--base-url", server.base_url, "--num-prompts", "12", "--isl", "4",
                 "--osl", "6", "--random-vocab-size", "256", "--max-concurrency", "3",
                 "--result-file", "", "--plot-file", "")
    assert code == 0
    assert fake.max_active <= 3


def test_several_client_processes_share_the_load(server, fake, tmp_path, capsys,
                                                 monkeypatch):
    """The same requests as one process would send, dealt over three processes that start
    together; one merged result (the per-request list in the original order), and one
    progress bar over all of them."""
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    result = tmp_path / "result.json"
    code = bench("--base-url", server.base_url, "--num-prompts", "10", "--isl", "8",
                 "--osl", "5", "--random-vocab-size", "256", "--num-clients", "3",
                 "--max-concurrency", "6", "--result-file", str(result), "--plot-file", "")
    assert code == 0
    assert "Requests: 100%" in capsys.readouterr().err
    record = json.loads(result.read_text())
    assert record["summary"]["completed"] == 10 and record["summary"]["failed"] == 0
    assert record["summary"]["total_output_tokens"] == 10 * 5
    assert [r["prompt_tokens"] for r in record["requests"]] == [8] * 10
    assert fake.max_active <= 6     # each of 3 processes keeps at most 2 in flight


@pytest.mark.parametrize("num_clients", ["1", "2"])
def test_a_failing_server_is_reported(server, capsys, num_clients):
    # Token ids beyond the engine double's vocabulary: the test request gets a 400.
    code = bench("--base-url", server.base_url, "--num-prompts", "2", "--isl", "4",
                 "--osl", "2", "--random-vocab-size", "100000", "--result-file", "",
                 "--plot-file", "", "--num-clients", num_clients)
    assert code == 1
    assert "HTTP 400" in capsys.readouterr().err


def test_random_requests_have_the_asked_lengths():
    config = BenchConfig(base_url="", num_prompts=50, input_len=100, output_len=20)
    requests = random_requests(config)
    assert {len(r.prompt) for r in requests} == {100}
    assert {r.max_tokens for r in requests} == {20}
    assert requests == random_requests(config)  # seeded
    varied = random_requests(BenchConfig(base_url="", num_prompts=200, input_len=100,
                                         output_len=20, range_ratio=0.5))
    lengths = [len(r.prompt) for r in varied]
    assert 50 <= min(lengths) < 70 and 130 < max(lengths) <= 150


def test_poisson_arrivals():
    assert arrival_offsets(5, float("inf"), 0) == [0.0] * 5
    offsets = arrival_offsets(20000, 50.0, 0)
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 50, rel=0.05)  # exponential: std == mean


def test_percentile_matches_numpy():
    values = list(np.random.default_rng(0).exponential(size=101))
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_summary_and_goodput():
    def result(ttft, e2e, tokens):
        return RequestResult(0.0, 10, is_ok=True, ttft=ttft, e2e=e2e, num_output_tokens=tokens,
                             chunk_times=[ttft + 0.01 * i for i in range(tokens)])
    results = [result(0.1, 1.1, 11), result(0.5, 2.5, 11), RequestResult(0.0, 10, error="x")]
    run = BenchRun(BenchConfig(base_url=""), "m", results, duration_s=2.0)
    summary = summarize(run, [50], {"ttft": 200, "tpot": 150})
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["request_throughput"] == 1.0 and summary["output_throughput"] == 11.0
    assert summary["goodput"] == 0.5  # only the first meets TTFT <= 200 ms
    assert summary["median_ttft_ms"] == pytest.approx(300)
    assert summary["mean_tpot_ms"] == pytest.approx(150)  # (1.0 / 10 + 2.0 / 10) / 2
