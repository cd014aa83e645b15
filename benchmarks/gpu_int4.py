"""Weight-only int4 on one H200 (issue 20), one process:
(a) the W4A16 GEMM (tllm.kernels.triton.w4a16_gemm) at M = 1, 4, 16, 64, 256 on
    Llama-3.1-8B's shapes with its default launch, against torch bf16 matmul and against the
    weight-read floor (packed weight + scales + zeros bytes / the device-to-device copy
    bandwidth measured in the same run); W8A16 at M = 1; the LM head (128256 x 4096) bf16
    and int8 weight-only at M = 1; a correctness check of every path first (the GEMV's
    packed 16-bit PTX math switched off, and said so, if it fails);
(b) a sweep per M bucket (1, 16, 64, 256) and shape over w4a16_gemm.sweep_configs (each
    launch checked against the fp32 reference before it is timed): the best launch per
    bucket and shape, against the default's time, for the next default table;
(c) the per-token GEMM sum (32 x (qkv + o + gate_up + down) + LM head, default launches at
    M = 1) against the measured TPOT: what the rest of a decode step costs;
(d) dummy:llama-3.1-8b batch-1 decode (ISL 128 / OSL 256) bf16 vs quantization="int4_awq"
    (goal >= 2.5x) and int4_awq with the int8 LM head, and 128/128 throughput at
    max_batch_size 64 (goal: no slower than bf16).
Prints a table last and writes everything to $OUT/gpu_int4.json.

  python benchmarks/gpu_int4.py --budget 180   # H200, ~3 minutes
  python benchmarks/gpu_int4.py --smoke        # CPU, Triton interpreter, tiny shapes
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
SWEEP_MS = (1, 64, 16, 256)     # in order of importance: the sweep stops at its deadline
LAYERS = 32
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
    """Every default path (GEMV, wx dot with and without split-K, dequantize + cuBLAS) against
    the fp32 reference on fresh random inputs; the GEMV in bf16 and fp16 (its packed math).
    A failing packed GEMV is switched off for the rest of the run (and reported)."""
    import torch
    from tllm.kernels.triton import w4a16_gemm
    out = _check_defaults(device, smoke)
    failed = [key for key, v in out.items() if key != "ok" and not v < 1e-2]
    switched = []
    if any(" M=1 " in key for key in failed):
        w4a16_gemm.PACKED_GEMV = False
        switched.append("the GEMV's packed math (fp32 GEMV instead)")
    if any(f" M={m} " in key for key in failed for m in (4, 16, 64, 256)):
        w4a16_gemm.PACKED_DOT = False
        switched.append("the wx kernel's paired dequantization (fp32 fields instead)")
    if switched:
        out = {"failed_first": dict(out), **_check_defaults(device, smoke),
               "packed_gemv": "switched off after a failed check: " + "; ".join(switched)}
        print(f"CHECK FAILED: switched off {switched}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out


def _check_defaults(device, smoke: bool) -> dict:
    import torch
    from tllm.attention.testing import relative_error
    from tllm.kernels import woq
    from tllm.kernels.triton.w4a16_gemm import woq_mm
    out = {}
    shapes = ((96, 256),) if smoke else ((1024, 2048), (520, 14336))
    dtypes = (torch.bfloat16,) if smoke else (torch.bfloat16, torch.float16)
    for n, k in shapes:
        for bits in (4, 8):
            (w,), layout = packed_weights(n, k, bits, device, 1)
            for m in ((1, 3, 40) if smoke else (1, 4, 16, 64, 256, 512)):
                for dtype in (dtypes if m == 1 else dtypes[:1]):
                    x = torch.randn(m, k, device=device, dtype=dtype)
                    err = relative_error(woq_mm(x, *w, layout), woq.woq_mm_ref(x, *w, layout))
                    out[f"int{bits} M={m} {str(dtype)[6:]} {n}x{k}"] = err
    out["ok"] = all(v < 1e-2 for v in out.values())
    return out


def section_micro(device, smoke: bool, deadline: float) -> dict:
    import torch
    import torch.nn.functional as F
    from gpu_fp8 import copy_bandwidth, time_calls
    from tllm.kernels.triton.w4a16_gemm import default_config, usable, woq_mm
    copy_bps = copy_bandwidth(device, (16 << 20) if smoke else (2 << 30))
    result = {"copy_TBps": copy_bps / 1e12, "shapes": {}, "sweep": {}}
    dtype = torch.float32 if smoke else torch.bfloat16
    weights = {}
    for name, n, k in (SMOKE_SHAPES if smoke else SHAPES):
        copies = 1 if smoke else max(2, -(-3 * L2_BYTES // weight_bytes(n, k, 4)))
        int4, layout = packed_weights(n, k, 4, device, copies)
        weights[name] = (int4, layout, n, k)
        bf16_copies = 1 if smoke else max(2, -(-3 * L2_BYTES // (2 * n * k)))
        dense = [torch.randn(n, k, device=device, dtype=dtype) * 0.02
                 for _ in range(bf16_copies)]
        row = {"N": n, "K": k, "floor_us": weight_bytes(n, k, 4) / copy_bps * 1e6}
        for m in (MS[:3] if smoke else MS):
            x = torch.randn(m, k, device=device, dtype=dtype)
            us4, _ = time_calls([lambda w=w: woq_mm(x, *w, layout) for w in int4], device)
            us16, _ = time_calls([lambda w=w: F.linear(x, w) for w in dense], device)
            cfg = usable(default_config(m, n, k, layout, device), m, n, k, layout, device)
            row[f"M{m}"] = {"int4_us": us4, "bf16_us": us16,
                            "int4_TBps": weight_bytes(n, k, 4) / (us4 * 1e-6) / 1e12,
                            "config": cfg.label()}
        int8, layout8 = packed_weights(n, k, 8, device, max(2, copies // 2))
        x = torch.randn(1, k, device=device, dtype=dtype)
        row["int8_M1_us"], _ = time_calls([lambda w=w: woq_mm(x, *w, layout8) for w in int8],
                                          device)
        result["shapes"][name] = row
        del dense, int8
    result["lm_head"] = lm_head_times(device, smoke, dtype, time_calls)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # the sweep, bucket by bucket (M = 1 first): stops at the deadline
    for m in ((1, 16) if smoke else SWEEP_MS):
        for name, (int4, layout, n, k) in weights.items():
            if time.perf_counter() > deadline:
                result["sweep"].setdefault(f"M{m}", {})[name] = {"skipped": "out of time"}
                continue
            result["sweep"].setdefault(f"M{m}", {})[name] = sweep(
                int4, layout, m, n, k, device, dtype, deadline)
    return result


def lm_head_times(device, smoke: bool, dtype, time_calls) -> dict:
    """The LM head at M = 1: bf16 (what int4_awq keeps by default) and int8 weight-only."""
    import torch
    import torch.nn.functional as F
    from tllm.kernels.triton.w4a16_gemm import woq_mm
    n, k = (256, 128) if smoke else (128256, 4096)
    dense = torch.randn(n, k, device=device, dtype=dtype) * 0.02
    x = torch.randn(1, k, device=device, dtype=dtype)
    bf16_us, _ = time_calls([lambda: F.linear(x, dense)], device)
    del dense
    (w8,), layout8 = packed_weights(n, k, 8, device, 1)
    int8_us, _ = time_calls([lambda: woq_mm(x, *w8, layout8)], device)
    return {"N": n, "K": k, "bf16_us": bf16_us, "int8_us": int8_us,
            "bf16_TBps": 2 * n * k / (bf16_us * 1e-6) / 1e12,
            "int8_TBps": weight_bytes(n, k, 8) / (int8_us * 1e-6) / 1e12}


def sweep(weights, layout, m, n, k, device, dtype, deadline) -> dict:
    """Each of sweep_configs(m)'s launches: checked on the first weight copy, then timed."""
    import torch
    from gpu_fp8 import time_calls
    from tllm.attention.testing import relative_error
    from tllm.kernels import woq
    from tllm.kernels.triton.w4a16_gemm import default_config, sweep_configs, usable, woq_mm
    x = torch.randn(m, k, device=device, dtype=dtype)
    ref = woq.woq_mm_ref(x, *weights[0], layout)
    out = {"default": usable(default_config(m, n, k, layout, device), m, n, k, layout,
                             device).label()}
    for cfg in sweep_configs(m)[:None if device.type == "cuda" else 2]:
        if time.perf_counter() > deadline:
            out["stopped"] = "out of time"
            break
        try:
            cfg = usable(cfg, m, n, k, layout, device)
            err = relative_error(woq_mm(x, *weights[0], layout, config=cfg), ref)
            if not err < 1e-2:
                out[cfg.label()] = f"WRONG (relative error {err:.3g})"
                continue
            us, _ = time_calls([lambda w=w: woq_mm(x, *w, layout, config=cfg)
                                for w in weights], device)
        except Exception as exc:  # a launch the compiler refuses: note it, go on
            out[cfg.label()] = f"{type(exc).__name__}: {str(exc)[:120]}"
            continue
        out[cfg.label()] = us
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
    runs = (("bf16", None, True), ("int4_awq", "int4_awq", True),
            ("int4_awq_int8_head", "int4_awq_int8_head", False))
    for name, quant, with_throughput in runs:
        if time.perf_counter() > deadline:
            out[name] = {"skipped": "out of time"}
            continue
        started = time.perf_counter()
        try:
            with LLM(model, quantization=quant, max_batch_size=8 if smoke else 64,
                     **base) as llm:
                build_s = time.perf_counter() - started
                latency = run_latency(llm, lat)
                throughput = run_throughput(llm, thr) if with_throughput else None
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
            "b64_tok_s": (entry["throughput"] or {}).get("output_tokens_per_s")}


def table(results: dict) -> str:
    lines = []
    micro = results.get("micro", {})
    if "copy_TBps" in micro:
        lines += micro_lines(micro)
    lines += sweep_lines(micro.get("sweep", {}), micro.get("shapes", {}))
    lines += engine_lines(results.get("engine", {}), micro)
    check = results.get("check", {})
    lines.append(f"kernel check: {check.get('ok')}"
                 + (f" ({check['packed_gemv']})" if "packed_gemv" in check else ""))
    return "\n".join(lines)


def micro_lines(micro: dict) -> list[str]:
    lines = [f"copy bandwidth (read + write): {micro['copy_TBps']:.2f} TB/s",
             f"{'shape':<9}{'M':>5}{'int4 us':>10}{'bf16 us':>10}{'x bf16':>8}"
             f"{'floor us':>10}{'int4 TB/s':>11}  default launch"]
    for name, row in micro["shapes"].items():
        for m in MS:
            cell = row.get(f"M{m}")
            if cell:
                lines.append(f"{name:<9}{m:>5}{cell['int4_us']:>10.1f}{cell['bf16_us']:>10.1f}"
                             f"{cell['bf16_us'] / cell['int4_us']:>8.2f}{row['floor_us']:>10.1f}"
                             f"{cell['int4_TBps']:>11.2f}  {cell['config']}")
        lines.append(f"{'':<9} int8 M=1 {row['int8_M1_us']:.1f} us")
    head = micro.get("lm_head")
    if head:
        lines.append(f"LM head {head['N']}x{head['K']} M=1: bf16 {head['bf16_us']:.1f} us "
                     f"({head['bf16_TBps']:.2f} TB/s), int8 {head['int8_us']:.1f} us "
                     f"({head['int8_TBps']:.2f} TB/s)")
    return lines


def sweep_lines(sweeps: dict, shapes: dict) -> list[str]:
    lines = ["sweep: best launch per M bucket and shape (us; the default's us in brackets)"]
    for bucket, per_shape in sweeps.items():
        for name, res in per_shape.items():
            best = res.get("best")
            if not best:
                lines.append(f"  {bucket:<5}{name:<9}{res.get('skipped', 'nothing timed')}")
                continue
            default = res.get(res.get("default"))
            note = f"[{default:.1f}]" if isinstance(default, float) else "[default not swept]"
            wrong = [key for key, v in res.items() if isinstance(v, str) and
                     key not in ("default", "best", "stopped")]
            lines.append(f"  {bucket:<5}{name:<9}{res[best]:>7.1f} {note:>8}  {best}"
                         + (f"  (failed: {len(wrong)})" if wrong else ""))
    return lines


def engine_lines(engine: dict, micro: dict) -> list[str]:
    lines = []
    shortened = {name: _short(entry) for name, entry in engine.items() if "latency" in entry}
    b, q = shortened.get("bf16"), shortened.get("int4_awq")
    if b and q:
        lines.append(f"batch 1 128/256 tok/s: bf16 {b['batch1_tok_s']:.1f}, int4_awq "
                     f"{q['batch1_tok_s']:.1f} ({q['batch1_tok_s'] / b['batch1_tok_s']:.2f}x, "
                     "goal >= 2.5x)")
        h = shortened.get("int4_awq_int8_head")
        if h:
            lines.append(f"  int4_awq + int8 LM head: {h['batch1_tok_s']:.1f} tok/s "
                         f"({h['batch1_tok_s'] / b['batch1_tok_s']:.2f}x)")
        if b["b64_tok_s"] and q["b64_tok_s"]:
            lines.append(f"128/128 at batch 64 tok/s: bf16 {b['b64_tok_s']:.0f}, int4_awq "
                         f"{q['b64_tok_s']:.0f} ({q['b64_tok_s'] / b['b64_tok_s']:.2f}x, goal >= 1)")
    lines += step_budget_lines(shortened, micro)
    return lines


def step_budget_lines(shortened: dict, micro: dict) -> list[str]:
    """Per token: 32 x (qkv + o + gate_up + down) at M = 1 + the LM head, against TPOT."""
    shapes, head = micro.get("shapes", {}), micro.get("lm_head")
    if not head or any("M1" not in shapes.get(name, {}) for name, _, _ in SHAPES):
        return []
    lines = ["per-token GEMM time (default launches, M = 1) vs measured TPOT:"]
    for name, key, head_key in (("bf16", "bf16_us", "bf16_us"),
                                ("int4_awq", "int4_us", "bf16_us"),
                                ("int4_awq_int8_head", "int4_us", "int8_us")):
        layers = LAYERS * sum(shapes[s]["M1"][key] for s, _, _ in SHAPES) / 1e3
        total = layers + head[head_key] / 1e3
        tpot = shortened.get(name, {}).get("tpot_ms")
        rest = f", TPOT {tpot:.3f} ms, rest {tpot - total:.3f} ms" if tpot else ""
        lines.append(f"  {name:<19} layers {layers:.3f} ms + head {head[head_key] / 1e3:.3f}"
                     f" ms = {total:.3f} ms{rest}")
    return lines


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
    for name, fn, share in (("check", lambda d: check_paths(device, args.smoke), 0.06),
                            ("micro", lambda d: section_micro(device, args.smoke, d), 0.44),
                            ("engine", lambda d: section_engine(args.smoke, d), 0.5)):
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
