"""The gated delta rule's Triton kernels (tllm/kernels/triton/gated_delta.py) against their
torch references, same process, same inputs, in Qwen3-Next-80B's DeltaNet geometry (16 key
heads, 32 value heads, 128 x 128 state per head, fp32 state, bf16 q/k/v), one layer:

  decode   gated_delta_step for S requests at slots of a larger state pool, against the
           reference on the gathered rows (gather, step, scatter, as the torch layer does);
           state bytes = S x heads x 128 x 128 x 4, read and written: GB/s of the kernel
  prefill  gated_delta_prefill over R requests of L tokens each, for kernel chunk sizes
           16, 32, 64, against the reference's chunked form request by request; tokens/s
           and the max abs diff of each chunk size's output from the reference's

Times: CUDA events around calls, median of repeats, after a warm-up (compiles).

    python benchmarks/gpu_gated_delta.py --out $OUT/gated_delta.json
    python benchmarks/gpu_gated_delta.py --cpu-smoke --out /tmp/gd.json   # plumbing, CPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _timed_ms(fn, device, repeats: int) -> float:
    fn()                                       # warm-up: compiles
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def _inputs(num_tokens, heads, dim, device):
    q, k = (torch.randn(num_tokens, heads[0], dim, device=device, dtype=torch.bfloat16)
            for _ in range(2))
    v = torch.randn(num_tokens, heads[1], dim, device=device, dtype=torch.bfloat16)
    g = -torch.rand(num_tokens, heads[1], device=device) * 0.5
    beta = torch.rand(num_tokens, heads[1], device=device)
    return q, k, v, g, beta


def _ref_qk(q, k, heads, dim):
    from tllm.kernels.gated_delta_ref import l2_normalize
    per_k = heads[1] // heads[0]
    q, k = (l2_normalize(t.float()).repeat_interleave(per_k, 1) for t in (q, k))
    return q * dim ** -0.5, k


def bench_decode(sizes, heads, dim, device, repeats):
    from tllm.kernels.gated_delta_ref import gated_delta_step_ref
    from tllm.kernels.triton.gated_delta import gated_delta_step
    rows = []
    for num_seqs in sizes:
        pool = torch.randn(2 * num_seqs, heads[1], dim, dim, device=device) * 0.1
        slots = torch.randperm(2 * num_seqs, device=device)[:num_seqs]
        q, k, v, g, beta = _inputs(num_seqs, heads, dim, device)
        rq, rk = _ref_qk(q, k, heads, dim)

        def torch_step():
            state = pool[slots]
            gated_delta_step_ref(rq, rk, v, g, beta, state)
            pool[slots] = state

        triton_ms = _timed_ms(lambda: gated_delta_step(pool, slots, q, k, v, g, beta,
                                                       dim ** -0.5), device, repeats)
        state_bytes = 2 * num_seqs * heads[1] * dim * dim * 4
        rows.append(dict(num_seqs=num_seqs, triton_ms=triton_ms,
                         torch_ms=_timed_ms(torch_step, device, repeats),
                         triton_gbps=state_bytes / triton_ms / 1e6))
        print("decode", rows[-1], flush=True)
    return rows


def bench_prefill(shapes, heads, dim, device, repeats):
    from tllm.kernels.gated_delta_ref import gated_delta_chunked_ref
    from tllm.kernels.triton.gated_delta import gated_delta_prefill, prefill_chunk
    rows = []
    for num_reqs, length in shapes:
        pool = torch.randn(num_reqs, heads[1], dim, dim, device=device) * 0.1
        slots = torch.arange(num_reqs, device=device)
        q, k, v, g, beta = _inputs(num_reqs * length, heads, dim, device)
        rq, rk = _ref_qk(q, k, heads, dim)
        cu = (torch.arange(num_reqs + 1, device=device) * length).to(torch.int32)

        def torch_prefill():
            return torch.cat([gated_delta_chunked_ref(
                rq[a:a + length], rk[a:a + length], v[a:a + length], g[a:a + length],
                beta[a:a + length], pool[i])[0] for i, a in enumerate(range(0, len(q), length))])

        want = torch_prefill()
        row = dict(num_reqs=num_reqs, length=length,
                   torch_ms=_timed_ms(torch_prefill, device, repeats))
        for chunk in (16, 32, 64):
            def run(chunk=chunk):
                return gated_delta_prefill(pool.clone(), slots, cu, q, k, v, g, beta,
                                           dim ** -0.5, chunk_size=chunk)
            row[f"kernel_chunk_c{chunk}"] = prefill_chunk(chunk, dim)
            row[f"max_diff_c{chunk}"] = (run() - want).abs().max().item()
            row[f"triton_ms_c{chunk}"] = _timed_ms(run, device, repeats)
            row[f"tokens_per_s_c{chunk}"] = num_reqs * length / row[f"triton_ms_c{chunk}"] * 1e3
        rows.append(row)
        print("prefill", row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes on the CPU under the Triton interpreter")
    args = parser.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"    # before any kernel module is imported
        device, heads, dim, repeats = torch.device("cpu"), (1, 2), 16, 1
        decode_sizes, prefill_shapes = [2], [(2, 20)]
    else:
        device, heads, dim, repeats = torch.device("cuda"), (16, 32), 128, 20
        decode_sizes, prefill_shapes = [1, 8, 64, 128, 256], [(1, 4096), (8, 512), (64, 64)]
    torch.manual_seed(0)
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  heads=heads, dim=dim,
                  decode=bench_decode(decode_sizes, heads, dim, device, repeats),
                  prefill=bench_prefill(prefill_shapes, heads, dim, device, repeats))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
