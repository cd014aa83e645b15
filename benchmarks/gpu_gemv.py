"""The dense small-M GEMV (tllm.kernels.triton.dense_gemv, issue 21) against cuBLAS at M = 1
on Llama-3.1-8B's bf16 shapes, one process:
- the device-to-device copy bandwidth (the floor: weight bytes / it), measured first;
- per shape: F.linear (cuBLAS; for the gated kind F.linear + our silu_and_mul, the unfused
  path), the GEMV's default launch, and a compact grid of launches (each checked against the
  fp32 reference before it is timed); time per call from CUDA graphs of back-to-back calls
  cycling over >= 4 weight copies that together overflow the 50 MB L2 (weights come from
  HBM), median of 5 replays (benchmarks/gpu_fp8.time_calls);
- a table (us, TB/s, speed-up over cuBLAS) printed last; `--write-table PATH` writes the
  winners as a dense GEMV table (tllm.kernels.triton.dense_gemv_configs) with "use" true
  only where the winner beats the comparator by >= 3%; `--json PATH` the full results.
The LM head (128256 x 4096) is timed for information only (it is no Linear: not in the
table). The sweep stops at --budget seconds (what is left is marked skipped).

  python benchmarks/gpu_gemv.py --write-table $OUT/dense_gemv_NVIDIA_H200.json \\
      --json $OUT/gpu_gemv.json                   # H200, ~60-90 s
  python benchmarks/gpu_gemv.py --smoke           # CPU, Triton interpreter, tiny shapes
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# (name, kind, N, K, in the table)
# (the first of a kind pays its compiles; a deadline cuts the last first)
SHAPES = (("qkv", "plain", 6144, 4096, True), ("o", "plain", 4096, 4096, True),
          ("gate_up+silu", "silu_mul", 28672, 4096, True),
          ("down", "plain", 4096, 14336, True), ("gate_up", "plain", 28672, 4096, True),
          ("lm_head", "plain", 128256, 4096, False))
# --models: the M = 1 linears of issue 33's and 37's MoE models, swept before Llama-3.1-8B's
# (Mixtral's attention has Llama's qkv and o shapes)
MODEL_SHAPES = {
    "qwen3-30b-a3b": (("q3moe qkv", "plain", 5120, 2048, True),
                      ("q3moe o", "plain", 2048, 4096, True),
                      ("q3moe router", "plain", 128, 2048, True)),
    "mixtral-8x7b": (("mixtral router", "plain", 8, 4096, True),),
    # biased layers (the GEMV adds the bias in its epilogue; timed without it)
    "gpt-oss-20b": (("gptoss qkv", "plain", 5120, 2880, True),
                    ("gptoss o", "plain", 2880, 4096, True),
                    ("gptoss router", "plain", 32, 2880, True)),
}
SMOKE_SHAPES = (("qkv", "plain", 48, 128, True), ("gate_up+silu", "silu_mul", 64, 96, True))
L2_BYTES = 50 << 20
MIN_COPIES = 4
WIN_MARGIN = 1.03      # "use": the GEMV beats the comparator by at least 3%
# (block_n, block_k, num_warps, num_stages): 8-64 weights a thread an iteration
PLAIN_GRID = ((1, 1024, 4, 2), (1, 4096, 4, 1), (2, 1024, 4, 2), (2, 1024, 4, 3),
              (2, 2048, 4, 2), (2, 2048, 8, 2), (2, 4096, 8, 1), (4, 512, 4, 3),
              (4, 1024, 4, 1), (4, 1024, 4, 2), (4, 1024, 4, 3), (4, 2048, 8, 2),
              (8, 512, 4, 2), (8, 512, 4, 3), (8, 1024, 8, 2), (16, 256, 4, 3),
              (16, 512, 8, 2))
GATED_GRID = ((1, 1024, 4, 2), (1, 2048, 4, 2), (1, 4096, 4, 1), (2, 512, 4, 3),
              (2, 1024, 4, 1), (2, 1024, 4, 2), (2, 1024, 4, 3), (2, 2048, 8, 2),
              (4, 512, 4, 2), (4, 1024, 8, 2), (8, 512, 8, 2))


def weight_copies(n, k, dtype, device, smoke: bool) -> list:
    import torch
    count = 1 if smoke else max(MIN_COPIES, math.ceil(3 * L2_BYTES / (2 * n * k)))
    return [(torch.randn(n, k, device=device) * 0.02).to(dtype) for _ in range(count)]


def comparator_fn(kind: str, x, w):
    import torch.nn.functional as F
    if kind == "plain":
        return lambda: F.linear(x, w)
    from tllm.kernels.triton.activation import silu_and_mul
    return lambda: silu_and_mul(F.linear(x, w))


def gemv_fn(kind: str, x, w, cfg):
    from tllm.kernels.triton.dense_gemv import dense_gemv, dense_gemv_silu_mul
    fn = dense_gemv if kind == "plain" else dense_gemv_silu_mul
    return lambda: fn(x, w, cfg)


def check(kind: str, x, w, cfg, tol: float) -> float:
    from tllm.attention.testing import relative_error
    from tllm.kernels.triton.dense_gemv import dense_gemv_ref, dense_gemv_silu_mul_ref
    ref = (dense_gemv_ref if kind == "plain" else dense_gemv_silu_mul_ref)(x, w)
    err = relative_error(gemv_fn(kind, x, w, cfg)(), ref)
    if not err < tol:
        raise ValueError(f"relative error {err:.3g}")
    return err


def sweep_shape(kind, n, k, device, dtype, smoke, deadline) -> dict:
    """One shape: the comparator, the default launch and the grid, us per call."""
    import torch
    from gpu_fp8 import time_calls
    from tllm.kernels.triton.dense_gemv_configs import DEFAULT_CONFIGS, DenseGemvConfig
    weights = weight_copies(n, k, dtype, device, smoke)
    x = torch.randn(1, k, device=device).to(dtype)
    tol = 2e-2 if smoke else 1e-2        # the interpreter truncates to bf16 / fp16
    out = {"N": n, "K": k, "kind": kind, "copies": len(weights), "launches": {}}
    out["cublas_us"], out["timing"] = time_calls([comparator_fn(kind, x, w) for w in weights],
                                                 device)
    default = DEFAULT_CONFIGS[kind]
    grid = [DenseGemvConfig(*c) for c in (PLAIN_GRID if kind == "plain" else GATED_GRID)]
    grid = [default] + [c for c in grid if c != default]
    for cfg in grid[:2] if smoke else grid:
        if time.perf_counter() > deadline:
            out["launches"][cfg.label()] = "skipped: out of time"
            continue
        try:
            check(kind, x, weights[0], cfg, tol)
            us, _ = time_calls([gemv_fn(kind, x, w, cfg) for w in weights], device)
        except Exception as exc:  # a launch the compiler refuses, or a wrong one: note it
            out["launches"][cfg.label()] = f"{type(exc).__name__}: {str(exc)[:160]}"
            continue
        out["launches"][cfg.label()] = {"us": us, **cfg.__dict__}
    timed = {label: v for label, v in out["launches"].items() if isinstance(v, dict)}
    out["default_us"] = (timed.get(default.label()) or {}).get("us")
    if timed:
        best = min(timed, key=lambda label: timed[label]["us"])
        out["best"], out["best_us"] = best, timed[best]["us"]
        out["speedup"] = out["cublas_us"] / out["best_us"]
    del weights
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def winners_table(results: dict, old_rows: list[dict] = ()) -> str:
    """This run's winners over old_rows (a table file's rows: the shapes not swept again
    keep their entries)."""
    from tllm.kernels.triton.dense_gemv_configs import (DenseGemvConfig, TableEntry,
                                                        parse_table, table_to_json)
    table = parse_table(list(old_rows))
    extra = {(r["kind"], r["n"], r["k"]): {x: r[x] for x in ("us", "cublas_us", "device")
                                           if x in r} for r in old_rows}
    for name, kind, n, k, in_table in results["shape_list"]:
        row = results["shapes"].get(name, {})
        if not in_table or "best" not in row:
            continue
        launch = row["launches"][row["best"]]
        cfg = DenseGemvConfig(launch["block_n"], launch["block_k"], launch["num_warps"],
                              launch["num_stages"])
        key = (kind, n, k)
        table[key] = TableEntry(row["best_us"] * WIN_MARGIN <= row["cublas_us"], cfg)
        extra[key] = {"us": round(row["best_us"], 3), "cublas_us": round(row["cublas_us"], 3),
                      "device": results.get("device")}
    return table_to_json(table, extra)


def summary(results: dict) -> str:
    bw = results["copy_TBps"]
    lines = [f" dense GEMV vs cuBLAS, M = 1, {results['dtype']} on {results['device']}; "
             f"copy {bw:.2f} TB/s ".center(112, "="),
             f"{'shape':<14}{'N x K':>14}{'floor':>8}{'cuBLAS':>9}{'TB/s':>6}{'default':>9}"
             f"{'best':>9}{'TB/s':>6}{'speed-up':>9}  best launch"]
    for name, _, n, k, in_table in results["shape_list"]:
        row = results["shapes"].get(name)
        if not isinstance(row, dict) or "cublas_us" not in row:
            lines.append(f"{name:<14} {row}")
            continue
        nbytes = 2 * n * k

        def tbps(us):
            return f"{nbytes / (us * 1e-6) / 1e12:6.2f}" if us else f"{'-':>6}"
        best = row.get("best_us")
        use = "" if not in_table else ("  use" if best and best * WIN_MARGIN
                                       <= row["cublas_us"] else "  keep cuBLAS")
        lines.append(
            f"{name:<14}{f'{n}x{k}':>14}{nbytes / (bw * 1e12) * 1e6:8.1f}"
            f"{row['cublas_us']:9.1f}{tbps(row['cublas_us'])}"
            f"{(row.get('default_us') or float('nan')):9.1f}{(best or float('nan')):9.1f}"
            f"{tbps(best)}{row.get('speedup', float('nan')):8.2f}x  {row.get('best')}{use}")
    lines.append("us per call (CUDA graph of back-to-back calls over weight copies > L2); "
                 "floor = weight bytes / copy bandwidth; gated cuBLAS = F.linear + "
                 "silu_and_mul")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes")
    parser.add_argument("--budget", type=float, default=85.0, help="seconds for the sweep")
    parser.add_argument("--write-table", metavar="PATH",
                        help="the winners as a GEMV table ('device': this device's table "
                        "in tllm/kernels/triton/configs, which the dispatcher reads)")
    parser.add_argument("--json", metavar="PATH", help="all results")
    parser.add_argument("--models", default="", help="comma-separated MODEL_SHAPES keys "
                        "(or 'all') swept before Llama-3.1-8B's shapes")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"   # before any kernel module is imported
    import torch
    from gpu_fp8 import copy_bandwidth
    started = time.perf_counter()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float16 if args.smoke else torch.bfloat16
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    models = list(MODEL_SHAPES) if args.models == "all" else [
        m for m in args.models.split(",") if m]
    for model in reversed(models):  # the models' shapes first: a deadline cuts the last
        if model not in MODEL_SHAPES:
            raise SystemExit(f"--models: unknown {model!r}; choose from {sorted(MODEL_SHAPES)}")
        shapes = MODEL_SHAPES[model] + shapes
    results = {"device": "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(),
               "dtype": str(dtype).replace("torch.", ""), "shape_list": shapes, "shapes": {},
               "copy_TBps": copy_bandwidth(device, (16 << 20) if args.smoke else (2 << 30))
               / 1e12}
    deadline = started + args.budget
    for name, kind, n, k, _ in shapes:
        try:
            results["shapes"][name] = sweep_shape(kind, n, k, device, dtype, args.smoke,
                                                  deadline)
        except Exception as exc:  # one shape's failure keeps the others' figures
            results["shapes"][name] = f"FAILED {type(exc).__name__}: {str(exc)[:200]}"
        print(f"[{time.perf_counter() - started:5.1f} s] {name} done", flush=True)
    results["wall_s"] = time.perf_counter() - started
    if args.write_table:
        target = Path(args.write_table)
        if args.write_table == "device":  # the table the dispatcher reads on this device
            from tllm.kernels.triton.dense_gemv_configs import CONFIG_DIR, device_file_name
            target = CONFIG_DIR / device_file_name(results["device"])
        old_rows = json.loads(target.read_text()) if target.exists() else []
        target.write_text(winners_table(results, old_rows))
        print(f"table written to {target}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
