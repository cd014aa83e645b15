"""The sort-free MoE decode path (tllm.kernels.triton.moe_decode) against the tile path
(tllm.kernels.triton.fused_moe / fp8_fused_moe: the pair sort, two grouped GEMMs, the top-k
sum) and the weight-read floor, at 1, 2 and 4 tokens, in the expert shapes of Qwen3-30B-A3B,
Mixtral-8x7B and DeepSeek-V2-Lite (bf16), and Mixtral with per-channel / Qwen3 with 128x128
block FP8 experts. One process:

- the device-to-device copy bandwidth first (the floor: the distinct experts a call reads x
  an expert's bytes / it);
- per shape and batch: both paths checked against the float32 reference on the
  dequantized weights, then timed as CUDA graphs of back-to-back calls (each call the next
  of 4 routings, so the experts read differ call to call), benchmarks/gpu_fp8.time_calls;
- at 1 token, the decode path's launch tiles swept (gate_up with the default down, then down
  with the best gate_up); the best is printed as a MoeDecodeConfig to paste.

    python benchmarks/gpu_moe_decode.py --out $OUT/moe_decode.json [--budget 150]
    python benchmarks/gpu_moe_decode.py --cpu-smoke        # plumbing, Triton interpreter
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
if "--cpu-smoke" in sys.argv:  # before any kernel module is imported
    os.environ["TRITON_INTERPRET"] = "1"

# name: (hidden, inter, experts, top_k, weights: "bf16" | "fp8-channel" | "fp8-block")
FULL_SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8, "bf16"),
               "mixtral-8x7b": (4096, 14336, 8, 2, "bf16"),
               "deepseek-v2-lite": (2048, 1408, 64, 6, "bf16"),
               "mixtral-8x7b-fp8": (4096, 14336, 8, 2, "fp8-channel"),
               "qwen3-30b-a3b-fp8": (2048, 768, 128, 8, "fp8-block")}
SMOKE_SHAPES = {"tiny-bf16": (64, 48, 16, 2, "bf16"), "tiny-fp8": (64, 48, 16, 2, "fp8-block")}
BATCHES = (1, 2, 4)
ROUTINGS = 4
# (block_n, block_k, num_warps, num_stages)
GATE_UP_GRID = ((1, 1024, 4, 2), (2, 512, 4, 3), (2, 1024, 4, 2), (2, 2048, 8, 2),
                (4, 512, 4, 2), (4, 1024, 8, 2), (8, 256, 4, 3))
DOWN_GRID = ((2, 1024, 4, 2), (4, 512, 4, 3), (4, 1024, 4, 2), (4, 2048, 4, 2),
             (8, 512, 4, 2), (8, 1024, 8, 2), (16, 256, 4, 3))


def make_experts(spec, device):
    """(w13, w2, scales kwargs, dequantized float32 (w13, w2) for the reference)."""
    import torch
    from tllm.kernels import fp8 as ref
    hidden, inter, experts, _, kind = spec
    w13 = torch.randn(experts, 2 * inter, hidden, device=device) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, device=device) * inter ** -0.5
    if kind == "bf16":
        w13, w2 = w13.bfloat16(), w2.bfloat16()
        return w13, w2, {}, (w13.float(), w2.float())
    block = (128, 128) if kind == "fp8-block" else None
    if block and hidden < 128:
        block = (16, 16)
    quantized, scales, deq = [], [], []
    for w in (w13, w2):
        qs = [ref.quantize_blocks(w[e], block) if block else ref.quantize_per_channel(w[e])
              for e in range(experts)]
        q, s = torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])
        quantized.append(q)
        scales.append(s)
        deq.append(torch.stack([ref.dequantize_blocks(q[e], s[e], block) if block
                                else q[e].float() * s[e].float() for e in range(experts)]))
    del w13, w2
    return (quantized[0], quantized[1],
            dict(w13_scale=scales[0], w2_scale=scales[1], block=block), tuple(deq))


def routings(spec, num_tokens, device):
    import torch
    hidden, _, experts, top_k, _ = spec
    sets = []
    for seed in range(ROUTINGS):
        gen = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(num_tokens, hidden, device=device, generator=gen).bfloat16()
        logits = torch.randn(num_tokens, experts, device=device, generator=gen)
        weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
        sets.append((x, (weights / weights.sum(-1, keepdim=True)).float(), ids.int()))
    return sets


def call(path: str, w13, w2, scales, s, config=None):
    from tllm.kernels.triton import fused_moe, moe_decode
    from tllm.kernels.triton.fp8_fused_moe import fp8_fused_experts_triton
    x, weights, ids = s
    if path == "decode":
        return moe_decode.decode_experts(x, w13, w2, weights, ids, config=config, **scales)
    if scales:
        return fp8_fused_experts_triton(x, w13, scales["w13_scale"], w2, scales["w2_scale"],
                                        scales["block"], weights, ids, decode=False)
    return fused_moe.fused_experts_triton(x, w13, w2, weights, ids, decode=False)


def rel_error(out, x, weights, ids, deq) -> float:
    from tllm.kernels.moe import fused_experts_ref
    want = fused_experts_ref(x.float(), deq[0], deq[1], weights, ids)
    return float((out.float() - want).norm() / want.norm())


def bench(name, spec, device, bandwidth, deadline, sweep: bool) -> dict:
    from gpu_fp8 import time_calls
    from tllm.kernels.triton.fused_moe import GemmTile
    from tllm.kernels.triton.moe_decode import (DEFAULT_DECODE_CONFIG, FP8_DECODE_CONFIG,
                                                MoeDecodeConfig)
    w13, w2, scales, deq = make_experts(spec, device)
    expert_bytes = w13[0].numel() * w13.element_size() + w2[0].numel() * w2.element_size()
    rows = {}
    for num_tokens in BATCHES:
        if time.perf_counter() > deadline:
            break
        sets = routings(spec, num_tokens, device)
        distinct = sum(len(set(s[2].flatten().tolist())) for s in sets) / len(sets)
        row = {"floor_us": distinct * expert_bytes / bandwidth * 1e6}
        for path in ("tile", "decode"):
            out = call(path, w13, w2, scales, sets[0])
            row[f"{path}_rel_error"] = rel_error(out, *sets[0], deq)
            row[f"{path}_us"] = time_calls([lambda s=s, p=path: call(p, w13, w2, scales, s)
                                            for s in sets], device)[0]
        if sweep and num_tokens == 1:
            best = FP8_DECODE_CONFIG if scales else DEFAULT_DECODE_CONFIG
            for stage, grid in (("gate_up", GATE_UP_GRID), ("down", DOWN_GRID)):
                for tile in (GemmTile(*t) for t in grid):
                    if time.perf_counter() > deadline:
                        break
                    cfg = (MoeDecodeConfig(tile, best.down) if stage == "gate_up"
                           else MoeDecodeConfig(best.gate_up, tile))
                    try:
                        us = time_calls([lambda s=s, c=cfg: call("decode", w13, w2, scales, s, c)
                                         for s in sets], device)[0]
                    except Exception as exc:  # e.g. out of registers: record, go on
                        row.setdefault("errors", []).append(f"{cfg}: {exc}"[:200])
                        continue
                    if us < row.get("best_us", float("inf")):
                        row["best_us"], best = us, cfg
            row["best_config"] = repr(best)
        rows[num_tokens] = row
        print(f"{name:<20}{num_tokens:>3}  floor {row['floor_us']:7.1f} us  tile "
              f"{row['tile_us']:7.1f}  decode {row['decode_us']:7.1f}"
              + (f"  best {row['best_us']:7.1f} {row['best_config']}" if "best_us" in row
                 else "")
              + f"  (rel err tile {row['tile_rel_error']:.1e}, decode "
              f"{row['decode_rel_error']:.1e})", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON results path")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds in all")
    parser.add_argument("--no-sweep", action="store_true", help="time the defaults only")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpreter")
    args = parser.parse_args()
    import torch
    from gpu_fp8 import copy_bandwidth
    smoke = args.cpu_smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    deadline = time.perf_counter() + args.budget
    bandwidth = copy_bandwidth(device, (1 << 20) if smoke else (1 << 30))
    print(f"device {torch.cuda.get_device_name() if not smoke else 'cpu (interpreter)'}; "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    results = {"device": "cpu" if smoke else torch.cuda.get_device_name(),
               "copy_bandwidth_gbs": bandwidth / 1e9, "shapes": {}}
    for name, spec in (SMOKE_SHAPES if smoke else FULL_SHAPES).items():
        if time.perf_counter() > deadline:
            print(f"{name}: skipped (budget)")
            continue
        results["shapes"][name] = bench(name, spec, device, bandwidth, deadline,
                                        sweep=not args.no_sweep)
        torch.cuda.empty_cache() if not smoke else None
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
