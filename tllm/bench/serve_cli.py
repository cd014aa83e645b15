"""`tllm bench serve`: its command line; runs the load, prints the figures, writes the JSON
result and the PNG plot."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys

from tllm.bench.serve import BenchConfig, BenchRun, run_benchmark
from tllm.bench.serve_breakdown import format_stages, scrape_stages, stage_percentiles
from tllm.bench.serve_clients import run_in_processes
from tllm.bench.serve_metrics import SLO_METRICS, format_summary, summarize
from tllm.cli_types import positive_int
from tllm.extras import MissingExtraError, require_extra


def add_bench_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add `serve` to the subparsers of `tllm bench`."""
    parser = subparsers.add_parser(
        "serve", help="load an OpenAI-compatible server and measure latency and throughput",
        description="Send random prompts to a running server's /v1/completions (streaming) "
                    "and report TTFT, TPOT, ITL and end-to-end latency percentiles, "
                    "throughput and goodput.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--dataset", choices=["random"], default="random")
    parser.add_argument("--isl", "--random-input-len", dest="isl", type=positive_int,
                        default=1024, help="prompt tokens per request (default 1024)")
    parser.add_argument("--osl", "--random-output-len", dest="osl", type=positive_int,
                        default=128, help="output tokens per request (default 128)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths vary uniformly by this fraction (default 0: exact)")
    parser.add_argument("--random-vocab-size", type=positive_int, default=10000,
                        help="prompt token ids are drawn from [0, this) (default 10000)")
    parser.add_argument("--num-prompts", type=positive_int, default=100)
    parser.add_argument("--request-rate", type=_rate, default=float("inf"),
                        help="requests per second, Poisson arrivals; inf (default) sends "
                             "all at once")
    parser.add_argument("--max-concurrency", type=positive_int,
                        help="most requests in flight (default: no limit)")
    parser.add_argument("--num-clients", type=positive_int, default=1,
                        help="load-generator processes sharing the requests (default 1); "
                             "one parses about 10k streamed tokens/s, so raise this for "
                             "fast servers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--percentiles", default="50,90,99",
                        help="comma-separated percentiles to report (default 50,90,99)")
    parser.add_argument("--goodput", nargs="+", metavar="NAME:MS", default=[],
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    parser.add_argument("--result-file", default="bench_serve.json",
                        help="JSON of every figure and request ('' to skip)")
    parser.add_argument("--plot-file", default="bench_serve.png",
                        help="PNG of latency CDFs and throughput over time ('' to skip)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.set_defaults(run=run_bench_serve)
    return parser


def run_bench_serve(args: argparse.Namespace) -> int:
    import httpx
    percentiles = _percentiles(args.percentiles)
    slos = _slos(args.goodput)
    config = BenchConfig(
        base_url=args.base_url, model=args.model, api_key=args.api_key,
        num_prompts=args.num_prompts, input_len=args.isl, output_len=args.osl,
        range_ratio=args.random_range_ratio, vocab_size=args.random_vocab_size,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
        timeout_s=args.timeout)
    stages_before = scrape_stages(args.base_url, args.api_key)
    try:
        if args.num_clients > 1:
            run = run_in_processes(config, args.num_clients)
        else:
            run = asyncio.run(run_benchmark(config))
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    summary = summarize(run, percentiles, slos)
    print(format_summary(summary, percentiles))
    stages = stage_percentiles(stages_before, scrape_stages(args.base_url, args.api_key),
                               percentiles)
    if stages is not None:
        summary["server_ttft_stages"] = stages
        print(format_stages(stages, percentiles))
    if args.result_file:
        write_result(run, summary, args.result_file)
    if args.plot_file:
        _plot(run, args.plot_file)
    return 0 if summary["completed"] == summary["num_prompts"] else 1


def write_result(run: BenchRun, summary: dict, path: str) -> None:
    requests = [{"start_s": r.start, "ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e,
                 "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
                 "itl_s": r.itls, "error": r.error} for r in run.results]
    with open(path, "w") as f:
        json.dump(_no_nan({"summary": summary, "requests": requests}), f, indent=1)
    print(f"wrote {path}", file=sys.stderr)


def _plot(run: BenchRun, path: str) -> None:
    try:
        require_extra("bench", "--plot-file")
    except MissingExtraError as exc:
        print(f"no plot: {exc}", file=sys.stderr)
        return
    from tllm.bench.serve_plot import plot_run
    plot_run(run, path)
    print(f"wrote {path}", file=sys.stderr)


def _no_nan(value):
    """JSON has no NaN or infinity: null instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--percentiles: expected numbers in [0, 100] like 50,90,99, "
                         f"got {text!r}")
    return values


def _slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            name = ""
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput: expected NAME:MS with NAME in "
                             f"{', '.join(SLO_METRICS)}, got {item!r}")
    return slos


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = -1.0
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"expected a positive rate or inf, got {text!r}")
    return rate


