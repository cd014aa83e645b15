"""Weight-only int4 on one H200 (issue 20), one process:
(a) the W4A16 GEMM (tllm.kernels.triton.w4a16_gemm) at M = 1, 4, 16, 64, 256 on
    Llama-3.1-8B's shapes, against torch bf16 matmul and against the weight-read floor
    (packed weight + scales + zeros bytes / the device-to-device copy bandwidth measured in
    the same run); a small config sweep at M = 1 (the default is a heuristic never tuned on
    the device); W8A16 at M = 1; a correctness check of every timed path against the
    float32 reference first;
(b) dummy:llama-3.1-8b batch-1 decode (ISL 128 / OSL 256) bf16 vs quantization="int4_awq"
    (goal >= 2.5x), and 128/128 throughput at max_batch_size 64 (goal: no slower than bf16).
Prints a table last and writes everything to $OUT/gpu_int4.json.

  python benchmarks/gpu_int4.py              # H200, ~3-4 minutes
  python benchmarks/gpu_int4.py --smoke      # CPU, Triton interpreter, tiny shapes
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336))
SMOKE_SHAPES = (("qkv", 96, 128), ("down", 64, 256))
MS = (1, 4, 16, 64, 256)
GROUP = 128
L2_BYTES = 50 << 20


def packed_weights(n, k, bits, device, copies):
    import torch
    from tllm.kernels import woq
    layout = woq.WoqLayout(bits, GROUP, woq.interleave_words(k, bits))
    out = []
    for _ in range(copies):
        q = torch.randint(0, 2 ** bits, (n, k), dtype=torch.int32, device=device)
        scales = (torch.rand(k // GROUP, n, device=device) * 0.01 + 1e-3).half()
        zeros = torch.randint(0, 2 ** bits, (k // GROUP, n), device=device).half()
        out.append((woq.pack_rows(q, layout), scales, zeros))
    return out, layout


def weight_bytes(n, k, bits) -> int:
    return n * k * bits // 8 + 2 * 2 * (k // GROUP) * n


def check_paths(device, smoke: bool) -> dict:
    """Every path (GEMV, split-K dot, tiled dot, dequantize + cuBLAS) against the fp32
    reference on fresh random inputs."""
    import torch
    from tllm.attention.testing import relative_error
    from tllm.kernels import woq
    from tllm.kernels.triton.w4a16_gemm import woq_mm
    n, k = (96, 256) if smoke else (1024, 2048)
    out = {}
    for bits in (4, 8):
        (w,), layout = packed_weights(n, k, bits, device, 1)
        for m in ((1, 3, 40) if smoke else (1, 4, 16, 64, 256, 512)):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            err = relative_error(woq_mm(x, *w, layout), woq.woq_mm_ref(x, *w, layout))
            out[f"int{bits} M={m}"] = err
    out["ok"] = all(v < 1e-2 for v in out.values())
    return out


def section_micro(device, smoke: bool, deadline: float) -> dict:
    import torch
    import torch.nn.functional as F
    from gpu_fp8 import copy_bandwidth, time_calls
    from tllm.kernels.triton.w4a16_gemm import default_config, woq_mm
    copy_bps = copy_bandwidth(device, (16 << 20) if smoke else (2 << 30))
    result = {"copy_TBps": copy_bps / 1e12, "shapes": {}}
    for name, n, k in (SMOKE_SHAPES if smoke else SHAPES):
        if time.perf_counter() > deadline:
            result["shapes"][name] = {"skipped": "out of time"}
            continue
        copies = 1 if smoke else max(2, -(-3 * L2_BYTES // weight_bytes(n, k, 4)))
        int4, layout = packed_weights(n, k, 4, device, copies)
        bf16_copies = 1 if smoke else max(2, -(-3 * L2_BYTES // (2 * n * k)))
        dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16 if not smoke
                             else torch.float32) * 0.02 for _ in range(bf16_copies)]
        row = {"N": n, "K": k, "floor_us": weight_bytes(n, k, 4) / copy_bps * 1e6}
        for m in (MS[:3] if smoke else MS):
            x = torch.randn(m, k, device=device, dtype=dense[0].dtype)
            us4, _ = time_calls([lambda w=w: woq_mm(x, *w, layout) for w in int4], device)
            us16, _ = time_calls([lambda w=w: F.linear(x, w) for w in dense], device)
            row[f"M{m}"] = {"int4_us": us4, "bf16_us": us16,
                            "int4_TBps": weight_bytes(n, k, 4) / (us4 * 1e-6) / 1e12,
                            "config": str(default_config(m, n, k, layout, device)
                                          if m < 256 else "dequantize + cuBLAS")}
        row["sweep_M1"] = sweep_gemv(int4, layout, n, k, device, smoke)
        int8, layout8 = packed_weights(n, k, 8, device, max(2, copies // 2))
        x = torch.randn(1, k, device=device, dtype=dense[0].dtype)
        row["int8_M1_us"], _ = time_calls([lambda w=w: woq_mm(x, *w, layout8) for w in int8],
                                          device)
        result["shapes"][name] = row
        del int4, dense, int8
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def sweep_gemv(weights, layout, n, k, device, smoke: bool) -> dict:
    """M = 1 over a few GEMV launch shapes; the best is reported for a follow-up default."""
    import torch
    from gpu_fp8 import time_calls
    from tllm.kernels.triton.w4a16_gemm import WoqConfig, woq_mm
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16 if not smoke else torch.float32)
    out = {}
    grid = ((64, 4, 1), (128, 4, 1), (128, 4, 2), (128, 8, 1), (256, 8, 1), (128, 4, 4),
            (64, 2, 2), (256, 4, 2))
    for block_n, warps, split in (grid[:2] if smoke else grid):
        for stages in ((2,) if smoke else (2, 4)):
            cfg = WoqConfig(1, block_n, split, num_warps=warps, num_stages=stages)
            try:
                us, _ = time_calls([lambda w=w: woq_mm(x, *w, layout, config=cfg)
                                    for w in weights], device)
            except Exception as exc:  # a shape the compiler refuses: note it, go on
                out[str(cfg)] = f"{type(exc).__name__}"
                continue
            out[f"bn{block_n} w{warps} split{split} st{stages}"] = us
    timed = {key: v for key, v in out.items() if isinstance(v, float)}
    out["best"] = min(timed, key=timed.get) if timed else None
    return out


def section_engine(smoke: bool, deadline: float) -> dict:
    from tllm import LLM
    from tllm.bench.offline import (LatencyConfig, ThroughputConfig, run_latency,
                                    run_throughput)
    model = "dummy:smollm2-135m" if smoke else "dummy:llama-3.1-8b"
    base = {"dtype": "float32" if smoke else "bfloat16",
            "device": "cpu" if smoke else "cuda", "max_seq_len": 512}
    lat = LatencyConfig(isl=8 if smoke else 128, osl=2 if smoke else 256,
                        iterations=1 if smoke else 3, warmup=0 if smoke else 1)
    thr = ThroughputConfig(isl=8 if smoke else 128, osl=2 if smoke else 128,
                           num_requests=4 if smoke else 256, warmup=0 if smoke else 64)
    out = {}
    for name, quant in (("bf16", None), ("int4_awq", "int4_awq")):
        if time.perf_counter() > deadline:
            out[name] = {"skipped": "out of time"}
            continue
        started = time.perf_counter()
        try:
            with LLM(model, quantization=quant, max_batch_size=8 if smoke else 64,
                     **base) as llm:
                build_s = time.perf_counter() - started
                latency = run_latency(llm, lat)
                throughput = run_throughput(llm, thr)
            out[name] = {"build_s": build_s, "latency": latency, "throughput": throughput}
        except Exception as exc:
            traceback.print_exc()
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {json.dumps(_short(out[name]))}", flush=True)
    return out


def _short(entry: dict) -> dict:
    if "latency" not in entry:
        return entry
    return {"batch1_tok_s": entry["latency"]["output_tokens_per_s"],
            "tpot_ms": entry["latency"]["tpot_ms"],
            "b64_tok_s": entry["throughput"]["output_tokens_per_s"]}


def table(results: dict) -> str:
    lines = []
    micro = results.get("micro", {})
    if "copy_TBps" in micro:
        lines.append(f"copy bandwidth (read + write): {micro['copy_TBps']:.2f} TB/s")
        lines.append(f"{'shape':<9}{'M':>5}{'int4 us':>10}{'bf16 us':>10}{'x bf16':>8}"
                     f"{'floor us':>10}{'int4 TB/s':>11}")
        for name, row in micro["shapes"].items():
            for m in MS:
                cell = row.get(f"M{m}")
                if cell:
                    lines.append(f"{name:<9}{m:>5}{cell['int4_us']:>10.1f}{cell['bf16_us']:>10.1f}"
                                 f"{cell['bf16_us'] / cell['int4_us']:>8.2f}"
                                 f"{row['floor_us']:>10.1f}{cell['int4_TBps']:>11.2f}")
            if "sweep_M1" in row and row["sweep_M1"].get("best"):
                best = row["sweep_M1"]["best"]
                lines.append(f"{'':<9} M=1 best launch: {best} "
                             f"{row['sweep_M1'][best]:.1f} us; int8 M=1 {row['int8_M1_us']:.1f} us")
    engine = results.get("engine", {})
    if "latency" in engine.get("bf16", {}) and "latency" in engine.get("int4_awq", {}):
        b, q = _short(engine["bf16"]), _short(engine["int4_awq"])
        lines.append(f"batch 1 128/256 tok/s: bf16 {b['batch1_tok_s']:.1f}, int4_awq "
                     f"{q['batch1_tok_s']:.1f} ({q['batch1_tok_s'] / b['batch1_tok_s']:.2f}x, "
                     "goal >= 2.5x)")
        lines.append(f"128/128 at batch 64 tok/s: bf16 {b['b64_tok_s']:.0f}, int4_awq "
                     f"{q['b64_tok_s']:.0f} ({q['b64_tok_s'] / b['b64_tok_s']:.2f}x, goal >= 1)")
    lines.append(f"kernel check: {results.get('check', {}).get('ok')}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes")
    parser.add_argument("--budget", type=float, default=280.0, help="seconds (default 280)")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch
    device = torch.device("cpu" if args.smoke else "cuda")
    start = time.perf_counter()
    results: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                     "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    for name, fn, share in (("check", lambda d: check_paths(device, args.smoke), 0.1),
                            ("micro", lambda d: section_micro(device, args.smoke, d), 0.35),
                            ("engine", lambda d: section_engine(args.smoke, d), 0.55)):
        deadline = time.perf_counter() + share * args.budget
        try:
            results[name] = fn(deadline)
        except Exception as exc:
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"[{time.perf_counter() - start:.0f} s] {name} done", flush=True)
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_int4.json").write_text(json.dumps(results, indent=2, default=str))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
