"""`tllm bench serve`: its command line; builds the requests, runs the load (a progress bar
over the requests that ended), prints the figures, writes the JSON result and the PNG plot
where asked (tllm.bench.serve_results)."""
from __future__ import annotations

import argparse
import asyncio
import sys

from tllm.bench.serve import ENDPOINTS, BenchConfig, BenchRun, dataset_requests, run_benchmark
from tllm.bench.serve_breakdown import format_stages, scrape_stages, stage_percentiles
from tllm.bench.serve_clients import run_in_processes
from tllm.bench.serve_datasets import DATASET_ALIASES, DATASETS, load_tokenizer
from tllm.bench.serve_metrics import SLO_METRICS, format_summary, summarize
from tllm.bench.serve_results import output_paths, write_plot, write_result
from tllm.cli_types import positive_int
from tllm.progress import progress_bar

# vLLM's --backend names, and the endpoint each one means
BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}


def add_bench_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add `serve` to the subparsers of `tllm bench`."""
    parser = subparsers.add_parser(
        "serve", help="load an OpenAI-compatible server and measure latency and throughput",
        description="Send prompts (random token ids, a ShareGPT JSON or a JSONL file) to a "
                    "running server's /v1/completions or /v1/chat/completions (streaming) "
                    "and report TTFT, TPOT, ITL and end-to-end latency percentiles, "
                    "throughput and goodput.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--endpoint", type=_endpoint, metavar="{completions,chat}",
                        help="completions (default) or chat; vLLM's paths "
                             "/v1/completions, /v1/chat/completions work too")
    parser.add_argument("--backend", choices=sorted(BACKENDS),
                        help="vLLM's spelling: openai-chat means --endpoint chat")
    _add_dataset_args(parser)
    _add_load_args(parser)
    _add_output_args(parser)
    parser.set_defaults(run=run_bench_serve)
    return parser


def _add_dataset_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prompts")
    group.add_argument("--dataset-name", "--dataset", type=_dataset, default="random",
                       metavar="{random,sharegpt,jsonl}",
                       help="random token ids (default); sharegpt: the first human turn of "
                            "each conversation in a ShareGPT JSON file, asking for as many "
                            "tokens as its first answer; jsonl (or custom): one "
                            '{"prompt": ..., "output_len": N} object a line')
    group.add_argument("--dataset-path", metavar="FILE", help="the sharegpt or jsonl file")
    group.add_argument("--num-prompts", type=positive_int,
                       help="requests to send (default: 100; jsonl: every line)")
    group.add_argument("--tokenizer", help="counts ShareGPT's tokens (and turns random ids "
                       "into chat text): 'smollm2', a .gguf, a folder or a hub id (default: "
                       "--model, else the server's model)")
    group.add_argument("--output-len", "--sharegpt-output-len", "--custom-output-len",
                       dest="output_len", type=positive_int,
                       help="output tokens of every sharegpt / jsonl request (default: the "
                            "answer's length / the line's output_len, else 128)")
    group.add_argument("--isl", "--random-input-len", dest="isl", type=positive_int,
                       default=1024, help="random: prompt tokens per request (default 1024)")
    group.add_argument("--osl", "--random-output-len", dest="osl", type=positive_int,
                       default=128, help="random: output tokens per request (default 128)")
    group.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="random: lengths vary uniformly by this fraction (default 0)")
    group.add_argument("--random-vocab-size", type=positive_int, default=10000,
                       help="random: token ids are drawn from [0, this) (default 10000)")
    group.add_argument("--seed", type=int, default=0,
                       help="random prompts, ShareGPT's order, arrival times")


def _add_load_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("load")
    group.add_argument("--request-rate", type=_rate, default=float("inf"),
                       help="requests per second, Poisson arrivals; inf (default) sends "
                            "all at once")
    group.add_argument("--max-concurrency", type=positive_int,
                       help="most requests in flight (default: no limit)")
    group.add_argument("--num-clients", type=positive_int, default=1,
                       help="load-generator processes sharing the requests (default 1); "
                            "one parses about 10k streamed tokens/s, so raise this for "
                            "fast servers")
    group.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output (nothing is written unless asked)")
    group.add_argument("--percentiles", "--metric-percentiles", dest="percentiles",
                       default="50,90,99",
                       help="comma-separated percentiles to report (default 50,90,99)")
    group.add_argument("--goodput", nargs="+", metavar="NAME:MS", default=[],
                       help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    group.add_argument("--save-result", action="store_true",
                       help="write the JSON of every figure and request into --result-dir, "
                            "named tllm-serve-DATASET-RATEqps-MODEL-DATE.json")
    group.add_argument("--result-dir", metavar="DIR",
                       help="where --save-result writes (default: the current directory); "
                            "implies --save-result")
    group.add_argument("--result-filename", metavar="NAME",
                       help="the JSON's name in --result-dir; implies --save-result")
    group.add_argument("--result-file", metavar="PATH",
                       help="the JSON's whole path (wins over the three above; '' writes none)")
    group.add_argument("--plot", action="store_true",
                       help="also a PNG (latency CDFs, throughput over time) beside the JSON, "
                            "same name; implies --save-result; needs matplotlib")
    group.add_argument("--plot-file", metavar="PATH", help="the PNG's whole path")
    group.add_argument("--disable-tqdm", "--disable-progress", action="store_true",
                       help="no progress bar on stderr (also: TQDM_DISABLE=1)")


def run_bench_serve(args: argparse.Namespace) -> int:
    import httpx
    percentiles = _percentiles(args.percentiles)
    slos = _slos(args.goodput)
    config = _config(args)
    try:
        tokenizer = _tokenizer(args) if config.needs_tokenizer else None
        requests = dataset_requests(config, tokenizer)
        stages_before = scrape_stages(args.base_url, args.api_key)
        run = _run(config, requests, args.num_clients, args.disable_tqdm)
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
    result_path, plot_path = output_paths(args, run)
    if result_path is not None:
        write_result(run, summary, result_path)
    if plot_path is not None:
        write_plot(run, plot_path)
    return 0 if summary["completed"] == summary["num_prompts"] else 1


def _config(args: argparse.Namespace) -> BenchConfig:
    endpoint = args.endpoint or BACKENDS.get(args.backend, "completions")
    return BenchConfig(
        base_url=args.base_url, model=args.model, api_key=args.api_key,
        num_prompts=args.num_prompts, input_len=args.isl, output_len=args.osl,
        range_ratio=args.random_range_ratio, vocab_size=args.random_vocab_size,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
        timeout_s=args.timeout, endpoint=endpoint, dataset_name=args.dataset_name,
        dataset_path=args.dataset_path, fixed_output_len=args.output_len)


def _run(config: BenchConfig, requests, num_clients: int, disable_progress: bool) -> BenchRun:
    with progress_bar(total=len(requests), desc="Requests", unit="req",
                      disable=disable_progress) as bar:
        if num_clients > 1:
            return run_in_processes(config, requests, num_clients, bar)
        return asyncio.run(run_benchmark(config, requests, on_done=bar.update))


def _tokenizer(args: argparse.Namespace):
    """--tokenizer, else --model, else the model the server names first."""
    name = args.tokenizer or args.model
    if name is None:
        import httpx
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        response = httpx.get(f"{args.base_url.rstrip('/')}/v1/models", headers=headers,
                             timeout=args.timeout)
        response.raise_for_status()
        name = response.json()["data"][0]["id"]
    return load_tokenizer(name)


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


def _endpoint(text: str) -> str:
    for name, path in ENDPOINTS.items():
        if text in (name, path):
            return name
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(ENDPOINTS)} (or "
                                     f"{', '.join(ENDPOINTS.values())}), got {text!r}")


def _dataset(text: str) -> str:
    name = DATASET_ALIASES.get(text, text)
    if name not in DATASETS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DATASETS)}, "
                                         f"got {text!r}")
    return name


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = -1.0
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"expected a positive rate or inf, got {text!r}")
    return rate


