"""The serving benchmark's load over several processes. One Python process parses about
ten thousand streamed tokens a second (httpx, SSE lines, JSON); beyond that the client, not
the server, sets the figures. `run_in_processes` deals the same requests and send times that
one process would use round-robin to N spawned processes, starts them together (a barrier,
after each has checked the endpoint), and merges their per-request results into one run."""
from __future__ import annotations

import asyncio
import math
import multiprocessing
import queue

from tllm.bench.serve import BenchConfig, BenchRun, arrival_offsets, random_requests, run_share

_RESULT_TIMEOUT_S = 60.0      # beyond the requests' own timeout


def run_in_processes(config: BenchConfig, num_clients: int) -> BenchRun:
    requests = random_requests(config)
    offsets = arrival_offsets(len(requests), config.request_rate, config.seed)
    num_clients = max(1, min(num_clients, len(requests)))
    concurrency = (None if config.max_concurrency is None
                   else math.ceil(config.max_concurrency / num_clients))
    context = multiprocessing.get_context("spawn")
    ready, results = context.Barrier(num_clients), context.Queue()
    procs = [context.Process(target=_client_main, daemon=True, args=(
        config, requests[i::num_clients], offsets[i::num_clients], concurrency, ready,
        results, i)) for i in range(num_clients)]
    for proc in procs:
        proc.start()
    try:
        shares = _collect(results, procs, config.timeout_s + _RESULT_TIMEOUT_S)
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


def _collect(results, procs, timeout_s: float) -> dict[int, BenchRun]:
    shares: dict[int, BenchRun] = {}
    while len(shares) < len(procs):
        try:
            index, share = results.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError("a load-generator process sent no result") from None
        if isinstance(share, Exception):
            raise RuntimeError(f"load generator {index}: {share}")
        shares[index] = share
    return shares


def _client_main(config: BenchConfig, requests, offsets, concurrency, ready, results,
                 index: int) -> None:
    try:
        share = asyncio.run(run_share(config, requests, offsets, concurrency, ready))
    except Exception as exc:    # reported by the parent, which raises it
        ready.abort()           # the others must not wait for this one
        results.put((index, RuntimeError(f"{type(exc).__name__}: {exc}")))
        return
    results.put((index, share))
