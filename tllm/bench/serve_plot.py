"""The serving benchmark's PNG: latency CDFs (TTFT, TPOT, ITL, end-to-end) and output
throughput over time. Needs matplotlib."""
from __future__ import annotations

from tllm.bench.serve import BenchRun, RequestResult


def plot_run(run: BenchRun, path: str, bin_s: float = 1.0) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in run.results if r.is_ok]
    figure, (cdf_axes, rate_axes) = plt.subplots(1, 2, figsize=(13, 4.8))
    _plot_cdfs(cdf_axes, done)
    times, rates = output_rate(run, bin_s)
    rate_axes.plot(times, rates, drawstyle="steps-post")
    rate_axes.set(xlabel="time since start (s)", ylabel="output tokens/s",
                  title=f"Output throughput ({bin_s:g} s bins)")
    rate_axes.grid(True, alpha=0.3)
    config = run.config
    workload = (f"isl {config.input_len}, osl {config.output_len}"
                if config.dataset_name == "random" else config.dataset_name)
    figure.suptitle(f"{run.model} ({config.endpoint}): {len(done)}/{len(run.results)} "
                    f"requests, {workload}, "
                    f"rate {config.request_rate:g}/s, "
                    f"concurrency {config.max_concurrency or 'unbounded'}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _plot_cdfs(axes, done: list[RequestResult]) -> None:
    latencies = {"TTFT": [r.ttft for r in done if r.ttft is not None],
                 "TPOT": [r.tpot for r in done if r.tpot is not None],
                 "ITL": [x for r in done for x in r.itls],
                 "E2E": [r.e2e for r in done if r.e2e is not None]}
    for name, seconds in latencies.items():
        if seconds:
            ordered = sorted(s * 1000 for s in seconds)
            axes.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))],
                      where="post", label=name)
    axes.set(xscale="log", xlabel="latency (ms)", ylabel="fraction of requests (ITL: tokens)",
             title="Latency CDF")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()


def output_rate(run: BenchRun, bin_s: float) -> tuple[list[float], list[float]]:
    """Output tokens per second in bins of bin_s; each request's tokens are spread evenly
    over the chunks it received."""
    num_bins = max(1, int(run.duration_s / bin_s) + 1)
    tokens = [0.0] * num_bins
    for result in run.results:
        if not result.is_ok or not result.chunk_times:
            continue
        per_chunk = result.num_output_tokens / len(result.chunk_times)
        for t in result.chunk_times:
            tokens[min(int(t / bin_s), num_bins - 1)] += per_chunk
    return [i * bin_s for i in range(num_bins)], [n / bin_s for n in tokens]
