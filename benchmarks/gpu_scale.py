"""Issue 32's H200 figures in one device call, on dummy:llama-3.1-8b (random weights in the
real shapes), as a user runs `tllm bench` (the same LlmArgs defaults):

  gemm      the comparator: the dense GEMMs of one decode step (32 layers' qkv, o, gate_up,
            down and the LM head) at batch 256/512/1024, BF16 (torch.matmul) and FP8
            (torch._scaled_mm, row-wise scales), replayed from a CUDA graph: the step's floor
  fp8       one FP8 + FP8 KV engine (max_batch_size 1024): batch-1 latency; pure decode
            (ISL 128 / OSL 64) TPOT at batch 256/512/1024, with each batch's host time per
            step and the GPU's idle fraction (torch.profiler); 128/128 at max load with the
            scheduler's max batch at 256, 512, 1024 (one engine: the cap is what changes);
            1000/1000, 128/2048 and 2048/128
  bf16      the same model in BF16: batch 1, TPOT at 256, 128/128 at max load

Each part prints as it goes and rewrites $OUT/gpu_scale.json; a table comes last.

    python benchmarks/gpu_scale.py [--parts gemm,fp8,bf16] [--requests 3000] [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tllm import LLM, KvCacheConfig  # noqa: E402
from tllm.bench.offline import (LatencyConfig, ThroughputConfig, run_latency,  # noqa: E402
                                run_throughput)

from gpu_common import interval_union  # noqa: E402
from gpu_fastpath import _profiler, _trace_events  # noqa: E402
from gpu_latency import time_graphed  # noqa: E402

MODEL = "dummy:llama-3.1-8b"
OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # (N, K) per layer, Llama-3.1-8B
LM_HEAD = (128256, 4096)
results: dict = {"meta": {"device": torch.cuda.get_device_name() if torch.cuda.is_available()
                          else "cpu", "torch": torch.__version__, "model": MODEL}}


def log(message: str) -> None:
    print(f"[{time.strftime('%T')}] {message}", flush=True)


def save() -> None:
    if OUT is not None:
        (OUT / "gpu_scale.json").write_text(json.dumps(results, indent=1, default=str))


# ---- the comparator: a decode step's GEMMs ----

def gemm_floor_ms(batch: int, fp8: bool) -> float:
    """One decode step's dense GEMMs (32 layers + LM head) at M = batch, from a graph."""
    device = torch.device("cuda")
    ops = []
    for n, k in [*SHAPES.values()] * 32 + [LM_HEAD]:
        x = torch.randn(batch, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        if fp8 and (n, k) != LM_HEAD:
            xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
            sx = torch.ones(batch, 1, device=device)
            sw = torch.ones(1, n, device=device)
            ops.append(lambda xq=xq, wq=wq, sx=sx, sw=sw: torch._scaled_mm(
                xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16))
        else:
            ops.append(lambda x=x, w=w: x @ w.t())
    return time_graphed(lambda: [op() for op in ops], repeats=10) / 1e3


def part_gemm() -> dict:
    out = {}
    for batch in (256, 512, 1024):
        for fp8 in (False, True):
            out[f"{'fp8' if fp8 else 'bf16'}_{batch}"] = ms = gemm_floor_ms(batch, fp8)
            log(f"GEMMs of a decode step, batch {batch} {'FP8' if fp8 else 'BF16'}: "
                f"{ms:.2f} ms")
            gc.collect()
            torch.cuda.empty_cache()
    return out


# ---- engines ----

def build(quantized: bool, max_batch_size: int = 1024) -> LLM:
    started = time.perf_counter()
    extra = dict(quantization="fp8", kv_cache_config=KvCacheConfig(dtype="fp8")) \
        if quantized else {}
    llm = LLM(MODEL, device="cuda", max_batch_size=max_batch_size, max_seq_len=2176, **extra)
    log(f"built {MODEL} {'FP8 + FP8 KV' if quantized else 'BF16'} (max batch "
        f"{max_batch_size}) in {time.perf_counter() - started:.0f} s; KV "
        f"{llm.get_stats()['kv_capacity_tokens']} tokens")
    return llm


def latency(llm: LLM, batch: int, isl: int = 128, osl: int = 64,
            iterations: int = 3) -> dict:
    run = run_latency(llm, LatencyConfig(isl=isl, osl=osl, batch_size=batch,
                                         iterations=iterations, warmup=1))
    out = {k: run[k] for k in ("output_tokens_per_s", "tpot_ms", "ttft_ms", "latency_s")}
    log(f"latency batch {batch} ISL {isl} OSL {osl}: TPOT {out['tpot_ms']} ms, "
        f"{out['output_tokens_per_s']:.1f} tok/s")
    return out


def step_profile(llm: LLM, batch: int, num_steps: int = 24) -> dict:
    """Host time per decode step (the loop thread's wall time outside waits for the device
    is not separable here: the launch phase's wall time) and the GPU's idle fraction over
    `num_steps` steady decode steps of `batch` requests (torch.profiler: union of kernels
    over the window's span)."""
    from tllm.bench.offline import exact_length_params, synthetic_prompts
    executor = llm._engine.executor
    launches: list[float] = []
    real = executor._launch

    def timed(step_batch):
        started = time.perf_counter()
        real(step_batch)
        launches.append(time.perf_counter() - started)
    g = torch.Generator().manual_seed(batch)
    prompts = synthetic_prompts(batch, 128, int(llm._engine.config.vocab_size), g)
    params = exact_length_params(num_steps + 40)
    executor._launch = timed
    trace = Path("/tmp") / f"scale_profile_{batch}.json"
    try:
        first = executor.num_steps
        results_async = [llm.generate_async(p, params) for p in prompts]
        # past the prefill (batch x 128 tokens, max_num_tokens a step), into steady decode
        prefill_steps = -(-batch * 128 // llm.args.max_num_tokens)
        while executor.num_steps < first + prefill_steps + 6:
            time.sleep(0.002)
        with _profiler(torch.device("cuda")) as prof:
            start_steps, wall = executor.num_steps, time.perf_counter()
            while executor.num_steps < start_steps + num_steps:
                time.sleep(0.002)
            wall = time.perf_counter() - wall
            steps = executor.num_steps - start_steps
        for r in results_async:
            r.result()
    finally:
        executor._launch = real
    prof.export_chrome_trace(str(trace))
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in _trace_events(trace)
               if e.get("cat") == "kernel"]
    span = (max(b for _, b in kernels) - min(a for a, _ in kernels)) if kernels else 0.0
    busy = interval_union(kernels)
    decode_launches = sorted(launches)[len(launches) // 4: -len(launches) // 4 or None]
    out = {"step_ms": wall / steps * 1e3, "launch_host_ms_median":
           statistics.median(decode_launches) * 1e3 if decode_launches else None,
           "gpu_idle_fraction": 1 - busy / span if span else None}
    log(f"decode steps at batch {batch}: {out['step_ms']:.2f} ms a step, launch (host) "
        f"{out['launch_host_ms_median']:.2f} ms, GPU idle {out['gpu_idle_fraction']:.1%}")
    return out


def throughput(llm: LLM, isl: int, osl: int, requests: int, time_limit: float,
               warmup: int = 64) -> dict:
    run = run_throughput(llm, ThroughputConfig(isl=isl, osl=osl, num_requests=requests,
                                               warmup=warmup, time_limit_s=time_limit))
    itl = run["itl_ms"]
    out = {"output_tok_s": run["output_tokens_per_s"], "itl_ms": itl, "tpot_ms": run["tpot_ms"],
           "ttft_ms": run["ttft_ms"], "num_completed": run["num_completed"],
           "truncated": run.get("is_truncated"),
           "itl_p99_over_p50": itl["p99"] / itl["p50"] if itl.get("p50") else None}
    log(f"{isl}/{osl} x {requests}: {out['output_tok_s']:.0f} tok/s, ITL p50 "
        f"{itl.get('p50')} p99 {itl.get('p99')} ms, completed {out['num_completed']}")
    return out


def part_engine(quantized: bool, args) -> dict:
    out: dict = {}
    name = "fp8" if quantized else "bf16"
    results[name] = out
    with build(quantized) as llm:
        out["batch1"] = latency(llm, 1, osl=256)
        save()
        for batch in ((256, 512, 1024) if quantized else (256,)):
            out[f"decode_{batch}"] = latency(llm, batch, iterations=2)
            out[f"profile_{batch}"] = step_profile(llm, batch)
            save()
        scheduler = llm._engine.executor.scheduler
        for cap in ((256, 512, 1024) if quantized else (512,)):
            scheduler.max_batch_size = cap  # as an engine built with this cap schedules
            out[f"load_128_128_batch{cap}"] = throughput(llm, 128, 128, args.requests, 100)
            save()
        if quantized:  # at 1,024 under the default policy, prompts arrive in waves (the
            # ITL p99 of 443 ms on 2026-12-06): the same with a prefill budget per step
            # (decodes first, then at most this many prompt tokens; 2 x cap x ISL / OSL)
            default_policy = scheduler.policy
            scheduler.policy = dataclasses.replace(default_policy, prefill_token_budget=2048)
            out["load_128_128_batch1024_prefill2048"] = throughput(llm, 128, 128,
                                                                   args.requests, 100)
            scheduler.policy = default_policy
            save()
        scheduler.max_batch_size = 1024
        if quantized and not args.quick:
            out["load_1000_1000"] = throughput(llm, 1000, 1000, 500, 100)
            save()
            out["load_128_2048"] = throughput(llm, 128, 2048, 300, 100)
            save()
            out["load_2048_128"] = throughput(llm, 2048, 128, 600, 100)
            save()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


def summary() -> str:
    lines = [f" issue 32: {results['meta']['device']}, dummy:llama-3.1-8b ".center(78, "=")]
    for name in ("fp8", "bf16"):
        part = results.get(name) or {}
        for key, value in part.items():
            if key.startswith("load"):
                lines.append(f"{name} {key}: {value['output_tok_s']:.0f} tok/s, ITL p50/p99 "
                             f"{value['itl_ms'].get('p50')}/{value['itl_ms'].get('p99')} ms")
            elif key.startswith(("decode", "batch1")):
                lines.append(f"{name} {key}: TPOT {value['tpot_ms']} ms, "
                             f"{value['output_tokens_per_s']:.1f} tok/s")
            elif key.startswith("profile"):
                lines.append(f"{name} {key}: step {value['step_ms']:.2f} ms, host launch "
                             f"{value['launch_host_ms_median']:.2f} ms, GPU idle "
                             f"{value['gpu_idle_fraction']:.1%}")
    for key, ms in (results.get("gemm") or {}).items():
        lines.append(f"GEMM floor {key}: {ms:.2f} ms")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="gemm,fp8,bf16")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--quick", action="store_true", help="no long-sequence runs")
    args = parser.parse_args()
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("tllm").setLevel(logging.INFO)
    for part in args.parts.split(","):
        try:
            if part == "gemm":
                results["gemm"] = part_gemm()
            elif part == "smoke":  # the engines build and serve a few requests
                for quantized in (True, False):
                    with build(quantized) as llm:
                        results[f"smoke_{quantized}"] = throughput(llm, 128, 32, 64, 60, 4)
                    del llm
                    gc.collect()
                    torch.cuda.empty_cache()
            else:
                part_engine(part == "fp8", args)
        except Exception as exc:
            traceback.print_exc()
            results.setdefault("errors", {})[part] = repr(exc)
        save()
    print(summary(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
