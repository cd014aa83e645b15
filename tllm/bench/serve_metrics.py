"""Figures of a serving benchmark run: TTFT, TPOT, ITL and end-to-end latency percentiles,
throughput, and goodput (requests per second that met every SLO)."""
from __future__ import annotations

import statistics

from tllm.bench.serve import BenchRun, RequestResult

# SLO names of --goodput, and the per-request latency each one bounds (in seconds).
SLO_METRICS = {"ttft": lambda r: r.ttft, "tpot": lambda r: r.tpot, "e2el": lambda r: r.e2e}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated as numpy's default."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def latency_stats(name: str, seconds: list[float], percentiles: list[float]) -> dict:
    """mean/median/std and percentiles of a latency, in milliseconds."""
    ms = [s * 1000 for s in seconds]
    stats = {f"mean_{name}_ms": statistics.fmean(ms) if ms else float("nan"),
             f"median_{name}_ms": statistics.median(ms) if ms else float("nan"),
             f"std_{name}_ms": statistics.pstdev(ms) if ms else float("nan")}
    for q in percentiles:
        stats[f"p{q:g}_{name}_ms"] = percentile(ms, q)
    return stats


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    for name, limit_ms in slos_ms.items():
        value = SLO_METRICS[name](result)
        if value is not None and value * 1000 > limit_ms:
            return False
    return True


def summarize(run: BenchRun, percentiles: list[float],
              slos_ms: dict[str, float] | None = None) -> dict:
    """Every figure of the run, as a flat dict (what the JSON result holds)."""
    done = [r for r in run.results if r.is_ok]
    duration = max(run.duration_s, 1e-9)
    num_input = sum(r.num_prompt_tokens for r in done)
    num_output = sum(r.num_output_tokens for r in done)
    config = run.config
    is_random = config.dataset_name == "random"
    summary = {
        "model": run.model, "endpoint": config.endpoint, "dataset_name": config.dataset_name,
        "dataset_path": config.dataset_path, "num_prompts": len(run.results),
        "completed": len(done), "failed": len(run.results) - len(done),
        "duration_s": run.duration_s, "request_rate": config.request_rate,
        "max_concurrency": config.max_concurrency,
        # the random dataset's lengths; a file's vary by request (see "requests")
        "input_len": config.input_len if is_random else None,
        "output_len": config.output_len if is_random else config.fixed_output_len,
        "total_input_tokens": num_input, "total_output_tokens": num_output,
        "request_throughput": len(done) / duration,
        "output_throughput": num_output / duration,
        "total_token_throughput": (num_input + num_output) / duration,
        "errors": sorted({r.error for r in run.results if r.error})[:10]}
    if slos_ms:
        summary["goodput_slos_ms"] = slos_ms
        summary["goodput"] = sum(1 for r in done if meets_slos(r, slos_ms)) / duration
    summary |= latency_stats("ttft", [r.ttft for r in done if r.ttft is not None], percentiles)
    summary |= latency_stats("tpot", [r.tpot for r in done if r.tpot is not None], percentiles)
    summary |= latency_stats("itl", [x for r in done for x in r.itls], percentiles)
    summary |= latency_stats("e2el", [r.e2e for r in done if r.e2e is not None], percentiles)
    return summary


def format_summary(summary: dict, percentiles: list[float]) -> str:
    """The human-readable table printed at the end of a run."""
    rows = [("Successful requests", f"{summary['completed']}"),
            ("Failed requests", f"{summary['failed']}"),
            ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
            ("Total input tokens", f"{summary['total_input_tokens']}"),
            ("Total generated tokens", f"{summary['total_output_tokens']}"),
            ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}")]
    if "goodput" in summary:
        rows.append(("Request goodput (req/s)", f"{summary['goodput']:.2f}"))
    lines = [f"{' Serving Benchmark Result ':=^56}"]
    lines += [f"{name:<40}{value:>16}" for name, value in rows]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{' ' + title + ' ':-^56}")
        median = [] if 50 in percentiles else ["median"]
        for stat in ["mean"] + median + [f"p{q:g}" for q in percentiles]:
            label = f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} " \
                    f"{key.upper()} (ms)"
            lines.append(f"{label:<40}{summary[f'{stat}_{key}_ms']:>16.2f}")
    lines.append("=" * 56)
    return "\n".join(lines)
