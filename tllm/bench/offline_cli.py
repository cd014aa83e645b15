"""`tllm bench throughput` and `tllm bench latency`: their command lines, the engine they
build, the table they print and the JSON they write."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from tllm.bench.offline import (PERCENTILES, LatencyConfig, ThroughputConfig, run_latency,
                                run_throughput)
from tllm.cli_types import non_negative_int, positive_float, positive_int
from tllm.llmapi.cli_args import add_engine_args, llm_kwargs, read_llm_options
from tllm.llmapi.llm import LLM
from tllm.config import KvCacheConfig
from tllm.loader import DEFAULT_MODEL

_WIDTH = 64


def add_bench_offline_parsers(subparsers) -> None:
    """Add `throughput` and `latency` to the subparsers of `tllm bench`."""
    parser = subparsers.add_parser(
        "throughput", help="offline throughput: many requests through the LLM API",
        description="Run NUM_REQUESTS synthetic requests (exactly ISL random prompt tokens, "
                    "exactly OSL output tokens) through an in-process engine, all at once or "
                    "CONCURRENCY at a time, after a warm-up; report tokens/s and TTFT, TPOT, "
                    "ITL percentiles.")
    _add_common_args(parser)
    parser.add_argument("--num-requests", type=positive_int, default=100,
                        help="timed requests (default 100)")
    parser.add_argument("--concurrency", type=positive_int,
                        help="most requests in flight (default: all submitted at once)")
    parser.add_argument("--warmup", type=non_negative_int, default=2,
                        help="untimed warm-up requests first (default 2)")
    parser.add_argument("--time-limit", type=positive_float, metavar="SECONDS",
                        help="abort requests still running after this long and report what "
                             "was done (marked as truncated)")
    parser.set_defaults(run=run_bench_throughput)

    parser = subparsers.add_parser(
        "latency", help="offline latency: one batch of requests at a time",
        description="Run BATCH_SIZE synthetic requests together (exactly ISL random prompt "
                    "tokens, exactly OSL output tokens), ITERATIONS times after a warm-up; "
                    "report medians of latency, output tokens/s, TTFT and TPOT.")
    _add_common_args(parser)
    parser.add_argument("--batch-size", type=positive_int, default=1,
                        help="requests run together (default 1)")
    parser.add_argument("--iterations", type=positive_int, default=3,
                        help="timed batches (default 3)")
    parser.add_argument("--warmup", type=non_negative_int, default=1,
                        help="untimed batches first (default 1)")
    parser.add_argument("--time-limit", type=positive_float, metavar="SECONDS",
                        help="start no new iteration after this long (one always runs)")
    parser.set_defaults(run=run_bench_latency)


def _add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m",
                        help=f"HF model directory, .gguf file, '{DEFAULT_MODEL}' (default) or "
                             "'dummy:<preset>' (random weights, e.g. dummy:llama-3.1-8b)")
    parser.add_argument("--isl", type=positive_int, default=128,
                        help="prompt tokens per request (default 128)")
    parser.add_argument("--osl", type=positive_int, default=128,
                        help="output tokens per request (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default) samples greedily")
    parser.add_argument("--seed", type=int, default=0, help="prompts, sampling, dummy weights")
    parser.add_argument("--json", metavar="PATH", help="write every figure here as JSON")
    add_progress_arg(parser)
    group = parser.add_argument_group(
        "engine", "LLM arguments; these flags win over --extra-llm-api-options (--config)")
    add_engine_args(group, help_text={
        "max_seq_len": "default: ISL + OSL, rounded up to whole KV blocks"})


def add_progress_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disable-tqdm", "--disable-progress", action="store_true",
                        help="no progress bars on stderr (also: TQDM_DISABLE=1, or a log "
                             "level above info)")


# ---- running ----

def run_bench_throughput(args: argparse.Namespace) -> int:
    config = ThroughputConfig(
        isl=args.isl, osl=args.osl, num_requests=args.num_requests,
        concurrency=args.concurrency, warmup=args.warmup, temperature=args.temperature,
        seed=args.seed, time_limit_s=args.time_limit)
    with _load_llm(engine_kwargs(args)) as llm:
        result = run_throughput(llm, config, show_progress=not args.disable_tqdm)
    return _report(result, args.json)


def run_bench_latency(args: argparse.Namespace) -> int:
    config = LatencyConfig(
        isl=args.isl, osl=args.osl, batch_size=args.batch_size, iterations=args.iterations,
        warmup=args.warmup, temperature=args.temperature, seed=args.seed,
        time_limit_s=args.time_limit)
    with _load_llm(engine_kwargs(args, max_batch_size=args.batch_size)) as llm:
        result = run_latency(llm, config, show_progress=not args.disable_tqdm)
    return _report(result, args.json)


def engine_kwargs(args: argparse.Namespace, **defaults) -> dict:
    """LLM(...) keyword arguments: the engine flags over the YAML options over the benchmark's
    defaults (`defaults`, the seed, max_seq_len about ISL + OSL)."""
    return llm_kwargs(args, model=args.model, defaults={
        "max_seq_len": lambda kwargs: _whole_blocks(args.isl + args.osl, kwargs),
        "seed": args.seed, **defaults})


def _whole_blocks(num_tokens: int, kwargs: dict) -> int:
    # Rounded up to whole KV blocks: the engine sizes its cache as max_batch_size *
    # max_seq_len tokens, and a sequence holds whole blocks, so a batch of ISL + OSL
    # sequences could otherwise not all fit at once.
    block = kwargs.get("kv_cache_config", {}).get("tokens_per_block",
                                                  KvCacheConfig().tokens_per_block)
    return -(-num_tokens // block) * block


def load_extra_options(path: str | None) -> dict:
    """The mapping of LLM arguments in a YAML file (empty without one); for scripts that take
    an --extra-llm-api-options file of their own (benchmarks/gpu_fastpath.py)."""
    return read_llm_options(path, "--extra-llm-api-options") if path else {}


def _load_llm(kwargs: dict) -> LLM:
    start = time.perf_counter()
    llm = LLM(**kwargs)
    print(f"loaded {kwargs['model']} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return llm


def _report(result: dict, json_path: str | None) -> int:
    print(format_report(result), flush=True)
    if json_path:
        write_json(result, json_path)
        print(f"wrote {json_path}", file=sys.stderr)
    if result["num_wrong_length"]:
        print(f"error: {result['num_wrong_length']} requests did not produce exactly "
              f"{result['workload']['osl']} tokens", file=sys.stderr)
        return 1
    return 0


def write_json(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(no_nan(result), indent=1))


def no_nan(value):
    """JSON has no NaN or infinity: null instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [no_nan(v) for v in value]
    return value


# ---- the table ----

def format_report(result: dict) -> str:
    """The compact table printed at the end of `tllm bench throughput | latency`."""
    work = result["workload"]
    lines = [f" tllm bench {result['benchmark']} ".center(_WIDTH, "=")]
    lines += _rows([("Model", result["model"])])
    lines += _engine_lines(result["engine"])
    rows = [("ISL / OSL", f"{work['isl']} / {work['osl']}")]
    if result["benchmark"] == "throughput":
        rows += _throughput_rows(result)
    else:
        rows += _latency_rows(result)
    if result["peak_gpu_memory_gib"] is not None:
        rows.append(("Peak GPU memory (GiB)", f"{result['peak_gpu_memory_gib']:.2f}"))
    lines += _rows(rows)
    if result["benchmark"] == "throughput":
        lines += _percentile_block(result, ("ttft", "tpot", "itl", "e2e"))
    else:
        lines += _percentile_block(result, ("itl",))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _throughput_rows(result: dict) -> list[tuple[str, str]]:
    work = result["workload"]
    load = f"concurrency {work['concurrency']}" if work["concurrency"] else "max load"
    done = f"{result['num_completed']} of {result['num_requests']}"
    if result["is_truncated"]:
        done += f" (time limit {work['time_limit_s']:g} s hit)"
    return [("Requests", f"{result['num_requests']} (+{work['warmup']} warm-up), {load}"),
            ("Completed", done),
            ("Duration (s)", f"{result['duration_s']:.2f}"),
            ("Output tokens", f"{result['total_output_tokens']}"),
            ("Output tokens/s", f"{result['output_tokens_per_s']:.1f}"),
            ("Total tokens/s", f"{result['total_tokens_per_s']:.1f}"),
            ("Requests/s", f"{result['requests_per_s']:.2f}"),
            ("Most in flight / engine steps",
             f"{result['max_in_flight']} / {result['engine_steps']}"),
            *_speculation_rows(result)]


def _speculation_rows(result: dict) -> list[tuple[str, str]]:
    if "spec_draft_tokens" not in result:
        return []
    return [("Draft / accepted tokens",
             f"{result['spec_draft_tokens']} / {result['spec_accepted_tokens']}"),
            ("Acceptance rate", f"{result['spec_acceptance_rate']:.3f}"),
            ("Mean accepted length", f"{result['spec_mean_accepted_length']:.2f}")]


def _latency_rows(result: dict) -> list[tuple[str, str]]:
    work = result["workload"]
    return [("Batch size", f"{work['batch_size']}"),
            ("Iterations", f"{result['num_iterations']} (+{work['warmup']} warm-up)"),
            ("Latency (s), median", f"{result['latency_s']:.3f}"),
            ("Output tokens/s, median", f"{result['output_tokens_per_s']:.1f}"),
            ("TTFT (ms), median", f"{result['ttft_ms']:.2f}"),
            ("TPOT (ms), median", f"{result['tpot_ms']:.3f}")]


def _engine_lines(engine: dict) -> list[str]:
    resolved = engine["resolved"]
    device = resolved["device"]
    if resolved["device_name"] != "cpu":
        device += f" ({resolved['device_name']})"
    first = f"{resolved['dtype']} on {device}, {resolved['attn_backend']} attention"
    second = (f"max_batch_size {engine['max_batch_size']}, max_num_tokens "
              f"{engine['max_num_tokens']}, max_seq_len {resolved['max_seq_len']}, "
              f"KV {resolved['kv_cache_tokens']} tokens")
    lines = [f"{'Engine':<14}{first}", f"{'':<14}{second}"]
    # shown when this engine version has them
    flags = []
    if "cuda_graph_config" in engine and resolved["device"].startswith("cuda"):
        flags.append(f"CUDA graphs {'off' if engine['cuda_graph_config'] is None else 'on'}")
    if engine.get("tensor_parallel_size", 1) * engine.get("pipeline_parallel_size", 1) > 1:
        flags.append(f"TP {engine['tensor_parallel_size']} x PP "
                     f"{engine['pipeline_parallel_size']}")
    if "disable_overlap_scheduler" in engine:
        flags.append(f"overlap scheduler {'off' if engine['disable_overlap_scheduler'] else 'on'}")
    if flags:
        lines.append(f"{'':<14}{', '.join(flags)}")
    return lines


def _percentile_block(result: dict, names: tuple[str, ...]) -> list[str]:
    columns = ["mean"] + [f"p{q}" for q in PERCENTILES]
    lines = [" latency (ms) ".center(_WIDTH, "-"),
             f"{'':<24}" + "".join(f"{c:>10}" for c in columns)]
    for name in names:
        stats = result[f"{name}_ms"]
        lines.append(f"{name.upper():<24}" + "".join(f"{stats[c]:>10.2f}" for c in columns))
    return lines


def _rows(rows: list[tuple[str, str]]) -> list[str]:
    return [f"{name:<32}{value:>{_WIDTH - 32}}" for name, value in rows]







