"""The serving benchmark's load over several processes. One Python process parses about
ten thousand streamed tokens a second (httpx, SSE lines, JSON); beyond that the client, not
the server, sets the figures. `run_in_processes` deals the same requests and send times that
one process would use round-robin to N spawned processes, starts them together (a barrier,
after each has checked the endpoint), and merges their per-request results into one run.
A counter they share tells the parent how many requests have ended (its progress bar)."""
from __future__ import annotations

import asyncio
import math
import multiprocessing
import queue
import time

from tllm.bench.serve import BenchConfig, BenchRun, arrival_offsets, run_share
from tllm.bench.serve_datasets import BenchRequest

_RESULT_TIMEOUT_S = 60.0      # beyond the requests' own timeout
_POLL_S = 0.5                 # how often the parent reads the shared counter


def run_in_processes(config: BenchConfig, requests: list[BenchRequest], num_clients: int,
                     progress=None) -> BenchRun:
    """`requests` over `num_clients` processes; `progress` (a tqdm bar, or None) advances
    as they end."""
    offsets = arrival_offsets(len(requests), config.request_rate, config.seed)
    num_clients = max(1, min(num_clients, len(requests)))
    concurrency = (None if config.max_concurrency is None
                   else math.ceil(config.max_concurrency / num_clients))
    context = multiprocessing.get_context("spawn")
    ready, results = context.Barrier(num_clients), context.Queue()
    num_done = context.Value("i", 0)
    procs = [context.Process(target=_client_main, daemon=True, args=(
        config, requests[i::num_clients], offsets[i::num_clients], concurrency, ready,
        results, i, num_done)) for i in range(num_clients)]
    for proc in procs:
        proc.start()
    try:
        shares = _collect(results, procs, config.timeout_s + _RESULT_TIMEOUT_S,
                          _Progress(num_done, progress))
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    merged = [None] * len(requests)
    for index, share in shares.items():
        merged[index::num_clients] = share.results
    return BenchRun(config, shares[0].model, merged,
                    max(share.duration_s for share in shares.values()))


class _Progress:
    """Moves a bar to the shared count of ended requests."""

    def __init__(self, num_done, bar) -> None:
        self.num_done, self.bar, self.shown = num_done, bar, 0

    def poll(self) -> None:
        count = self.num_done.value
        if self.bar is not None and count > self.shown:
            self.bar.update(count - self.shown)
            self.shown = count


def _collect(results, procs, timeout_s: float, progress: _Progress) -> dict[int, BenchRun]:
    shares: dict[int, BenchRun] = {}
    deadline = time.monotonic() + timeout_s     # for the next result
    while len(shares) < len(procs):
        try:
            index, share = results.get(timeout=_POLL_S)
        except queue.Empty:
            progress.poll()
            if time.monotonic() > deadline:
                raise RuntimeError("a load-generator process sent no result") from None
            continue
        progress.poll()
        deadline = time.monotonic() + timeout_s
        if isinstance(share, Exception):
            raise RuntimeError(f"load generator {index}: {share}")
        shares[index] = share
    return shares


def _client_main(config: BenchConfig, requests, offsets, concurrency, ready, results,
                 index: int, num_done) -> None:
    def on_done() -> None:
        with num_done.get_lock():
            num_done.value += 1
    try:
        share = asyncio.run(run_share(config, requests, offsets, concurrency, ready,
                                      on_done))
    except Exception as exc:    # reported by the parent, which raises it
        ready.abort()           # the others must not wait for this one
        results.put((index, RuntimeError(f"{type(exc).__name__}: {exc}")))
        return
    results.put((index, share))
