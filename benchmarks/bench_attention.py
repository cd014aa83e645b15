"""Kernel benchmark on Llama-3.1-8B shapes (32 query heads, 8 KV heads, head dim 128, bf16):
Triton paged decode and context attention, RMSNorm (+ residual) and SiLU-and-mul. Each kernel
is checked against its torch reference, then timed beside a comparator measured in the same
run: device-to-device copy bandwidth for the memory-bound kernels, SDPA (flash) for prefill.

    python benchmarks/bench_attention.py [--quick] [--sweep] [--block-size 32]
    python benchmarks/bench_attention.py --smoke   # tiny shapes on the CPU (interpreter)

Prints a short table last; writes every number to $OUT/attention.json when OUT is set.
Exits 1 if any correctness check failed."""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # before any kernel module is imported
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from tllm.kernels.paged import gather_kv  # noqa: E402
from tllm.attention.testing import make_paged_batch, relative_error  # noqa: E402
from tllm.kernels.triton.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from tllm.kernels.triton.attention_ref import paged_attention_ref  # noqa: E402
from tllm.kernels.triton.context_attention import (ContextConfig,  # noqa: E402
                                                   paged_context_attention)
from tllm.kernels.triton.decode_attention import (DecodeConfig, choose_num_splits,  # noqa: E402
                                                  paged_decode_attention)
from tllm.kernels.triton.kv_cache import write_kv  # noqa: E402
from tllm.kernels.triton.rmsnorm import rms_norm, rms_norm_ref  # noqa: E402
from tllm.layers.activation import SiluAndMul  # noqa: E402
from tllm.layers.norm import RMSNorm  # noqa: E402

DTYPE = torch.bfloat16
TOL = 1e-2
KV_LIMIT_BYTES = 60e9
FULL = dict(heads=(32, 8, 128), decode=[(b, c) for c in (512, 4096, 32768)
                                        for b in (1, 8, 64, 256)],
            context=[(1, 4096, 0), (4, 2048, 0), (16, 512, 0), (1, 16384, 0), (4, 1024, 3072)],
            tokens=[1, 16, 128, 1024, 4096, 8192], hidden=4096, intermediate=14336)
QUICK = dict(FULL, decode=[(1, 4096), (64, 4096), (1, 32768), (64, 32768)],
             context=[(1, 4096, 0), (4, 1024, 3072)], tokens=[1, 1024, 8192])
SMOKE = dict(heads=(4, 2, 64), decode=[(2, 300)], context=[(1, 40, 0), (2, 24, 40)],
             tokens=[3], hidden=256, intermediate=512)
# --sweep: tile configs tried beside the defaults, to pick better defaults from one run
DECODE_SWEEP = [DecodeConfig(32, 4, 3), DecodeConfig(64, 4, 2), DecodeConfig(64, 4, 4),
                DecodeConfig(128, 4, 2), DecodeConfig(128, 8, 3)]
CONTEXT_SWEEP = [ContextConfig(128, 128, 8, 3), ContextConfig(128, 64, 8, 4),
                 ContextConfig(128, 128, 8, 2), ContextConfig(64, 64, 4, 3),
                 ContextConfig(128, 32, 4, 4)]


class Bench:
    def __init__(self, device: torch.device, block_size: int, sweep: bool) -> None:
        self.device = device
        self.block_size = block_size
        self.sweep = sweep
        self.failures: list[str] = []

    def time_ms(self, fn, graph: bool = False) -> float:
        """Median ms. Eager timing flushes L2 between runs; graph timing shows the kernel
        without Python launch overhead, as the engine runs decode under CUDA graphs."""
        if self.device.type != "cuda":
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        if graph:
            return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")

    def check(self, what: str, err: float) -> float:
        if not err < TOL:  # NaN fails too
            self.failures.append(f"{what}: relative error {err:.3g}")
        return err

    def sweep_configs(self, name: str, configs, run, error, graph: bool = False) -> list[dict]:
        """Times run(config) for each config; a config that fails to build is recorded."""
        rows = []
        for cfg in configs if self.sweep else []:
            try:
                run(cfg)
                err = self.check(f"{name} {cfg}", error())
                rows.append(dict(config=vars(cfg), rel_err=err,
                                 us=self.time_ms(lambda: run(cfg), graph) * 1e3))
            except Exception as exc:  # e.g. out of shared memory on this GPU
                rows.append(dict(config=vars(cfg), error=repr(exc)[:300]))
        return rows


def copy_bandwidth(bench: Bench) -> float:
    """Bytes moved (read + write) per second by a large tensor copy: the roofline here."""
    nbytes = 4 << 30 if bench.device.type == "cuda" else 1 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=bench.device)
    dst = torch.empty_like(src)
    ms = bench.time_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def subset_error(batch, out: torch.Tensor, seq_ids: list[int], scale: float,
                 last_queries: int = 256) -> float:
    """fp32 reference for the last `last_queries` queries of a few sequences (the full
    reference of a long prefill would not fit in memory)."""
    m = batch.metadata
    starts = m.query_start_loc.tolist()
    rows, lens = [], []
    for i in seq_ids:
        n = min(last_queries, starts[i + 1] - starts[i])
        rows.append(torch.arange(starts[i + 1] - n, starts[i + 1], device=out.device))
        lens.append(n)
    rows = torch.cat(rows)
    qsl = torch.tensor([0] + lens, device=out.device).cumsum(0).to(torch.int32)
    ref = paged_attention_ref(batch.q[rows], *batch.kv_cache, m.block_tables[seq_ids], qsl,
                              m.seq_lens[seq_ids], scale)
    return relative_error(out[rows], ref)


def bench_decode(bench: Bench, heads, batch: int, context: int, copy_bw: float) -> dict:
    num_heads, num_kv_heads, head_dim = heads
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * DTYPE.itemsize
    row = dict(batch=batch, context=context, kv_gb=kv_bytes / 1e9)
    if kv_bytes > KV_LIMIT_BYTES:
        return dict(row, skipped="KV does not fit in 60 GB")
    b = make_paged_batch([1] * batch, [context - 1] * batch, num_heads, num_kv_heads, head_dim,
                         bench.block_size, DTYPE, bench.device)
    m, scale = b.metadata, head_dim ** -0.5
    write_kv(b.k, b.v, *b.kv_cache, m.slot_mapping)
    out = torch.empty_like(b.q)

    def run(config=None):
        paged_decode_attention(b.q, *b.kv_cache, m.block_tables, m.query_start_loc, m.seq_lens,
                               m.max_seq_len, scale, out=out, config=config)

    def error():
        return subset_error(b, out, sorted({0, batch - 1}), scale)
    name = f"decode b{batch} ctx{context}"
    run()
    err = bench.check(name, error())
    eager_ms = bench.time_ms(run)
    graph_ms = bench.time_ms(run, graph=True)
    read_bw = kv_bytes / (graph_ms * 1e-3)
    sweep = bench.sweep_configs(name, DECODE_SWEEP, run, error, graph=True)
    return dict(row, rel_err=err, eager_us=eager_ms * 1e3, graph_us=graph_ms * 1e3,
                num_splits=choose_num_splits(batch, num_kv_heads, context, bench.device),
                kv_read_gbps=read_bw / 1e9, frac_of_copy=read_bw / copy_bw, sweep=sweep,
                best_us=min([r["us"] for r in sweep if "us" in r] + [graph_ms * 1e3]))


def sdpa_inputs(batch, num_seqs: int, q_len: int, num_heads: int, num_kv_heads: int):
    """The same data as the paged batch, contiguous: q [B, Hq, S, D], k/v [B, Hkv, L, D]."""
    m = batch.metadata
    q = batch.q.view(num_seqs, q_len, num_heads, -1).transpose(1, 2).contiguous()
    kv = [gather_kv(batch.kv_cache, m.block_tables[i], m.seq_lens_cpu[i], m.tokens_per_block)
          for i in range(num_seqs)]
    k = torch.stack([k for k, _ in kv]).transpose(1, 2).contiguous()
    v = torch.stack([v for _, v in kv]).transpose(1, 2).contiguous()
    return q, k, v


def make_sdpa(q, k, v, prefix: int, scale: float, flash: bool):
    """SDPA over the same data. K/V heads are repeated to the query heads: flash attention
    reads them per query head either way, and torch's lower-right causal path (the prefix
    case) calls the flash kernel directly, without GQA support."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = causal_lower_right(q.shape[2], k.shape[2]) if prefix else None
    backend = SDPBackend.FLASH_ATTENTION if flash else SDPBackend.MATH

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not prefix,
                                                  scale=scale)
    return run


def bench_context(bench: Bench, heads, num_seqs: int, q_len: int, prefix: int) -> dict:
    num_heads, num_kv_heads, head_dim = heads
    b = make_paged_batch([q_len] * num_seqs, [prefix] * num_seqs, num_heads, num_kv_heads,
                         head_dim, bench.block_size, DTYPE, bench.device)
    m, scale = b.metadata, head_dim ** -0.5
    write_kv(b.k, b.v, *b.kv_cache, m.slot_mapping)
    out = torch.empty_like(b.q)

    def run(config=None):
        paged_context_attention(b.q, *b.kv_cache, m.block_tables, m.query_start_loc,
                                m.seq_lens, m.max_query_len, scale, out=out, config=config)

    def error():
        return subset_error(b, out, sorted({0, num_seqs - 1}), scale)
    run()
    name = f"context b{num_seqs} q{q_len} prefix{prefix}"
    err = bench.check(name, error())
    sdpa = make_sdpa(*sdpa_inputs(b, num_seqs, q_len, num_heads, num_kv_heads), prefix, scale,
                     flash=bench.device.type == "cuda")
    sdpa_out = sdpa().transpose(1, 2).reshape(out.shape)
    agree = bench.check(name + " vs sdpa", relative_error(out, sdpa_out.float()))
    flops = 4 * num_heads * head_dim * num_seqs * (q_len * prefix + q_len * (q_len + 1) / 2)
    ms, sdpa_ms = bench.time_ms(run), bench.time_ms(sdpa)
    sweep = bench.sweep_configs(name, CONTEXT_SWEEP, run, error)
    best_ms = min([r["us"] / 1e3 for r in sweep if "us" in r] + [ms])
    return dict(batch=num_seqs, q_len=q_len, prefix=prefix, rel_err=err, rel_err_vs_sdpa=agree,
                ms=ms, sdpa_ms=sdpa_ms, tflops=flops / ms / 1e9,
                sdpa_tflops=flops / sdpa_ms / 1e9, speedup_vs_sdpa=sdpa_ms / ms, sweep=sweep,
                best_speedup_vs_sdpa=sdpa_ms / best_ms)


def bench_rmsnorm(bench: Bench, tokens: int, hidden: int, copy_bw: float) -> dict:
    x, r = (torch.randn(tokens, hidden, dtype=DTYPE, device=bench.device) for _ in range(2))
    module = RMSNorm(hidden, 1e-6).to(device=bench.device, dtype=DTYPE)
    module.weight.data.normal_()
    err = bench.check(f"rmsnorm t{tokens}", relative_error(
        rms_norm(x, module.weight, 1e-6, r)[0], rms_norm_ref(x, module.weight, 1e-6, r)[0]))
    nbytes = (4 * tokens * hidden + hidden) * DTYPE.itemsize  # x, r, w in; out, residual out
    return _bandwidth_row(bench, tokens, err, nbytes, copy_bw,
                          lambda: rms_norm(x, module.weight, 1e-6, r), lambda: module(x, r))


def bench_silu(bench: Bench, tokens: int, intermediate: int, copy_bw: float) -> dict:
    x = torch.randn(tokens, 2 * intermediate, dtype=DTYPE, device=bench.device)
    err = bench.check(f"silu_and_mul t{tokens}",
                      relative_error(silu_and_mul(x), silu_and_mul_ref(x)))
    nbytes = 3 * tokens * intermediate * DTYPE.itemsize
    module = SiluAndMul()
    return _bandwidth_row(bench, tokens, err, nbytes, copy_bw, lambda: silu_and_mul(x),
                          lambda: module(x))


def _bandwidth_row(bench, tokens, err, nbytes, copy_bw, ours, theirs) -> dict:
    ms, torch_ms = bench.time_ms(ours), bench.time_ms(theirs)
    return dict(tokens=tokens, rel_err=err, us=ms * 1e3, torch_us=torch_ms * 1e3,
                gbps=nbytes / ms / 1e6, frac_of_copy=nbytes / (ms * 1e-3) / copy_bw,
                torch_frac_of_copy=nbytes / (torch_ms * 1e-3) / copy_bw)


def run_all(bench: Bench, shapes: dict) -> dict:
    heads = shapes["heads"]
    copy_bw = copy_bandwidth(bench)
    results = dict(copy_gbps=copy_bw / 1e9, decode=[], context=[], rmsnorm=[],
                   silu_and_mul=[])
    for batch, context in shapes["decode"]:
        results["decode"].append(bench_decode(bench, heads, batch, context, copy_bw))
        _release(bench)
    for num_seqs, q_len, prefix in shapes["context"]:
        results["context"].append(bench_context(bench, heads, num_seqs, q_len, prefix))
        _release(bench)
    for tokens in shapes["tokens"]:
        results["rmsnorm"].append(bench_rmsnorm(bench, tokens, shapes["hidden"], copy_bw))
        results["silu_and_mul"].append(bench_silu(bench, tokens, shapes["intermediate"],
                                                  copy_bw))
    return results


def _release(bench: Bench) -> None:
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()


def print_tables(results: dict) -> None:
    print(f"\ncopy bandwidth {results['copy_gbps']:.0f} GB/s (read + write)")
    print("\ndecode      batch context    KV GB  splits  graph us  eager us   GB/s  of copy"
          "  sweep gain")
    for r in results["decode"]:
        if "skipped" in r:
            print(f"{'':10}{r['batch']:>6}{r['context']:>8}  skipped: {r['skipped']}")
            continue
        print(f"{'':10}{r['batch']:>6}{r['context']:>8}{r['kv_gb']:>9.3f}{r['num_splits']:>8}"
              f"{r['graph_us']:>10.1f}{r['eager_us']:>10.1f}{r['kv_read_gbps']:>7.0f}"
              f"{r['frac_of_copy']:>8.0%}{r['graph_us'] / r['best_us']:>9.2f}x")
    print("\ncontext     batch   q_len  prefix     ms  TFLOP/s  SDPA TFLOP/s  vs SDPA  best cfg")
    for r in results["context"]:
        print(f"{'':10}{r['batch']:>6}{r['q_len']:>8}{r['prefix']:>8}{r['ms']:>7.2f}"
              f"{r['tflops']:>9.1f}{r['sdpa_tflops']:>14.1f}{r['speedup_vs_sdpa']:>8.2f}x"
              f"{r['best_speedup_vs_sdpa']:>6.2f}x")
    for name in ("rmsnorm", "silu_and_mul"):
        print(f"\n{name:<14}tokens      us  torch us   GB/s  of copy  torch of copy")
        for r in results[name]:
            print(f"{'':14}{r['tokens']:>6}{r['us']:>8.1f}{r['torch_us']:>10.1f}"
                  f"{r['gbps']:>7.0f}{r['frac_of_copy']:>9.0%}{r['torch_frac_of_copy']:>15.0%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes of each kind")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under the Triton interpreter")
    parser.add_argument("--sweep", action="store_true",
                        help="also time a few other tile configs (\"best\" columns)")
    parser.add_argument("--block-size", type=int, default=32, help="tokens per KV block")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke)")
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = SMOKE if args.smoke else QUICK if args.quick else FULL
    torch.manual_seed(0)
    bench = Bench(device, args.block_size, args.sweep)
    results = run_all(bench, shapes)
    results.update(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
        torch=torch.__version__, triton=triton.__version__, command=" ".join(sys.argv),
        block_size=args.block_size, heads=shapes["heads"], failures=bench.failures)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "attention.json"
        path.write_text(json.dumps(results, indent=1, default=_json_safe))
        print(f"wrote {path}")
    print_tables(results)
    for failure in bench.failures:
        print("FAILED", failure)
    return 1 if bench.failures else 0


def _json_safe(value):
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)


if __name__ == "__main__":
    sys.exit(main())
