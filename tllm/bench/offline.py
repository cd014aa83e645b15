"""Offline benchmarks of the LLM API (`tllm bench throughput | latency`), TensorRT-LLM's
trtllm-bench in spirit: synthetic prompts of exactly `isl` random token ids, exactly `osl`
output tokens per request (EOS ignored), warm-up requests excluded from the timing.

Every request streams, so inter-token latency (ITL) is measured where the caller sees the
tokens; TTFT and end-to-end latency come from the engine's own request metrics (seconds from
arrival), and TPOT is (e2e - TTFT) / (osl - 1)."""
from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from tllm.llmapi.llm import LLM
from tllm.progress import progress_bar
from tllm.sampling_params import SamplingParams
from tllm.bench.serve_metrics import percentile
from tllm.runner.build import pick_backend

PERCENTILES = (50, 90, 99)
# After a time limit aborts the requests in flight, how long to wait for the engine to end them.
_ABORT_GRACE_S = 30.0


@dataclass(frozen=True)
class ThroughputConfig:
    isl: int
    osl: int
    num_requests: int
    concurrency: int | None = None   # None: everything submitted at once (max load)
    warmup: int = 2                  # requests run (and discarded) before the timed ones
    temperature: float = 0.0
    seed: int = 0
    time_limit_s: float | None = None  # abort what is still running after this long


@dataclass(frozen=True)
class LatencyConfig:
    isl: int
    osl: int
    batch_size: int = 1
    iterations: int = 3
    warmup: int = 1                  # iterations run (and discarded) before the timed ones
    temperature: float = 0.0
    seed: int = 0
    time_limit_s: float | None = None  # stop iterating (after at least one) past this long


@dataclass
class RequestRecord:
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    ttft_s: float | None
    e2e_s: float | None
    queue_s: float | None
    itl_s: list[float] = field(default_factory=list)

    @property
    def is_complete(self) -> bool:
        return self.finish_reason is not None and self.finish_reason != "abort"

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass
class RunRecord:
    """What one batch of requests did; `requests` holds those that were submitted."""

    requests: list[RequestRecord]
    duration_s: float
    max_in_flight: int
    is_truncated: bool = False       # a time limit aborted part of it

    @property
    def complete(self) -> list[RequestRecord]:
        return [r for r in self.requests if r.is_complete]


# ---- workload ----

def model_vocab_size(llm: LLM) -> int:
    return int(llm._engine.config.vocab_size)


def synthetic_prompts(num: int, isl: int, vocab_size: int,
                      generator: torch.Generator) -> list[dict]:
    """`num` prompts of exactly `isl` token ids drawn uniformly from the vocabulary."""
    ids = torch.randint(0, vocab_size, (num, isl), generator=generator)
    return [{"prompt_token_ids": row} for row in ids.tolist()]


def exact_length_params(osl: int, temperature: float = 0.0) -> SamplingParams:
    """Exactly `osl` output tokens, whatever they are; no detokenization (as trtllm-bench)."""
    return SamplingParams(max_tokens=osl, min_tokens=osl, ignore_eos=True,
                          temperature=temperature, detokenize=False)


# ---- running requests ----

def run_requests(llm: LLM, prompts: list[dict], params: SamplingParams,
                 concurrency: int | None = None, time_limit_s: float | None = None,
                 progress: str | None = None) -> RunRecord:
    """Stream every prompt through the engine, at most `concurrency` at a time; with
    `progress`, a bar so labelled counts the finished requests."""
    if not prompts:
        return RunRecord([], 0.0, 0)
    with progress_bar(total=len(prompts), desc=progress, unit="req",
                      disable=progress is None) as bar:
        return asyncio.run(_run_requests(llm, prompts, params, concurrency, time_limit_s,
                                         bar))


async def _run_requests(llm, prompts, params, concurrency, time_limit_s, bar) -> RunRecord:
    limit = asyncio.Semaphore(concurrency or len(prompts))
    in_flight = {}            # index -> GenerationResult
    records: dict[int, RequestRecord] = {}
    peak = 0
    stopping = False

    async def one(index: int, prompt: dict) -> None:
        nonlocal peak
        async with limit:
            if stopping:
                return
            result = llm.generate_async(prompt, params, streaming=True)
            in_flight[index] = result
            peak = max(peak, len(in_flight))
            try:
                records[index] = await _consume(result)
            finally:
                del in_flight[index]
            bar.update()

    start = time.perf_counter()
    tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
    _, pending = await asyncio.wait(tasks, timeout=time_limit_s,
                                    return_when=asyncio.FIRST_EXCEPTION)
    if pending:  # a time limit, or a failed request: stop the rest
        stopping = True
        for result in list(in_flight.values()):
            result.abort()
        _, still = await asyncio.wait(pending, timeout=_ABORT_GRACE_S)
        for task in still:
            task.cancel()
    duration = time.perf_counter() - start
    errors = [t.exception() for t in tasks if t.done() and not t.cancelled()]
    errors = [e for e in errors if e is not None]
    if errors:
        raise errors[0]
    return RunRecord([records[i] for i in sorted(records)], duration, peak,
                     is_truncated=bool(pending))


async def _consume(result) -> RequestRecord:
    stamps: list[float] = []
    output = None
    async for output in result:
        if output.outputs[0].token_ids_diff:
            stamps.append(time.perf_counter())
    sample, metrics = output.outputs[0], output.metrics
    return RequestRecord(
        num_prompt_tokens=len(output.prompt_token_ids), num_output_tokens=len(sample.token_ids),
        finish_reason=sample.finish_reason, ttft_s=metrics.get("ttft_s"),
        e2e_s=metrics.get("e2e_s"), queue_s=metrics.get("queue_s"),
        itl_s=[b - a for a, b in itertools.pairwise(stamps)])


# ---- benchmarks ----

def run_throughput(llm: LLM, config: ThroughputConfig, show_progress: bool = False) -> dict:
    """Warm up, then run `num_requests` requests (max load or `concurrency` in flight);
    `show_progress`: bars over the finished requests."""
    _check_fits(llm, config.isl, config.osl)
    generator = torch.Generator().manual_seed(config.seed)
    vocab = model_vocab_size(llm)
    params = exact_length_params(config.osl, config.temperature)
    _reset_peak_memory(llm)
    if config.warmup:
        run_requests(llm, synthetic_prompts(config.warmup, config.isl, vocab, generator), params,
                     config.concurrency, progress="Warm-up" if show_progress else None)
    prompts = synthetic_prompts(config.num_requests, config.isl, vocab, generator)
    before = llm.get_stats()
    run = run_requests(llm, prompts, params, config.concurrency, config.time_limit_s,
                       progress="Requests" if show_progress else None)
    after = llm.get_stats()
    done = run.complete
    duration = max(run.duration_s, 1e-9)
    num_input = sum(r.num_prompt_tokens for r in run.requests)
    num_output = sum(r.num_output_tokens for r in run.requests)
    return {
        "benchmark": "throughput", "model": llm.args.model, "engine": engine_summary(llm),
        "workload": asdict(config),
        "num_requests": config.num_requests, "num_completed": len(done),
        "num_incomplete": config.num_requests - len(done), "is_truncated": run.is_truncated,
        "num_wrong_length": sum(r.num_output_tokens != config.osl for r in done),
        "duration_s": run.duration_s, "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "output_tokens_per_s": num_output / duration,
        "total_tokens_per_s": (num_input + num_output) / duration,
        "requests_per_s": len(done) / duration,
        "ttft_ms": latency_stats([r.ttft_s for r in done]),
        "tpot_ms": latency_stats([r.tpot_s for r in done]),
        "itl_ms": latency_stats([x for r in done for x in r.itl_s]),
        "e2e_ms": latency_stats([r.e2e_s for r in done]),
        "queue_ms": latency_stats([r.queue_s for r in done]),
        "max_in_flight": run.max_in_flight,
        "engine_steps": after["num_steps"] - before["num_steps"],
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        **speculation_counters(before, after),
        "peak_gpu_memory_gib": _peak_memory_gib(llm)}


def speculation_counters(before: dict, after: dict) -> dict:
    """Speculative decoding over a run (nothing without a drafter): drafted and accepted
    tokens, acceptance rate, mean accepted length (tokens a verify step gains)."""
    if "spec_draft_tokens" not in after:
        return {}
    drafted, accepted, steps = (after[k] - before[k] for k in (
        "spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps"))
    return {"spec_draft_tokens": drafted, "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_mean_accepted_length": (accepted + steps) / steps if steps else 0.0}


def run_latency(llm: LLM, config: LatencyConfig, show_progress: bool = False) -> dict:
    """`batch_size` requests run together, `iterations` times (fresh prompts each time, so
    no prefix-cache hits); medians over the iterations. `show_progress`: a bar over the
    iterations, warm-up included."""
    _check_fits(llm, config.isl, config.osl)
    if config.batch_size > llm.args.max_batch_size:
        raise ValueError(f"batch size {config.batch_size} is more than the engine's "
                         f"max_batch_size ({llm.args.max_batch_size}): the batch would not "
                         "run together")
    generator = torch.Generator().manual_seed(config.seed)
    vocab = model_vocab_size(llm)
    params = exact_length_params(config.osl, config.temperature)
    _reset_peak_memory(llm)
    with progress_bar(total=config.warmup + config.iterations, desc="Iterations",
                      unit="batch", disable=not show_progress) as bar:
        for _ in range(config.warmup):
            run_requests(llm, synthetic_prompts(config.batch_size, config.isl, vocab,
                                                generator), params)
            bar.update()
        iterations, itls = _timed_iterations(llm, config, params, vocab, generator, bar)
    return {
        "benchmark": "latency", "model": llm.args.model, "engine": engine_summary(llm),
        "workload": asdict(config), "num_iterations": len(iterations),
        **{key: statistics.median(it[key] for it in iterations) for key in
           ("latency_s", "output_tokens_per_s", "ttft_ms", "tpot_ms")},
        "itl_ms": latency_stats(itls),
        "num_wrong_length": sum(it["num_wrong_length"] for it in iterations),
        "per_iteration": iterations,
        "peak_gpu_memory_gib": _peak_memory_gib(llm)}


def _timed_iterations(llm: LLM, config: LatencyConfig, params: SamplingParams, vocab: int,
                      generator: torch.Generator, bar) -> tuple[list[dict], list[float]]:
    """The timed batches' figures, and every inter-token latency of them."""
    start = time.perf_counter()
    iterations, itls = [], []
    while len(iterations) < config.iterations:
        if iterations and config.time_limit_s is not None \
                and time.perf_counter() - start > config.time_limit_s:
            break
        prompts = synthetic_prompts(config.batch_size, config.isl, vocab, generator)
        run = run_requests(llm, prompts, params)
        iterations.append(_iteration_figures(run, config))
        itls += [x for r in run.requests for x in r.itl_s]
        bar.update()
    return iterations, itls


def _iteration_figures(run: RunRecord, config: LatencyConfig) -> dict:
    records = run.requests
    num_output = sum(r.num_output_tokens for r in records)
    tpots = [r.tpot_s for r in records if r.tpot_s is not None]
    return {"latency_s": run.duration_s, "num_output_tokens": num_output,
            "output_tokens_per_s": num_output / max(run.duration_s, 1e-9),
            "ttft_ms": 1000 * statistics.fmean(r.ttft_s or 0.0 for r in records),
            "tpot_ms": 1000 * statistics.fmean(tpots) if tpots else float("nan"),
            "num_wrong_length": sum(r.num_output_tokens != config.osl for r in records)}


def _check_fits(llm: LLM, isl: int, osl: int) -> None:
    if isl + osl > llm.max_seq_len:
        raise ValueError(f"ISL {isl} + OSL {osl} is more than the engine's max_seq_len "
                         f"({llm.max_seq_len})")


# ---- figures ----

def latency_stats(seconds: list[float | None]) -> dict[str, float]:
    """mean and percentiles, in milliseconds; NaN when there is nothing to measure."""
    ms = [1000 * s for s in seconds if s is not None]
    stats = {"mean": statistics.fmean(ms) if ms else float("nan")}
    stats |= {f"p{q}": percentile(ms, q) for q in PERCENTILES}
    return stats


def engine_summary(llm: LLM) -> dict:
    """The LLM arguments as given, plus what the engine resolved them to."""
    engine = llm._engine
    stats = llm.get_stats()
    summary = llm.args.model_dump(mode="json")
    summary["resolved"] = {
        "device": str(engine.device),
        "device_name": (torch.cuda.get_device_name(engine.device)
                        if engine.device.type == "cuda" else "cpu"),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "attn_backend": pick_backend(llm.args.attn_backend, engine.device),
        "max_seq_len": engine.max_seq_len,
        "kv_cache_tokens": stats["kv_blocks_total"] * llm.args.kv_cache_config.tokens_per_block,
        "torch": torch.__version__}
    return summary


def _reset_peak_memory(llm: LLM) -> None:
    if llm._engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(llm._engine.device)


def _peak_memory_gib(llm: LLM) -> float | None:
    if llm._engine.device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(llm._engine.device) / 2**30
