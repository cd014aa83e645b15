"""Issue 15's figures in one device call: FP8 (W8A8 linears, FP8 KV cache) against BF16 on
dummy:llama-3.1-8b, and the FP8 GEMMs against bf16 and cuBLASLt, on one H200.

  tests   the GPU kernel tests first (pytest with real CUDA: the FP8 kernels, their dispatch,
          the attention kernels with fp8 caches); the run stops if one fails
  micro   GEMMs on the Llama-3.1-8B shapes (qkv 6144x4096, o 4096x4096, gate_up 28672x4096,
          down 4096x14336) at M = 1, 8, 32, 256, 4096: bf16 torch.mm; the W8A16 small-M kernel
          (M <= SMALL_M); torch._scaled_mm row-wise on pre-quantized input; the FP8 dispatch
          as a layer calls it (activation quantization included); the Triton W8A8 GEMM. Time
          per call from CUDA graphs of back-to-back calls cycling over weight copies that do
          not fit in L2; TB/s (weight + input + output bytes) and TFLOP/s. Comparators in the
          same run: 8192^3 FP8 _scaled_mm (row-wise and per-tensor), 8192^3 bf16 mm, and the
          device-to-device copy bandwidth. Plus a sweep of the W8A16 tile configurations at
          M = 1 (the default's time next to the best).
  bf16    the engine, BF16: `tllm bench`'s code path (tllm/bench/offline.py) on one engine
          (max_batch_size 256): latency batch 1 ISL 128 / OSL 256; throughput ISL 128 / OSL
          128 x 1000 requests at max load; ISL 1000 / OSL 1000 x as many requests (up to
          1000) as the time left allows (the count is printed and recorded)
  fp8     the same with quantization="fp8" and KvCacheConfig(dtype="fp8"), the same
          1000/1000 request count, plus a decode-step profile at batch 1 and 256 (GPU time
          per step in GEMM, attention, FP8 quantization, norms/activations, the rest)
  fp8big  (not run by default) 128/128 x 1000 with FP8 at --big-batch-size (CUDA graphs up
          to it)

Each section has a time budget and its own try/except; the figures go to
$OUT/gpu_fp8.json as they come (the log to $OUT/gpu_fp8.log); a compact table comes last.

    python benchmarks/gpu_fp8.py [--budget 510] [--sections tests,micro,bf16,fp8]
    python benchmarks/gpu_fp8.py --cpu-smoke     # the plumbing on a CPU: tiny model, shapes
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from gpu_common import Tee, interval_union, round_up, start_watchdog  # noqa: E402
from tllm.bench.offline_cli import no_nan  # noqa: E402

SECTIONS = ("tests", "micro", "bf16", "fp8", "fp8big", "bf16big")
DEFAULT_SECTIONS = ("tests", "micro", "bf16", "fp8")
GPU_TESTS = ["tests/kernels/test_fp8_quant.py", "tests/kernels/test_fp8_gemm.py",
             "tests/kernels/test_fp8_fused.py", "tests/kernels/test_fp8_attention_backend.py",
             "tests/kernels/test_fp8_integration.py", "tests/kernels/test_kv_cache_write.py",
             "tests/kernels/test_decode_attention.py", "tests/kernels/test_context_attention.py",
             "tests/kernels/test_norm_activation_kernels.py",
             "tests/attention/test_triton_backend.py", "tests/attention/test_triton_engine.py"]
SMOKE_TESTS = ["tests/kernels/test_fp8_quant.py"]
BYTES_CONVENTION = ("TB/s = (weight bytes + input activation bytes as handed to the op + "
                    "output bytes) / time per call; TFLOP/s = 2 M N K / time per call; each "
                    "call's weight is a different copy, the copies together > 3x L2")
_RESERVE_S = 15.0


@dataclass(frozen=True)
class Plan:
    model: str
    dtype: str
    device: str
    max_batch_size: int = 256
    latency_shape: tuple[int, int] = (128, 256)
    throughput_shape: tuple[int, int] = (128, 128)
    throughput_requests: int = 1000
    long_shape: tuple[int, int] = (1000, 1000)
    long_requests: int = 1000
    big_batch_size: int = 512
    profile_batches: tuple[int, ...] = (1, 256)
    profile_osls: tuple[int, int] = (8, 40)
    micro_ms: tuple[int, ...] = (1, 8, 32, 256, 4096)
    micro_shapes: tuple[tuple[str, int, int], ...] = (
        ("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
    comparator_size: int = 8192
    copy_bytes: int = 2 << 30
    l2_bytes: int = 50 << 20   # H200: weight copies of a GEMM together exceed 3x this
    tests: tuple[str, ...] = tuple(GPU_TESTS)
    # goals of issue 15 (H200): output tok/s, and the FP8 / BF16 batch-1 ratio
    goal_throughput: float | None = 29000.0
    goal_long: float | None = 18500.0
    goal_latency_ratio: float | None = 1.7
    # seconds per section at --budget 510 (scaled with it); the engines share what is left
    caps: tuple[tuple[str, float], ...] = (("tests", 150), ("micro", 75))


FULL = Plan(model="dummy:llama-3.1-8b", dtype="bfloat16", device="cuda")
SMOKE = Plan(model="", dtype="float32", device="cpu", max_batch_size=8, latency_shape=(8, 8),
             throughput_shape=(8, 8), throughput_requests=16, long_shape=(16, 16),
             long_requests=12, big_batch_size=8, profile_batches=(1, 4), profile_osls=(2, 4),
             micro_ms=(1, 8, 48), micro_shapes=(("qkv", 96, 64), ("down", 64, 128)),
             comparator_size=128, copy_bytes=16 << 20, l2_bytes=0, tests=tuple(SMOKE_TESTS),
             goal_throughput=None, goal_long=None, goal_latency_ratio=None)
DEFAULT_BUDGET = 510.0


class Session:
    """Time budget, results, and the JSON under $OUT."""

    def __init__(self, plan: Plan, budget_s: float, out_dir: Path | None) -> None:
        self.plan = plan
        self.start = time.perf_counter()
        self.end = self.start + budget_s
        self.scale = budget_s / DEFAULT_BUDGET
        self.out_dir = out_dir
        self.results: dict = {"meta": _meta(plan, budget_s)}

    def remaining(self) -> float:
        return self.end - _RESERVE_S - time.perf_counter()

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f} s] {message}", flush=True)

    def run(self, name: str, fn, budget: float, *args) -> dict:
        """fn(session, deadline, *args) -> dict, inside its budget; an exception is recorded
        and printed, and the next section runs."""
        budget = min(budget, self.remaining())
        if budget < 5.0:
            self.log(f"--- {name}: skipped, {self.remaining():.0f} s left of the budget")
            result = {"skipped": "out of time"}
        else:
            self.log(f"--- {name} (budget {budget:.0f} s)")
            started = time.perf_counter()
            try:
                result = fn(self, time.perf_counter() + budget, *args)
            except Exception as exc:  # one failed section must not cost the others
                traceback.print_exc()
                sys.stderr.flush()
                result = {"error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()}
            result["section_s"] = time.perf_counter() - started
            self.log(f"--- {name} done in {result['section_s']:.1f} s")
        self.results[name] = result
        self.save()
        return result

    def cap(self, name: str) -> float:
        return dict(self.plan.caps)[name] * self.scale

    def save(self) -> None:
        if self.out_dir is not None:
            (self.out_dir / "gpu_fp8.json").write_text(json.dumps(no_nan(self.results),
                                                                  indent=1, default=str))


# ---- tests ----

def section_tests(session: Session, deadline: float) -> dict:
    """pytest over the kernel tests, in parallel workers when pytest-xdist is there (Triton
    compiles each kernel variant once per process: workers spread the compiling)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *session.plan.tests]
    if session.plan.device == "cuda" and _has_module("xdist"):
        cmd += ["-n", "8"]
    timeout = max(10.0, deadline - time.perf_counter())
    session.log(" ".join(cmd[2:]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-4000:] if isinstance(exc.stdout, bytes) else \
            (exc.stdout or "")[-4000:]
        session.log(f"tests did not finish in {timeout:.0f} s: they are NOT verified; "
                    "going on")
        return {"timed_out": True, "passed": None, "tail": str(tail)}
    output = proc.stdout + proc.stderr
    summary = next((line for line in reversed(output.splitlines())
                    if re.search(r"\d+ (passed|failed|error)", line)), "")
    print("\n".join(output.splitlines()[-40:]) if proc.returncode else summary, flush=True)
    return {"returncode": proc.returncode, "passed": proc.returncode == 0, "summary": summary,
            "tail": output[-6000:], "command": " ".join(cmd)}


def _has_module(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


# ---- micro: GEMMs ----

def section_micro(session: Session, deadline: float) -> dict:
    import torch
    from tllm.kernels import fp8 as ref
    from tllm.kernels import fp8_ops
    from tllm.kernels.triton import fp8_gemm, fp8_quant
    plan = session.plan
    device = torch.device(plan.device)
    dtype = torch.bfloat16
    result = {"convention": BYTES_CONVENTION, "small_m_threshold": fp8_ops.SMALL_M,
              "comparators": comparators(session, device), "shapes": {}}
    for name, n, k in plan.micro_shapes:
        if time.perf_counter() > deadline - 10:
            result["shapes"][name] = {"skipped": "out of time"}
            continue
        w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        wq, ws = ref.quantize_per_channel(w)
        bf16_weights = _copies(w, 3 * plan.l2_bytes)
        fp8_weights = _copies(wq, 3 * plan.l2_bytes)
        del w
        shape = {"n": n, "k": k, "weight_copies": {"bf16": len(bf16_weights),
                                                   "fp8": len(fp8_weights)},
                 "by_m": {}}
        for m in plan.micro_ms:
            x = torch.randn(m, k, device=device, dtype=dtype)
            xq, xs = fp8_quant.quantize_per_token(x)
            ws_row = ws.reshape(1, -1).contiguous()
            ops = {"bf16_mm": ([lambda w=w: torch.mm(x, w.t()) for w in bf16_weights],
                               n * k * 2 + m * k * 2 + m * n * 2),
                   "scaled_mm": ([lambda w=w: torch._scaled_mm(
                       xq, w.t(), scale_a=xs, scale_b=ws_row, out_dtype=dtype)
                       for w in fp8_weights], n * k + m * k + m * n * 2 + m * 4),
                   "fp8_dispatch": ([lambda w=w: fp8_ops.fp8_linear(x, w, ws)
                                     for w in fp8_weights], n * k + m * k * 2 + m * n * 2)}
            if m <= fp8_ops.SMALL_M:
                ops["w8a16"] = ([lambda w=w: fp8_gemm.w8a16_mm(x, w, ws) for w in fp8_weights],
                                n * k + m * k * 2 + m * n * 2)
            else:
                ops["triton_w8a8"] = ([lambda w=w: fp8_gemm.fp8_mm(xq, xs, w, ws, dtype)
                                       for w in fp8_weights], n * k + m * k + m * n * 2)
            row = {"path": fp8_ops.gemm_path(x, n, k)}
            for op, (fns, nbytes) in ops.items():
                try:
                    us, how = time_calls(fns, device)
                except Exception as exc:
                    row[op] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    continue
                row[op] = {"us": us, "tb_s": nbytes / us / 1e6,
                           "tflop_s": 2 * m * n * k / us / 1e6, "timing": how}
            shape["by_m"][m] = row
            session.log(f"{name} {n}x{k} M={m}: " + ", ".join(
                f"{op} {v['us']:.1f} us" if "us" in v else f"{op} ERROR"
                for op, v in row.items() if isinstance(v, dict)))
            del x, xq, xs
        if time.perf_counter() < deadline - 15:
            shape["w8a16_sweep_m1"] = sweep_small_m(fp8_gemm, fp8_weights, ws, k, device,
                                                    deadline)
            sweep = shape["w8a16_sweep_m1"]
            if sweep.get("best"):
                session.log(f"{name} W8A16 M=1 sweep: default {_fmt(sweep.get('default_us'), 1)}"
                            f" us, best {sweep['best']['us']:.1f} us with "
                            f"{sweep['best']['config']}")
        result["shapes"][name] = shape
        del bf16_weights, fp8_weights
        _free_memory()
    print(format_micro(result), flush=True)
    return result


def comparators(session: Session, device) -> dict:
    import torch
    size = session.plan.comparator_size
    out = {"copy_tb_s": copy_bandwidth(device, session.plan.copy_bytes) / 1e12}
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    flop = 2 * size ** 3
    for name, fn in (("bf16_mm", lambda: torch.mm(a, b.t())),):
        out[f"{name}_{size}_tflop_s"] = flop / time_calls([fn], device, min_calls=5)[0] / 1e6
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    rows = torch.ones(size, 1, device=device)
    one = torch.ones((), device=device)
    for name, sa, sb in (("fp8_scaled_mm_rowwise", rows, rows.t().contiguous()),
                         ("fp8_scaled_mm_tensorwise", one, one)):
        try:
            fn = (lambda sa=sa, sb=sb: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb,
                                                         out_dtype=torch.bfloat16))
            out[f"{name}_{size}_tflop_s"] = flop / time_calls([fn], device, min_calls=5)[0] / 1e6
        except Exception as exc:
            out[f"{name}_{size}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    session.log("comparators: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else
                                            f"{k} {v}" for k, v in out.items()))
    return out


def sweep_small_m(fp8_gemm, weights, ws, k: int, device, deadline: float) -> dict:
    """The W8A16 kernels' tile configurations at M = 1 (GEMV or tl.dot; block_n, block_k,
    split_k, warps, stages): the default's time and the best."""
    import torch
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    n = weights[0].shape[0]
    default = fp8_gemm.small_m_config(1, n, k, device)
    # block_m 1: the GEMV kernel; 16: the tl.dot kernel with its padded rows
    configs = [default] + [fp8_gemm.SmallMConfig(bm, bn, bk, split, warps, stages)
                           for bm, bn, bk, split, warps, stages in (
                               (1, 16, 512, 1, 4, 4), (1, 32, 256, 1, 4, 4),
                               (1, 64, 128, 1, 4, 4), (1, 16, 256, 1, 4, 6),
                               (1, 32, 128, 1, 4, 6), (1, 16, 512, 2, 4, 4),
                               (1, 16, 512, 1, 8, 3), (1, 64, 256, 1, 8, 3),
                               (16, 16, 256, 1, 4, 4), (16, 16, 512, 1, 4, 3),
                               (16, 32, 256, 1, 4, 4), (16, 64, 256, 1, 4, 4),
                               (16, 64, 128, 1, 4, 6), (16, 32, 256, 2, 4, 4))]
    runs = []
    for cfg in dict.fromkeys(configs):  # the default may repeat one of the list
        if time.perf_counter() > deadline - 5:
            break
        try:
            us, _ = time_calls([lambda w=w, cfg=cfg: fp8_gemm.w8a16_mm(x, w, ws, config=cfg)
                                for w in weights], device)
        except Exception as exc:
            runs.append({"config": _cfg_text(cfg),
                         "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        runs.append({"config": _cfg_text(cfg), "us": us,
                     "tb_s": (n * k + 2 * k + 2 * n) / us / 1e6})
    timed = [r for r in runs if "us" in r]
    out = {"default": _cfg_text(default), "runs": runs}
    if timed:
        out["default_us"] = timed[0]["us"] if timed[0]["config"] == _cfg_text(default) else None
        out["best"] = min(timed, key=lambda r: r["us"])
    return out


def _cfg_text(cfg) -> str:
    return (f"{'gemv' if cfg.block_m == 1 else 'dot'} block_n={cfg.block_n} "
            f"block_k={cfg.block_k} split_k={cfg.split_k} warps={cfg.num_warps} "
            f"stages={cfg.num_stages}")


def _copies(t, min_total_bytes: int) -> list:
    count = max(2, math.ceil(min_total_bytes / (t.numel() * t.element_size())))
    return [t] + [t.clone() for _ in range(count - 1)]


def time_calls(fns: list, device, min_calls: int = 20) -> tuple[float, str]:
    """Microseconds per call of fns (cycled), measured on CUDA as replays of a CUDA graph of
    back-to-back calls (no launch gaps), else as a timed loop."""
    import torch
    for fn in fns:  # compile, autotune, allocate
        fn()
    calls = max(min_calls, len(fns))
    sequence = [fns[i % len(fns)] for i in range(calls)]
    if device.type != "cuda":
        started = time.perf_counter()
        for fn in sequence:
            fn()
        return (time.perf_counter() - started) / calls * 1e6, "loop"
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in sequence:
                fn()
        replay, how = graph.replay, "cuda graph"
    except Exception:
        graph = None
        torch.cuda.synchronize()

        def replay():
            for fn in sequence:
                fn()
        how = "eager loop (graph capture failed)"
    replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times), how


def copy_bandwidth(device, nbytes: int) -> float:
    """(bytes read + bytes written) per second of a large device-to-device copy, median."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    us, _ = time_calls([lambda: dst.copy_(src)], device, min_calls=10)
    return 2 * nbytes / (us * 1e-6)


def format_micro(result: dict) -> str:
    ops = ("bf16_mm", "w8a16", "scaled_mm", "fp8_dispatch", "triton_w8a8")
    lines = [" GEMMs: us per call (TB/s for M <= 32, TFLOP/s above) ".center(104, "="),
             f"{'shape':<18}{'M':>5}  " + "".join(f"{op:>16}" for op in ops) + "  dispatch"]
    for name, shape in result["shapes"].items():
        if "by_m" not in shape:
            lines.append(f"{name:<18} {shape}")
            continue
        label = f"{name} {shape['n']}x{shape['k']}"
        for m, row in shape["by_m"].items():
            lines.append(f"{label:<18}{m:>5}  " + "".join(_micro_cell(row.get(op), int(m))
                                                         for op in ops)
                         + f"  {row.get('path', '')}")
    comp = result.get("comparators", {})
    lines.append("comparators: " + ", ".join(f"{k} {v:.2f}" for k, v in comp.items()
                                             if isinstance(v, float)))
    return "\n".join(lines + ["=" * 104])


def _micro_cell(v: dict | None, m: int) -> str:
    if v is None:
        return f"{'-':>16}"
    if "us" not in v:
        return f"{'ERROR':>16}"
    rate = v["tb_s"] if m <= 32 else v["tflop_s"]
    return f"{v['us']:.1f} ({rate:.2f})".rjust(16)


# ---- engines ----

def engine_kwargs(session: Session, fp8: bool, max_batch_size: int | None = None) -> dict:
    from tllm import CudaGraphConfig, KvCacheConfig
    plan = session.plan
    batch = max_batch_size or plan.max_batch_size
    longest = max(sum(plan.latency_shape), sum(plan.throughput_shape), sum(plan.long_shape))
    kwargs = {"dtype": plan.dtype, "device": plan.device, "max_batch_size": batch,
              "max_seq_len": round_up(longest, 32)}
    if fp8:
        kwargs.update(quantization="fp8", kv_cache_config=KvCacheConfig(dtype="fp8"))
    if batch > 256:  # CUDA graphs up to the batch (the default list stops at 256)
        sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
        sizes += list(range(320, batch + 1, 64))
        kwargs["cuda_graph_config"] = CudaGraphConfig(batch_sizes=sizes, max_batch_size=batch)
    return kwargs


def section_engine(session: Session, deadline: float, fp8: bool) -> dict:
    """One engine; latency, 128/128, (FP8: the profile), then 1000/1000 with what is left."""
    from tllm import LLM
    plan = session.plan
    kwargs = engine_kwargs(session, fp8)
    result: dict = {"llm_kwargs": {k: str(v) for k, v in kwargs.items()}}
    session.results["fp8" if fp8 else "bf16"] = result  # in progress: part_long reads it
    started = time.perf_counter()
    llm = LLM(plan.model, **kwargs)
    result["build_s"] = time.perf_counter() - started
    session.log(f"built {plan.model} ({'FP8 + FP8 KV' if fp8 else plan.dtype}) in "
                f"{result['build_s']:.1f} s")
    with llm:
        result["engine"] = _engine_facts(llm)
        parts = [("latency", part_latency, 25.0), ("throughput", part_throughput, 60.0)]
        if fp8:
            parts.append(("profile", part_profile, 45.0))
        for name, fn, cap in parts:
            left = deadline - time.perf_counter()
            if left < 10:
                result[name] = {"skipped": "out of time"}
                continue
            result[name] = _guarded(session, name, fn, llm,
                                    time.perf_counter() + min(cap * session.scale, left - 5))
            session.save()
        left = deadline - time.perf_counter()
        if left > 15:
            result["long"] = _guarded(session, "long", part_long, llm, deadline - 3, fp8)
        else:
            result["long"] = {"skipped": "out of time"}
    _free_memory()
    return result


def engine_budget(session: Session, name: str, sections: list[str]) -> float:
    """BF16's share of the time left when FP8 follows: each engine's fixed parts (build,
    latency, 128/128, FP8's profile: ~65 s and ~90 s) plus 1000/1000 runs of the same request
    count, FP8's assumed 1.4x faster."""
    left = session.remaining()
    if "fp8big" in sections:
        left -= 90 * session.scale
    if name == "fp8" or "fp8" not in sections:
        return left
    fixed_bf16, fixed_fp8 = 65 * session.scale, 90 * session.scale
    long_bf16 = max(0.0, left - fixed_bf16 - fixed_fp8) / (1 + 1 / 1.4)
    return min(left, fixed_bf16 + long_bf16)


def section_big_batch(session: Session, deadline: float, fp8: bool = True) -> dict:
    from tllm import LLM
    plan = session.plan
    kwargs = engine_kwargs(session, fp8, plan.big_batch_size)
    with LLM(plan.model, **kwargs) as llm:
        out = {"max_batch_size": plan.big_batch_size,
               "throughput": _guarded(session, "throughput", part_throughput, llm, deadline - 3,
                                      plan.big_batch_size)}
    _free_memory()
    return out


def _guarded(session: Session, name: str, fn, *args) -> dict:
    started = time.perf_counter()
    try:
        out = fn(session, *args)
    except Exception as exc:
        traceback.print_exc()
        sys.stderr.flush()
        out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    out["part_s"] = time.perf_counter() - started
    return out


def part_latency(session: Session, llm, deadline: float) -> dict:
    from tllm.bench.offline import LatencyConfig, run_latency
    isl, osl = session.plan.latency_shape
    config = LatencyConfig(isl=isl, osl=osl, batch_size=1, iterations=3, warmup=1,
                           time_limit_s=max(1.0, (deadline - time.perf_counter()) / 2))
    result = run_latency(llm, config)
    session.log(f"latency b1 {isl}/{osl}: {result['output_tokens_per_s']:.1f} tok/s, TPOT "
                f"{result['tpot_ms']:.2f} ms, TTFT {result['ttft_ms']:.1f} ms")
    return result


def part_throughput(session: Session, llm, deadline: float, warmup: int | None = None) -> dict:
    from tllm.bench.offline import ThroughputConfig, run_throughput
    isl, osl = session.plan.throughput_shape
    config = ThroughputConfig(isl=isl, osl=osl, num_requests=session.plan.throughput_requests,
                              warmup=warmup or session.plan.max_batch_size,
                              time_limit_s=max(1.0, deadline - time.perf_counter() - 8))
    result = run_throughput(llm, config)
    session.log(f"throughput {isl}/{osl} x {config.num_requests}: "
                f"{result['output_tokens_per_s']:,.0f} output tok/s "
                f"({result['num_completed']} completed"
                f"{', TRUNCATED by the time limit' if result['is_truncated'] else ''})")
    return result


def part_long(session: Session, llm, deadline: float, fp8: bool) -> dict:
    from tllm.bench.offline import ThroughputConfig, run_throughput
    isl, osl = session.plan.long_shape
    num, why = long_request_count(session, deadline, fp8)
    session.log(f"ISL {isl} / OSL {osl}: {num} requests ({why})")
    config = ThroughputConfig(isl=isl, osl=osl, num_requests=num, warmup=0,
                              time_limit_s=max(1.0, deadline - time.perf_counter()))
    result = run_throughput(llm, config)
    result["request_count_reason"] = why
    session.log(f"throughput {isl}/{osl} x {num}: {result['output_tokens_per_s']:,.0f} output "
                f"tok/s ({result['num_completed']} completed"
                f"{', TRUNCATED by the time limit' if result['is_truncated'] else ''})")
    return result


def long_request_count(session: Session, deadline: float, fp8: bool) -> tuple[int, str]:
    """Up to long_requests, as many as this engine's 128/128 rate says fit its time left
    (1000/1000 assumed at 0.55 of that rate, as measured for BF16 on 2026-11-29); FP8 takes
    BF16's count when there is one, so the two runs compare like for like."""
    plan = session.plan
    bf16_long = (session.results.get("bf16") or {}).get("long") or {}
    if fp8 and bf16_long.get("num_requests"):
        return bf16_long["num_requests"], "the BF16 run's count"
    current = session.results.get("fp8" if fp8 else "bf16") or {}
    rate = (current.get("throughput") or {}).get("output_tokens_per_s")
    if not rate:
        return plan.long_requests, "no 128/128 rate to size it from; the time limit guards it"
    rate_long = 0.55 * rate
    seconds = deadline - time.perf_counter() - 10
    per_request = plan.long_shape[1] / rate_long
    fit = int(0.85 * seconds / per_request)
    if fit >= plan.long_requests:
        return plan.long_requests, "as asked"
    num = max(min(plan.max_batch_size, plan.long_requests), fit)
    return num, (f"FEWER than the {plan.long_requests} asked: about {fit} fit the time left "
                 f"({seconds:.0f} s) at an assumed {rate_long:,.0f} tok/s")


def part_profile(session: Session, llm, deadline: float) -> dict:
    """Per decode step at each batch: the difference between two runs that differ only in
    OSL is pure decode steps; wall time unprofiled, GPU time by kernel category profiled."""
    out = {}
    for batch in session.plan.profile_batches:
        if batch > llm.args.max_batch_size or time.perf_counter() > deadline - 5:
            continue
        out[f"batch{batch}"] = profile_decode(session, llm, batch)
    return out


def profile_decode(session: Session, llm, batch: int) -> dict:
    import torch
    from tllm.bench.offline import exact_length_params, model_vocab_size, synthetic_prompts
    isl = session.plan.throughput_shape[0]
    short, long = session.plan.profile_osls
    generator = torch.Generator().manual_seed(7)
    cuda = session.plan.device == "cuda"

    def run(osl: int) -> float:
        prompts = synthetic_prompts(batch, isl, model_vocab_size(llm), generator)
        _sync(cuda)
        started = time.perf_counter()
        llm.generate(prompts, exact_length_params(osl), use_tqdm=False)
        _sync(cuda)
        return time.perf_counter() - started

    run(short)
    walls = {osl: min(run(osl) for _ in range(2)) for osl in (short, long)}
    summaries = {}
    with tempfile.TemporaryDirectory() as tmp:
        for osl in (short, long):
            with _profiler(cuda) as prof:
                run(osl)
            path = Path(tmp) / f"trace_{osl}.json"
            prof.export_chrome_trace(str(path))
            summaries[osl] = trace_summary(path)
    steps = long - short
    per_step = {name: (summaries[long]["per_name_us"][name]
                       - summaries[short]["per_name_us"].get(name, 0.0)) / steps / 1e3
                for name in summaries[long]["per_name_us"]}
    categories = Counter()
    for name, ms in per_step.items():
        categories[kernel_category(name)] += ms
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[:10]
    result = {"batch": batch, "isl": isl, "osls": [short, long],
              "wall_ms_per_step": (walls[long] - walls[short]) / steps * 1e3,
              "gpu_busy_ms_per_step": (summaries[long]["busy_us"]
                                       - summaries[short]["busy_us"]) / steps / 1e3,
              "category_ms_per_step": dict(categories.most_common()),
              "top_kernels_ms_per_step": [{"name": n[:120], "ms": ms} for n, ms in top]}
    session.log(f"FP8 decode step at batch {batch}: wall {result['wall_ms_per_step']:.3f} ms, "
                f"GPU busy {result['gpu_busy_ms_per_step']:.3f} ms; " + ", ".join(
                    f"{c} {ms:.3f}" for c, ms in result["category_ms_per_step"].items()))
    return result


@contextlib.contextmanager
def _profiler(cuda: bool):
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with profile(activities=activities) as prof:
            yield prof


def trace_summary(path: Path) -> dict:
    """GPU busy time (union of kernel/memcpy/memset intervals) and time per kernel name."""
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    device = [e for e in events if e.get("ph") == "X"
              and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    per_name = Counter()
    for e in device:
        per_name[e["name"]] += float(e.get("dur", 0))
    busy = interval_union([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
                           for e in device])
    return {"busy_us": busy, "per_name_us": per_name}


def kernel_category(name: str) -> str:
    lowered = name.lower()
    if any(k in lowered for k in ("nvjet", "gemm", "cutlass", "xmma", "matmul", "_w8a16",
                                  "_fp8_mm", "_sum_splits")):
        return "GEMM"
    if "attention" in lowered or "flash" in lowered or "merge_partitions" in lowered:
        return "attention"
    if any(k in lowered for k in ("_per_token_kernel", "_static_kernel", "_group_kernel",
                                  "quant")):
        return "fp8 quantization"
    if "rms_norm" in lowered or "silu" in lowered:
        return "norms/activations"
    if "write_kv" in lowered:
        return "rope + kv write"
    if "memcpy" in lowered or "memset" in lowered:
        return "memcpy/memset"
    return "other (sampling, embedding, copies)"


def _engine_facts(llm) -> dict:
    facts = {}
    with contextlib.suppress(Exception):
        stats = llm.get_stats()
        facts = {k: v for k, v in stats.items() if "kv" in k.lower() or "cache" in k.lower()}
    return facts


# ---- summary ----

def summary_table(session: Session) -> str:
    r = session.results
    plan = session.plan
    bf16, fp8 = r.get("bf16") or {}, r.get("fp8") or {}
    meta = r["meta"]
    lines = [f" gpu_fp8 summary: {meta['device']}, {meta['date']} ".center(100, "=")]
    tests = r.get("tests") or {}
    if "passed" in tests or "timed_out" in tests:
        said = tests.get("summary") or ("TIMED OUT" if tests.get("timed_out") else "")
        lines.append(f"GPU tests: {said}{'' if tests.get('passed') else '  <-- NOT PASSED'}")
    lines.append(f"{'engine: ' + plan.model:<44}{'BF16':>12}{'FP8+FP8KV':>12}{'FP8/BF16':>10}"
                 f"  goal")
    rows = [("latency b1 {}/{} (tok/s)".format(*plan.latency_shape), "latency",
             "output_tokens_per_s", 1,
             f">= {plan.goal_latency_ratio}x BF16" if plan.goal_latency_ratio else ""),
            ("  TPOT (ms)", "latency", "tpot_ms", 3, ""),
            ("throughput {}/{} x{} (tok/s)".format(*plan.throughput_shape,
                                                   plan.throughput_requests),
             "throughput", "output_tokens_per_s", 0,
             f">= {plan.goal_throughput:,.0f}" if plan.goal_throughput else ""),
            ("throughput {}/{} x{} (tok/s)".format(
                *plan.long_shape, (bf16.get("long") or fp8.get("long") or {}).get(
                    "num_requests", "?")), "long", "output_tokens_per_s", 0,
             f">= {plan.goal_long:,.0f}" if plan.goal_long else "")]
    for label, part, key, digits, goal in rows:
        a = (bf16.get(part) or {}).get(key)
        b = (fp8.get(part) or {}).get(key)
        ratio = f"{b / a:.2f}x" if a and b else "-"
        flags = [f"{name} TRUNCATED" for name, d in (("BF16", bf16), ("FP8", fp8))
                 if (d.get(part) or {}).get("is_truncated")]
        flags += [f"{name} ERROR" for name, d in (("BF16", bf16), ("FP8", fp8))
                  if "error" in (d.get(part) or {})]
        lines.append(f"{label:<44}{_fmt(a, digits):>12}{_fmt(b, digits):>12}{ratio:>10}  {goal}"
                     f"{'  [' + ', '.join(flags) + ']' if flags else ''}")
    long = bf16.get("long") or fp8.get("long") or {}
    if long.get("request_count_reason"):
        lines.append(f"  1000/1000 request count: {long['request_count_reason']}")
    big16 = (r.get("bf16big") or {}).get("throughput") or {}
    if big16.get("output_tokens_per_s"):
        lines.append(f"{'BF16 128/128 at batch ' + str(plan.big_batch_size) + ' (tok/s)':<44}"
                     f"{_fmt(big16['output_tokens_per_s']):>12}")
    big = (r.get("fp8big") or {}).get("throughput") or {}
    if "output_tokens_per_s" in big:
        lines.append(f"{'FP8 128/128 at batch ' + str(plan.big_batch_size) + ' (tok/s)':<44}"
                     f"{'':>12}{_fmt(big['output_tokens_per_s']):>12}")
    micro = r.get("micro") or {}
    if micro.get("shapes"):
        lines.append("GEMM us per call (M: bf16 mm / FP8 dispatch = what the layer runs):")
        for name, shape in micro["shapes"].items():
            cells = []
            for m, row in (shape.get("by_m") or {}).items():
                a = (row.get("bf16_mm") or {}).get("us")
                b = (row.get("fp8_dispatch") or {}).get("us")
                cells.append(f"M{m} {_fmt(a, 1)}/{_fmt(b, 1)}")
            lines.append(f"  {name:<8} " + "  ".join(cells))
        comp = micro.get("comparators", {})
        size = plan.comparator_size
        lines.append(f"  comparators: FP8 _scaled_mm {size}^3 "
                     f"{_fmt(comp.get(f'fp8_scaled_mm_rowwise_{size}_tflop_s'))} TFLOP/s "
                     f"row-wise, {_fmt(comp.get(f'fp8_scaled_mm_tensorwise_{size}_tflop_s'))} "
                     f"per-tensor; bf16 {_fmt(comp.get(f'bf16_mm_{size}_tflop_s'))}; copy "
                     f"{_fmt(comp.get('copy_tb_s'), 2)} TB/s")
    for key, prof in ((fp8.get("profile") or {}).items()):
        if isinstance(prof, dict) and "wall_ms_per_step" in prof:
            cats = ", ".join(f"{c.split(' (')[0]} {ms:.2f}" for c, ms in
                             prof["category_ms_per_step"].items())
            lines.append(f"FP8 decode step b{prof['batch']}: wall {prof['wall_ms_per_step']:.2f}"
                         f" ms, GPU {prof['gpu_busy_ms_per_step']:.2f} ms = {cats}")
    failed = [name for name in SECTIONS if "error" in (r.get(name) or {})]
    skipped = [name for name in SECTIONS if "skipped" in (r.get(name) or {})]
    if failed:
        lines.append(f"FAILED sections: {', '.join(failed)} (see the JSON / log)")
    if skipped:
        lines.append(f"skipped (out of time): {', '.join(skipped)}")
    lines.append(f"total {time.perf_counter() - session.start:.0f} s")
    return "\n".join(lines + ["=" * 100])


def _fmt(value, digits: int = 0) -> str:
    if value is None or not isinstance(value, (int, float)) or math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


# ---- plumbing ----

def _meta(plan: Plan, budget_s: float) -> dict:
    import torch
    device = (torch.cuda.get_device_name() if plan.device == "cuda" and torch.cuda.is_available()
              else "cpu")
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers"):
        with contextlib.suppress(ImportError):
            versions[name] = __import__(name).__version__
    commit = None
    with contextlib.suppress(Exception):
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT, timeout=5, check=False).stdout.strip() or None
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": device, "versions": versions, "commit": commit, "argv": sys.argv,
            "model": plan.model, "budget_s": budget_s}


def _free_memory() -> None:
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(cuda: bool) -> None:
    if cuda:
        import torch
        torch.cuda.synchronize()


def _smoke_model(directory: Path) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def run_sections(session: Session, sections: list[str], keep_going: bool) -> int:
    session.results["planned"] = sections
    if "tests" in sections:
        tests = session.run("tests", section_tests, session.cap("tests"))
        if tests.get("passed") is False and not keep_going:
            session.log("GPU tests FAILED: stopping (--keep-going runs the benchmarks anyway)")
            return 1
    if "micro" in sections:
        session.run("micro", section_micro, session.cap("micro"))
    for name in [s for s in ("bf16", "fp8") if s in sections]:
        session.run(name, section_engine, engine_budget(session, name, sections),
                    name == "fp8")
    if "fp8big" in sections:
        budget = session.remaining() / (2 if "bf16big" in sections else 1)
        session.run("fp8big", section_big_batch, budget)
    if "bf16big" in sections:  # the same-run comparator of fp8big
        session.run("bf16big", section_big_batch, session.remaining(), False)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} "
                             f"(default {','.join(DEFAULT_SECTIONS)})")
    parser.add_argument("--budget", type=float,
                        help=f"seconds for everything (default {DEFAULT_BUDGET:g}; 240 with "
                             "--cpu-smoke)")
    parser.add_argument("--max-batch-size", type=int, help="engines' max_batch_size (256)")
    parser.add_argument("--big-batch-size", type=int, help="fp8big's max_batch_size (512)")
    parser.add_argument("--long-requests", type=int, help="1000/1000 requests asked (1000)")
    parser.add_argument("--keep-going", action="store_true",
                        help="run the benchmarks even if the GPU tests fail")
    parser.add_argument("--cpu-smoke", "--dry-run", dest="smoke", action="store_true",
                        help="CPU, tiny random Llama, tiny shapes, Triton interpreter: checks "
                             "the plumbing")
    args = parser.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    if args.smoke:  # before any kernel module is imported
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --cpu-smoke on a CPU")
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        log = open(out_dir / "gpu_fp8.log", "w")  # noqa: SIM115 (open for the whole run)
        sys.stdout = Tee(sys.__stdout__, log)
        sys.stderr = Tee(sys.__stderr__, log)
    with tempfile.TemporaryDirectory() as tmp:
        plan = SMOKE if args.smoke else FULL
        if args.smoke:
            plan = replace(plan, model=_smoke_model(Path(tmp)))
        if args.max_batch_size:
            plan = replace(plan, max_batch_size=args.max_batch_size, profile_batches=tuple(
                b for b in plan.profile_batches if b <= args.max_batch_size))
        if args.big_batch_size:
            plan = replace(plan, big_batch_size=args.big_batch_size)
        if args.long_requests:
            plan = replace(plan, long_requests=args.long_requests)
        budget = args.budget or (240.0 if args.smoke else DEFAULT_BUDGET)
        session = Session(plan, budget, out_dir)
        meta = session.results["meta"]
        session.log(f"{plan.model} on {meta['device']}, sections {','.join(sections)}, budget "
                    f"{budget:.0f} s, versions {meta['versions']}, commit {meta['commit']}")
        start_watchdog(session, summary_table)
        code = run_sections(session, sections, args.keep_going)
        print(summary_table(session), flush=True)
        session.save()
    failed = any("error" in (session.results.get(name) or {}) for name in sections)
    return code or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
