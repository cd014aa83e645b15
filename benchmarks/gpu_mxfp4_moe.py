"""GPT-OSS-20B's experts on one GPU: the MXFP4 kernel (tllm.kernels.triton.swiglu_moe, the
weights packed, dequantized in the GEMM) against the same kernel on bf16 weights (the
dequantized MXFP4 values: the comparator) and against the weight-read floor.

Shapes: 32 experts, H = I = 2880, top-4, at 1, 8, 128 and 512 tokens. Per token count: the
time per call (a CUDA graph of back-to-back calls, each taking the next of 4 routings, so the
experts read differ call to call) of MXFP4 by bits (the default), MXFP4 by tl.dot_scaled and
bf16; the weight-read floor = the distinct experts' bytes / the device-to-device copy
bandwidth measured in the run; the max |diff| of each MXFP4 path against bf16 (same values,
so only the summation order differs). --sweep: a few tile candidates at 1 and 128 tokens.

    python benchmarks/gpu_mxfp4_moe.py --out $OUT/mxfp4_moe.json [--sweep] [--budget 60]
    python benchmarks/gpu_mxfp4_moe.py --smoke --out /tmp/mxfp4_moe.json   # CPU plumbing
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
if "--smoke" in sys.argv:  # before any kernel module is imported
    os.environ["TRITON_INTERPRET"] = "1"
from gpu_common import start_watchdog  # noqa: E402
from gpu_fp8 import copy_bandwidth, time_calls  # noqa: E402

ALPHA, LIMIT = 1.702, 7.0
ROUTINGS = 4
MXFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 32  # a nibble, and a scale byte per 32


@dataclass(frozen=True)
class Shape:
    experts: int
    hidden: int
    inter: int
    top_k: int

    @property
    def weights_per_expert(self) -> int:
        return 3 * self.hidden * self.inter


FULL = Shape(32, 2880, 2880, 4)            # GPT-OSS-20B
SMOKE = Shape(4, 64, 64, 2)
FULL_TOKENS, SMOKE_TOKENS = (1, 8, 128, 512), (1, 3)


def sweep_configs(num_tokens: int, smoke: bool) -> dict:
    """Tile candidates (block_m; gate_up and down tiles: block_n, block_k, warps, stages)."""
    from tllm.kernels.triton.fused_moe import GemmTile, MoeConfig

    def cfg(block_m, gate_up, down, group_m=1):
        return MoeConfig(block_m, GemmTile(*gate_up), GemmTile(*down), group_m)
    if num_tokens <= 8:
        candidates = {"gemv n32 k256": cfg(1, (32, 256, 4, 3), (32, 256, 4, 3)),
                      "gemv n64 k256 w8": cfg(1, (64, 256, 8, 3), (64, 256, 8, 3)),
                      "m16 n32 k256": cfg(16, (32, 256, 4, 3), (32, 256, 4, 3)),
                      "m16 bf16 table": cfg(16, (32, 128, 4, 4), (64, 128, 4, 4))}
    else:
        candidates = {"m32 bf16 table": cfg(32, (64, 128, 4, 3), (128, 128, 4, 3), 8),
                      "m32 n64 k256": cfg(32, (64, 256, 4, 3), (64, 256, 4, 3), 8),
                      "m16 n32 k256": cfg(16, (32, 256, 4, 3), (64, 256, 4, 3)),
                      "m64 n64 k128": cfg(64, (64, 128, 4, 3), (128, 128, 8, 3), 8)}
    return dict(list(candidates.items())[:2]) if smoke else candidates


# ---- inputs ----

def make_experts(shape: Shape, device):
    """MXFP4 experts (random codes, scales near 2^-6 as a checkpoint's), their bf16 values
    (dequantized one expert at a time) and bf16 biases."""
    import torch
    from tllm.kernels.mxfp4 import dequantize_mxfp4
    gen = torch.Generator(device=device).manual_seed(0)
    e, h, i = shape.experts, shape.hidden, shape.inter

    def packed(rows, k):
        blocks = torch.randint(0, 256, (e, rows, k // 32, 16), dtype=torch.uint8,
                               device=device, generator=gen)
        scales = torch.randint(119, 123, (e, rows, k // 32), dtype=torch.uint8, device=device,
                               generator=gen)
        dense = torch.stack([dequantize_mxfp4(blocks[x], scales[x], torch.bfloat16)
                             for x in range(e)])
        return blocks, scales, dense
    w13, s13, d13 = packed(2 * i, h)
    w2, s2, d2 = packed(h, i)
    b13 = torch.randn(e, 2 * i, device=device, generator=gen).to(torch.bfloat16)
    b2 = torch.randn(e, h, device=device, generator=gen).to(torch.bfloat16)
    return {"mxfp4": (w13, b13, w2, b2, s13, s2), "bf16": (d13, b13, d2, b2)}


def make_routings(shape: Shape, num_tokens: int, device) -> list:
    import torch
    out = []
    for seed in range(ROUTINGS):
        gen = torch.Generator(device=device).manual_seed(seed)
        hidden = torch.randn(num_tokens, shape.hidden, device=device, generator=gen)
        logits = torch.randn(num_tokens, shape.experts, device=device, generator=gen)
        weights, ids = torch.softmax(logits, -1).topk(shape.top_k, -1)
        out.append((hidden.to(torch.bfloat16), weights / weights.sum(-1, keepdim=True), ids))
    return out


# ---- timing ----

def calls(experts: dict, routings: list, path: str, config=None) -> list:
    """One zero-argument call per routing, for path "bits", "scaled" (MXFP4) or "bf16"
    (at a few tokens the sort-free decode path for bits and bf16), or "bits_tile" (bits on
    the tile path always)."""
    from tllm.kernels.triton.swiglu_moe import swiglu_experts_triton
    if path == "bits_tile":
        w13, b13, w2, b2, s13, s2 = experts["mxfp4"]
        return [lambda r=r: swiglu_experts_triton(r[0], w13, b13, w2, b2, r[1], r[2], ALPHA,
                                                  LIMIT, w13_scales=s13, w2_scales=s2,
                                                  config=config, decode=False)
                for r in routings]
    if path == "bf16":
        w13, b13, w2, b2 = experts["bf16"]
        return [lambda r=r: swiglu_experts_triton(r[0], w13, b13, w2, b2, r[1], r[2], ALPHA,
                                                  LIMIT, config=config) for r in routings]
    w13, b13, w2, b2, s13, s2 = experts["mxfp4"]
    return [lambda r=r: swiglu_experts_triton(r[0], w13, b13, w2, b2, r[1], r[2], ALPHA, LIMIT,
                                              w13_scales=s13, w2_scales=s2, config=config,
                                              mxfp4_dot=path) for r in routings]


def timed(fns: list, device) -> dict:
    try:
        us, how = time_calls(fns, device)
        return {"us": us, "timing": how}
    except Exception as exc:  # a tile the compiler refuses: record, go on
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def bench_tokens(shape: Shape, experts: dict, num_tokens: int, device, copy_b_s: float) -> dict:
    routings = make_routings(shape, num_tokens, device)
    fns = {path: calls(experts, routings, path)
           for path in ("bits", "bits_tile", "scaled", "bf16")}
    row = {"num_tokens": num_tokens}
    want = fns["bf16"][0]().float()
    for path in ("bits", "bits_tile", "scaled"):
        try:
            row[f"{path}_max_abs_diff_vs_bf16"] = float((fns[path][0]().float() - want)
                                                        .abs().max())
        except Exception as exc:
            row[f"{path}_max_abs_diff_vs_bf16"] = f"{type(exc).__name__}: {exc}"[:300]
    row["ref_max_abs"] = float(want.abs().max())
    for path, path_fns in fns.items():
        row[path] = timed(path_fns, device)
    distinct = statistics.mean(int(r[2].unique().numel()) for r in routings)
    weights = distinct * shape.weights_per_expert
    row["mxfp4_floor_us"] = weights * MXFP4_BYTES_PER_WEIGHT / copy_b_s * 1e6
    row["bf16_floor_us"] = weights * 2 / copy_b_s * 1e6
    return row


def sweep_tokens(shape: Shape, experts: dict, num_tokens: int, device, smoke: bool) -> dict:
    routings = make_routings(shape, num_tokens, device)
    return {name: {"config": asdict(cfg), **timed(calls(experts, routings, "bits", cfg), device)}
            for name, cfg in sweep_configs(num_tokens, smoke).items()}


# ---- report ----

def _us(cell: dict) -> str:
    return f"{cell['us']:>10.1f}" if "us" in cell else f"{'error':>10}"


def table(results: dict) -> str:
    rate = results.get("copy_b_s", 0) / 1e9
    lines = [" MoE experts: us per call (MXFP4 kernel vs bf16 comparator) ".center(110, "="),
             f"shape {results.get('shape')}; copy bandwidth {rate:.0f} GB/s; floor = the "
             "distinct experts' weight bytes / it",
             f"{'T':>5}{'bits':>10}{'bits tile':>10}{'scaled':>10}{'bf16':>10}{'mxfp4 floor':>13}"
             f"{'bf16 floor':>12}{'bits/floor':>12}{'bits|diff|':>12}{'scaled|diff|':>14}"]
    for t, row in results.get("rows", {}).items():
        if "bits" not in row:
            lines.append(f"{t:>5}  {str(row)[:100]}")
            continue
        ratio = row["bits"].get("us", float("nan")) / row["mxfp4_floor_us"]
        diffs = [row[f"{p}_max_abs_diff_vs_bf16"] for p in ("bits", "scaled")]
        lines.append(f"{t:>5}{_us(row['bits'])}{_us(row.get('bits_tile', {}))}"
                     f"{_us(row['scaled'])}{_us(row['bf16'])}"
                     f"{row['mxfp4_floor_us']:>13.1f}{row['bf16_floor_us']:>12.1f}"
                     f"{ratio:>12.1f}" + "".join(f"{d:>12.2e}" if isinstance(d, float)
                                                 else f"{'error':>12}" for d in diffs))
    for t, runs in results.get("sweep", {}).items():
        lines.append(f"sweep T={t} (bits): " + ", ".join(
            f"{name} {run['us']:.1f}" if "us" in run else f"{name} error"
            for name, run in runs.items()))
    return "\n".join(lines + ["=" * 110])


class Session:
    """Budget, results and the JSON file (gpu_common's watchdog reads these)."""

    def __init__(self, args) -> None:
        self.end = time.perf_counter() + args.budget
        self.out = Path(args.out) if args.out else None
        now = datetime.datetime.now().isoformat(timespec="seconds")
        self.results: dict = {"meta": {"date": now, "command": " ".join(sys.argv)}}

    def left(self) -> float:
        return self.end - time.perf_counter()

    def save(self) -> None:
        if self.out is not None:
            self.out.write_text(json.dumps(self.results, indent=1, default=str))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON results path")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds in all")
    parser.add_argument("--sweep", action="store_true", help="tile candidates at T=1, 128")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpreter, CPU")
    args = parser.parse_args()
    import torch
    device = torch.device("cpu" if args.smoke else "cuda")
    shape, tokens = (SMOKE, SMOKE_TOKENS) if args.smoke else (FULL, FULL_TOKENS)
    session = Session(args)
    start_watchdog(session, lambda s: table(s.results))
    if device.type == "cuda":
        session.results["meta"]["device"] = torch.cuda.get_device_name()
    session.results.update(shape=asdict(shape), rows={}, sweep={})
    copy_b_s = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (16 << 20))
    session.results["copy_b_s"] = copy_b_s
    experts = make_experts(shape, device)
    for num_tokens in tokens:
        if session.left() < 5:
            session.results["rows"][num_tokens] = {"skipped": "out of time"}
            continue
        session.results["rows"][num_tokens] = bench_tokens(shape, experts, num_tokens, device,
                                                           copy_b_s)
        print(table(session.results).splitlines()[-2], flush=True)
        session.save()
    for num_tokens in (tokens[0], tokens[-1] if args.smoke else 128) if args.sweep else ():
        if session.left() < 10:
            break
        session.results["sweep"][num_tokens] = sweep_tokens(shape, experts, num_tokens,
                                                            device, args.smoke)
        session.save()
    print(table(session.results), flush=True)
    session.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
