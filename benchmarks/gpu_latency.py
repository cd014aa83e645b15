"""Issue 21's latency figures in one device call, on dummy:llama-3.1-8b (bf16):

  floor       device-to-device copy bandwidth and the weight bytes -> the batch-1 floor
  latency     tllm batch 1, ISL 128 / OSL 256 (CUDA graphs), next to the floor
  compiled    the same with cuda_graph_config.torch_compile (graphs from the compiled model)
  replay      torch.profiler over replays of tllm's batch-1 decode graph: per replay its
              span, GPU busy time, gaps, kernels; the top kernels (time, calls); the trace
              goes to $OUT
  lm_head     the LM head + argmax fused kernel vs cuBLAS GEMV + torch.argmax at M=1
  load        ISL/OSL 128/128, 1,000 requests at max load: output tok/s and ITL p50/p99
              under the default step (max_num_tokens), step_token_budget 512 and 256 and
              prefill_token_budget 512, 1024, 2048, each with its steps' composition
  plain       the comparator: a plain-PyTorch Llama decode step (torch.compile'd layer,
              SDPA over a static cache), the whole step captured in one CUDA graph

Prints each part as it finishes, a table last, and writes $OUT/gpu_latency.json.

    python benchmarks/gpu_latency.py [--parts floor,latency,...] [--budgets 512,256]
        [--prefill-budgets 512,1024,2048]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tllm import LLM, KvCacheConfig  # noqa: E402
from tllm.bench.offline import (LatencyConfig, ThroughputConfig, run_latency,  # noqa: E402
                                run_throughput)
from tllm.config import CudaGraphConfig  # noqa: E402
from tllm.scheduler.policy import SchedulingPolicy  # noqa: E402

from gpu_common import interval_union  # noqa: E402
from gpu_fastpath import (_profiler, _trace_events, copy_bandwidth, kernel_category,  # noqa: E402
                          short_kernel_name, weight_bytes)

MODEL, DTYPE = "dummy:llama-3.1-8b", torch.bfloat16
PARTS = ("floor", "latency", "compiled", "replay", "lm_head", "load", "plain")
OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
results: dict = {"meta": {"model": MODEL, "dtype": "bfloat16", "date": time.strftime("%F"),
                          "torch": torch.__version__}}


def log(message: str) -> None:
    print(f"[{time.strftime('%T')}] {message}", flush=True)


def save() -> None:
    if OUT is not None:
        (OUT / "gpu_latency.json").write_text(json.dumps(results, indent=1, default=str))


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def build(max_batch_size: int, max_seq_len: int, **kwargs) -> LLM:
    started = time.perf_counter()
    llm = LLM(MODEL, dtype="bfloat16", device="cuda", max_batch_size=max_batch_size,
              max_seq_len=max_seq_len, **kwargs)
    log(f"built {MODEL} (batch {max_batch_size}, {kwargs or 'defaults'}) in "
        f"{time.perf_counter() - started:.0f} s")
    return llm


# ---- parts ----

def part_floor() -> dict:
    bandwidth = copy_bandwidth(torch.device("cuda"), 4 << 30)
    weights, embedding = weight_bytes(MODEL, DTYPE)
    return {"copy_bw_gbs": bandwidth / 1e9, "weight_bytes": weights,
            "floor_tok_s": bandwidth / weights,
            "floor_tok_s_without_input_embedding": bandwidth / (weights - embedding)}


def batch1_latency(llm: LLM) -> dict:
    config = LatencyConfig(isl=128, osl=256, batch_size=1, iterations=3, warmup=1)
    result = run_latency(llm, config)
    return {k: result[k] for k in ("output_tokens_per_s", "tpot_ms", "ttft_ms", "itl_ms",
                                   "latency_s")}


def part_latency() -> dict:
    with build(1, 384) as llm:
        result = batch1_latency(llm)
        result["replay"] = profile_replay(llm)
    return result


def part_compiled() -> dict:
    started = time.perf_counter()
    graphs = CudaGraphConfig(batch_sizes=[1], torch_compile=True)
    with build(1, 384, cuda_graph_config=graphs) as llm:
        build_s = time.perf_counter() - started
        if llm._engine.executor.runner.cuda_graphs is None:
            return {"error": "capture from the compiled model failed: graphs off"}
        return {**batch1_latency(llm), "build_s_with_compile": build_s}


def profile_replay(llm: LLM, num_replays: int = 30, context: int = 256) -> dict:
    """Replays of the batch-1 decode graph as one request `context` tokens in would run it
    (block table of block 0, no KV write: slot -1)."""
    graphs = llm._engine.executor.runner.cuda_graphs
    graph = graphs.graphs[1][0]
    graphs.seq_lens[:1].fill_(context)
    graphs.slot_mapping[:1].fill_(-1)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(num_replays):
        graph.replay()
    end.record()
    end.synchronize()
    replay_ms = start.elapsed_time(end) / num_replays
    with _profiler(torch.device("cuda")) as prof:
        for _ in range(num_replays):
            graph.replay()
        torch.cuda.synchronize()
    graphs.seq_lens.zero_()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "replay_trace.json"
        prof.export_chrome_trace(str(path))
        if OUT is not None:
            (OUT / "replay_b1_trace.json").write_bytes(path.read_bytes())
        events = _trace_events(path)
    return {"replay_ms_unprofiled": replay_ms, "context_tokens": context,
            **summarize_replays(events, num_replays)}


def summarize_replays(events: list[dict], num_replays: int, top: int = 12) -> dict:
    kernels = sorted((e for e in events if e.get("ph") == "X"
                      and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: float(e["ts"]))
    if not kernels:
        return {"error": "no kernels in the trace"}
    per_replay = len(kernels) / num_replays
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in kernels]
    busy_us = interval_union(spans)
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:]) if b[0] > a[1]]
    per_name: dict[str, list[float]] = {}
    for e in kernels:
        per_name.setdefault(e["name"], []).append(float(e.get("dur", 0)))
    ranked = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    categories: dict[str, float] = {}
    for name, durations in per_name.items():
        category = kernel_category(name)
        categories[category] = categories.get(category, 0.0) + sum(durations) / num_replays
    span_us = spans[-1][1] - spans[0][0]
    return {"kernels_per_replay": per_replay, "span_ms_per_replay": span_us / num_replays / 1e3,
            "busy_ms_per_replay": busy_us / num_replays / 1e3,
            "gap_ms_per_replay": (span_us - busy_us) / num_replays / 1e3,
            "median_gap_us": statistics.median(gaps) if gaps else 0.0,
            "category_ms_per_replay": {k: v / 1e3 for k, v in categories.items()},
            "top_kernels": [{"name": short_kernel_name(n)[:70], "calls": len(d) / num_replays,
                             "us_per_replay": sum(d) / num_replays,
                             "us_per_call": sum(d) / len(d)} for n, d in ranked]}


def part_lm_head() -> dict:
    from tllm.kernels.triton.lm_head_argmax import lm_head_argmax
    vocab, hidden_size = 128256, 4096
    weight = torch.randn(vocab, hidden_size, device="cuda", dtype=DTYPE) / 64
    hidden = torch.randn(1, hidden_size, device="cuda", dtype=DTYPE)
    unfused = lambda: torch.argmax(hidden @ weight.T, dim=-1)  # noqa: E731
    assert torch.equal(lm_head_argmax(hidden, weight), unfused()), "fused argmax differs"
    result = {"weight_bytes": weight.numel() * 2}
    for name, fn in (("cublas_gemv_plus_argmax", unfused),
                     ("fused_lm_head_argmax", lambda: lm_head_argmax(hidden, weight))):
        us = time_graphed(fn)
        result[name] = {"us": us, "gbs": weight.numel() * 2 / us / 1e3}
    for block_v in (32, 128):
        result[f"fused_block_v{block_v}_us"] = time_graphed(
            lambda: lm_head_argmax(hidden, weight, block_v=block_v))
    return result


def time_graphed(fn, repeats: int = 50) -> float:
    """Microseconds per call of fn captured in a CUDA graph (launch cost out)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def part_load(budgets: list[int], prefill_budgets: list[int]) -> dict:
    """One engine, the policy switched between runs while it is idle (the scheduler reads
    it every step), so every run shares the build and its CUDA graphs. Each run also records
    its steps' composition (benchmarks/step_composition.py): mean running batch, mixed vs
    pure decode steps (eager vs graphed) and the median interval between steps of each."""
    from step_composition import StepRecorder, running_curve, summarize
    config = ThroughputConfig(isl=128, osl=128, num_requests=1000, warmup=256)
    policies = {"default": SchedulingPolicy()}
    policies.update({f"budget_{b}": SchedulingPolicy(step_token_budget=b) for b in budgets})
    policies.update({f"prefill_{b}": SchedulingPolicy(prefill_token_budget=b)
                     for b in prefill_budgets})
    policies.update({f"prefill_{b}_every_step": SchedulingPolicy(
        prefill_token_budget=b, admit_whole_chunks=False) for b in prefill_budgets[:1]})
    out = {}
    with build(256, 256, kv_cache_config=KvCacheConfig(tokens_per_block=32)) as llm:
        scheduler = llm._engine.executor.scheduler
        recorder = StepRecorder(scheduler)
        for name, policy in policies.items():
            scheduler.policy = policy
            run = run_throughput(llm, config)
            steps = recorder.take()[-run["engine_steps"]:]  # the timed run's, not warm-up's
            composition = {**summarize(steps), "running_every_32": running_curve(steps, 32)}
            log(f"{name} steps: {json.dumps(composition)}")
            itl = run["itl_ms"]
            out[name] = {"output_tok_s": run["output_tokens_per_s"], "itl_ms": itl,
                         "ttft_ms": run["ttft_ms"], "tpot_ms": run["tpot_ms"],
                         "itl_p99_over_p50": itl["p99"] / itl["p50"] if itl.get("p50") else None,
                         "engine_steps": run["engine_steps"],
                         "num_completed": run["num_completed"], "steps": composition}
            log(f"{name}: {run['output_tokens_per_s']:.0f} tok/s, ITL p50 {itl['p50']:.2f} "
                f"p99 {itl['p99']:.2f} ms")
    return out


def part_plain() -> dict:
    from plain_decode import PlainLlamaDecode
    decode = PlainLlamaDecode(max_seq_len=384)
    per_step_ms = decode.time_steps(prompt_len=128, num_steps=256)
    del decode
    return {"ms_per_step": per_step_ms, "tok_s": 1e3 / per_step_ms,
            "what": "embedding, 32 x (F.rms_norm, fused QKV matmul, RoPE, static-cache "
                    "index_copy_ + SDPA, o_proj, gate_up matmul, silu*mul, down), final norm, "
                    "LM head, argmax; each layer torch.compile'd (one trace shared), the "
                    "whole step in one CUDA graph; ISL 128 then 256 steps"}


# ---- the table ----

def summary() -> str:
    lines = [" issue 21: H200, dummy:llama-3.1-8b bf16 ".center(78, "=")]
    floor = results.get("floor", {}).get("floor_tok_s")
    if floor:
        lines.append(f"copy bandwidth {results['floor']['copy_bw_gbs']:.0f} GB/s -> floor "
                     f"{floor:.1f} tok/s ({results['floor']['floor_tok_s_without_input_embedding']:.1f}"
                     " without the input embedding)")
    for name in ("latency", "compiled", "plain"):
        r = results.get(name, {})
        tok_s = r.get("output_tokens_per_s", r.get("tok_s"))
        if tok_s:
            share = f" = {tok_s / floor:.0%} of floor" if floor else ""
            lines.append(f"batch 1 128/256 {name:<9} {tok_s:8.1f} tok/s{share} (goal 245)")
    replay = results.get("latency", {}).get("replay", {})
    if "span_ms_per_replay" in replay:
        lines.append(f"graph replay: {replay['replay_ms_unprofiled']:.3f} ms, busy "
                     f"{replay['busy_ms_per_replay']:.3f}, gaps {replay['gap_ms_per_replay']:.3f}"
                     f" ms, {replay['kernels_per_replay']:.0f} kernels")
    head = results.get("lm_head", {})
    if "fused_lm_head_argmax" in head:
        lines.append(f"LM head + argmax M=1: cuBLAS+argmax "
                     f"{head['cublas_gemv_plus_argmax']['us']:.1f} us, fused "
                     f"{head['fused_lm_head_argmax']['us']:.1f} us")
    for name, r in (results.get("load") or {}).items():
        if isinstance(r, dict) and "output_tok_s" in r:
            lines.append(f"128/128 x1000 {name:<11} {r['output_tok_s']:8.0f} tok/s  ITL p50 "
                         f"{r['itl_ms']['p50']:.2f} p99 {r['itl_ms']['p99']:.2f} ms "
                         f"(p99/p50 {r['itl_p99_over_p50']:.1f}; goal 16000, <= 3)")
            steps = r.get("steps", {})
            if steps.get("num_steps"):
                gap = steps["median_interval_ms"]
                lines.append(f"    {steps['num_steps']} steps, running {steps['mean_running']:.0f}"
                             f", mixed {steps['steps_by_kind']['mixed']} / pure decode "
                             f"{steps['steps_by_kind']['pure_decode']}; step ms: mixed "
                             f"{_ms(gap['mixed'])}, pure decode {_ms(gap['pure_decode'])}")
    return "\n".join(lines + ["=" * 78])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--budgets", default="512,256", help="step_token_budget values")
    parser.add_argument("--prefill-budgets", default="512,1024,2048",
                        help="prefill_token_budget values (the first also without whole "
                             "chunks)")
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",") if b]
    prefill_budgets = [int(b) for b in args.prefill_budgets.split(",") if b]
    runs = {"floor": part_floor, "latency": part_latency, "compiled": part_compiled,
            "lm_head": part_lm_head, "load": lambda: part_load(budgets, prefill_budgets),
            "plain": part_plain}
    for name in args.parts.split(","):
        if name == "replay":
            continue  # measured inside `latency` (same engine)
        log(f"--- {name}")
        started = time.perf_counter()
        try:
            results[name] = runs[name]()
        except Exception as exc:  # one failed part must not cost the others
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        results[name]["part_s"] = time.perf_counter() - started
        log(f"--- {name} done in {results[name]['part_s']:.0f} s")
        print(json.dumps(results[name], indent=1, default=str)[:3000], flush=True)
        save()
        free()
    print(summary(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
