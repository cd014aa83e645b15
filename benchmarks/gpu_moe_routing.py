"""The fused MoE router (tllm/kernels/triton/moe_routing.py, one launch) against the torch
routing it replaces, same process, same logits, T tokens of one MoE layer:

  qwen3-30b-a3b  E=128, k=8, softmax, top-k, renormalised, bf16 logits
  deepseek-v3    E=256, k=8, sigmoid + correction bias, 8 groups keep 4 (top-2 sums),
                 renormalised, x2.5, fp32 logits (the router runs in fp32)

Per shape and T in 1, 256, 4096: ids equal to the reference's (fraction of tokens) and the
largest weight difference; then, per call, the kernel, the torch reference
(route_experts_ref) and the torch code the models ran before (torch.topk instead of a stable
sort), each alone and followed by align_pairs (the sort/pad the expert GEMMs read):
  eager   CUDA events around a loop of calls, divided by the calls
  graph   the same loop captured in one CUDA graph and replayed (a decode step's case)
Median of repeats after a warm-up that compiles.

    python benchmarks/gpu_moe_routing.py --out $OUT/moe_routing.json
    python benchmarks/gpu_moe_routing.py --cpu-smoke --out /tmp/r.json   # plumbing, CPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

SHAPES = {
    "qwen3-30b-a3b": dict(num_experts=128, dtype=torch.bfloat16, bias=False,
                          routing=dict(top_k=8, renormalize=True)),
    "deepseek-v3": dict(num_experts=256, dtype=torch.float32, bias=True,
                        routing=dict(top_k=8, num_groups=8, topk_group=4, scoring="sigmoid",
                                     renormalize=True, scaling_factor=2.5)),
}
BLOCK_M = 16  # the decode tile of fused_moe's configs


def _torch_before(logits, routing, bias):
    """The routing code the models ran before the kernel (torch.topk)."""
    if bias is None:
        weights, ids = torch.softmax(logits.float(), dim=-1).topk(routing.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids
    scores = logits.float().sigmoid()
    grouped = (scores + bias).view(logits.shape[0], routing.num_groups, -1)
    best = grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(routing.topk_group, dim=-1)[1]
    keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
    choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
    ids = choice.topk(routing.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling_factor, ids


def _time_ms(fn, device, repeats: int, calls: int, graph: bool) -> float:
    """Median ms per call of `fn`, over `calls` calls a sample (in one CUDA graph if asked)."""
    def loop():
        for _ in range(calls):
            fn()
    loop()  # warm-up: compiles
    if device.type != "cuda":
        began = time.perf_counter()
        loop()
        return (time.perf_counter() - began) * 1e3 / calls
    run = loop
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            loop()
        run = cuda_graph.replay
    run()
    times = []
    for _ in range(repeats):
        start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        run()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / calls)
    return statistics.median(times)


def _check(logits, routing, bias) -> dict:
    from tllm.kernels.moe_routing import route_experts_kernel, route_experts_ref
    weights, ids = route_experts_kernel(logits, routing, bias)
    ref_weights, ref_ids = route_experts_ref(logits, routing, bias)
    same = (ids.long() == ref_ids).all(dim=-1)
    diff = (weights - ref_weights)[same].abs().max().item() if same.any() else float("nan")
    return dict(ids_equal_fraction=same.float().mean().item(), max_weight_diff=diff)


def bench_shape(name, spec, sizes, device, repeats, calls, graph) -> list[dict]:
    from tllm.kernels.moe_routing import MoeRouting, route_experts_kernel, route_experts_ref
    from tllm.kernels.triton.fused_moe import align_pairs
    routing = MoeRouting(**spec["routing"])
    num_experts = spec["num_experts"]
    bias = torch.randn(num_experts, device=device) * 0.5 if spec["bias"] else None
    paths = {"kernel": route_experts_kernel, "torch_ref": route_experts_ref,
             "torch_before": _torch_before}
    rows = []
    for num_tokens in sizes:
        logits = torch.randn(num_tokens, num_experts, device=device).to(spec["dtype"])
        row = dict(shape=name, num_tokens=num_tokens, **_check(logits, routing, bias))
        for path, route in paths.items():
            def alone(route=route):
                return route(logits, routing, bias)

            def with_sort(route=route):
                return align_pairs(route(logits, routing, bias)[1], num_experts, BLOCK_M)
            for mode in ("eager", "graph") if graph else ("eager",):
                is_graph = mode == "graph"
                row[f"{path}_{mode}_us"] = 1e3 * _time_ms(alone, device, repeats, calls,
                                                          is_graph)
                row[f"{path}+sort_{mode}_us"] = 1e3 * _time_ms(with_sort, device, repeats,
                                                               calls, is_graph)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _table(rows, modes) -> str:
    cols = [f"{path}{sort}_{mode}_us" for mode in modes for sort in ("", "+sort")
            for path in ("kernel", "torch_ref", "torch_before")]
    lines = ["shape            T     ids_eq  " + "  ".join(c.removesuffix("_us") for c in cols)]
    for row in rows:
        lines.append(f"{row['shape']:<15} {row['num_tokens']:>5}  "
                     f"{row['ids_equal_fraction']:6.4f}  "
                     + "  ".join(f"{row[c]:{len(c) - 3}.1f}" for c in cols))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny sizes on the CPU under the Triton interpreter")
    args = parser.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"    # before any kernel module is imported
        device, sizes, repeats, calls, graph = torch.device("cpu"), [1, 5], 1, 1, False
    else:
        device, sizes, repeats, calls, graph = torch.device("cuda"), [1, 256, 4096], 21, 50, True
    torch.manual_seed(0)
    rows = [row for name, spec in SHAPES.items()
            for row in bench_shape(name, spec, sizes, device, repeats, calls, graph)]
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  calls_per_sample=calls, repeats=repeats, rows=rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(_table(rows, ("eager", "graph") if graph else ("eager",)))


if __name__ == "__main__":
    main()
