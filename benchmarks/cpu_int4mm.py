"""One SmolLM2 linear on the CPU at 1 and 32 rows: the exact 4-bit path (a Q4_1 weight as
torch's int4 kernel holds it) against the default int8 path and dense products, in the same
run (issue 40: can the exact path be the default?).

Comparators, each ms per call, median of --repeats timed blocks:
- "int4 bf16": `_weight_int4pack_mm_for_cpu` with bf16 activations, scales and zeros (what
  quantization="gguf_int4" runs): the file's 4-bit values, scales rounded to bf16;
- "int4 fp32": the same kernel with float32 activations (exact to ~1e-7, a scalar loop);
- "int4 widened fp32": the exact weight decoded a slice at a time into a float32 scratch
  buffer ((q - 8) * scale + zero, torch ops) and multiplied by sgemm: exact, never the whole
  weight widened at once;
- "int8 path": tllm.kernels.int8_cpu.int8_matmul as the default dispatches it (GEMV kernel for
  one row, int8 widened to bf16 a slice at a time for 32);
- "dense fp32" / "dense bf16": F.linear on the dequantized weight.

    python benchmarks/cpu_int4mm.py --threads 2 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from tllm.kernels.int8_cpu import int8_matmul

SHAPES = {"qkv_proj": (960, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}
GROUP = 32
SLICE_ROWS = 192  # input rows (of K) decoded at a time by the widened path


def ms_per_call(fn, repeats: int, budget_s: float = 0.05) -> float:
    fn()
    start = time.perf_counter()
    fn()
    calls = max(1, int(budget_s / max(time.perf_counter() - start, 1e-6)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def widened_fp32(x: torch.Tensor, q_t: torch.Tensor, scale_t: torch.Tensor,
                 zero_t: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the weight stored transposed: q_t int8 [K, N] (q - 8), scale/zero
    [K / 32, 1, N] float32; decoded SLICE_ROWS input rows at a time (the broadcast then runs
    along N, contiguous, which torch vectorises)."""
    k, n = q_t.shape
    out = torch.zeros(x.shape[0], n)
    for start in range(0, k, SLICE_ROWS):
        stop = min(start + SLICE_ROWS, k)
        wide = buf[:stop - start].copy_(q_t[start:stop])
        groups = slice(start // GROUP, stop // GROUP)
        part = wide.view(-1, GROUP, n)
        torch.addcmul(zero_t[groups], part, scale_t[groups], out=part)
        out.addmm_(x[:, start:stop], wide)
    return out


def one_shape(n: int, k: int, rows: int, repeats: int) -> dict[str, float]:
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale = torch.rand(n, k // GROUP) * 2e-3 + 5e-4
    zero = torch.randn(n, k // GROUP) * 1e-3
    weight = ((q.float() - 8).view(n, -1, GROUP) * scale[..., None] + zero[..., None]).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack((scale.t(), zero.t()), dim=-1).contiguous()
    q8, s8 = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16()
    q_t = (q - 8).to(torch.int8).t().contiguous()
    scale_t, zero_t = scale.t().contiguous()[:, None], zero.t().contiguous()[:, None]
    buf = torch.empty(SLICE_ROWS, n)
    x = torch.randn(rows, k)
    xb, wb, szb = x.bfloat16(), weight.bfloat16(), sz.bfloat16()
    int4 = torch.ops.aten._weight_int4pack_mm_for_cpu
    out = {"int4 bf16": ms_per_call(lambda: int4(xb, packed, GROUP, szb), repeats),
           "int4 fp32": ms_per_call(lambda: int4(x, packed, GROUP, sz), 1, 0.0),
           "int4 widened fp32": ms_per_call(
               lambda: widened_fp32(x, q_t, scale_t, zero_t, buf), repeats),
           "int8 path": ms_per_call(lambda: int8_matmul(xb, q8, s8), repeats),
           "dense fp32": ms_per_call(lambda: F.linear(x, weight), repeats),
           "dense bf16": ms_per_call(lambda: F.linear(xb, wb), repeats)}
    ref = x.double() @ weight.double().t()
    got = widened_fp32(x, q_t, scale_t, zero_t, buf).double()
    out["widened rel err"] = ((got - ref).norm() / ref.norm()).item()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    table = {f"{name} {n}x{k} M={rows}": one_shape(n, k, rows, args.repeats)
             for rows in (1, 32) for name, (n, k) in SHAPES.items()}
    columns = [c for c in next(iter(table.values())) if c != "widened rel err"]
    print("| shape | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for key, entry in table.items():
        print(f"| {key} | " + " | ".join(f"{entry[c]:.3f}" for c in columns) + " |")
    print(json.dumps({k: v["widened rel err"] for k, v in table.items()}))


if __name__ == "__main__":
    main()
