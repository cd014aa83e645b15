"""GGUF kept quantized on the GPU (issue 20, GGUF part) in one device call, ~3 minutes:

  micro  each kernel type's GEMM (tllm.kernels.triton.gguf_gemm.gguf_mm as a layer calls it,
         default configs: the GEMV at M = 1, the fused dequant-dot at M = 32) on Llama-3.1-8B
         shapes (qkv 6144x4096, down 4096x14336), checked against the torch reference, timed
         from CUDA graphs of back-to-back calls cycling over weight copies that do not fit in
         L2; against the weight-read floor (the planes' bytes / the device-to-device copy
         bandwidth measured in the same run) and bf16 torch.matmul on the same shape.
  sweep  benchmarks/gguf_sweep.py (<= 30 s): GEMV tiles x K splits on the e2e model's layer
         shapes (and an 8B one), fused tiles at 32 rows; the best of each shape goes into
         gguf_configs.TUNED for the e2e run and to $OUT/gguf_configs_<device>.json (copy it
         to tllm/kernels/triton/configs/ to make it the device's table); per type, the GEMV
         tiles ranked over its shapes (the per-type default to keep).
  e2e    a GGUF file written in-process with gguf's GGUFWriter: a Llama-3.2-1B-shaped model
         (hidden 2048, 16 layers, 32/8 heads, FFN 8192, vocab 32000 with a tiny tokenizer)
         laid out as a Q4_K_M file (q, k, o, gate, up, token_embd Q4_K; v, down, output
         Q6_K), random blocks with finite scales; `LLM(path)` kept quantized (with the
         sweep's configs) against `LLM(path, quantization="none")` (dequantized to bf16 at
         load): batch-1 decode tok/s at ISL 128 / OSL 256 (tllm.bench.offline.run_latency),
         the weights' resident GPU bytes, the file's size, how many greedy tokens the two
         agree on and, where they part, whether each side's token is in the other's top 5
         (random weights leave near-ties; the Q6_K v inside the merged qkv is re-quantized
         to Q8_0 when kept).

The figures go to $OUT/gpu_gguf.json as they come; a table comes last.

    python benchmarks/gpu_gguf.py [--sections micro,sweep,e2e] [--budget 130] [--shape 1b|8b]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tllm.kernels.gguf import BLOCK_BYTES, KERNEL_TYPES, gguf_mm_ref, pack_planes, planes_view  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "down": (4096, 14336)}
L2_BYTES = 50 * 2 ** 20
MODEL_SHAPES = {  # hidden, layers, heads, kv heads, ffn, vocab
    "1b": (2048, 16, 32, 8, 8192, 32000),
    "8b": (4096, 32, 32, 8, 14336, 32000),
    "tiny": (256, 2, 4, 2, 512, 512),   # a CPU smoke test of the plumbing (--sections e2e)
}
Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}


def random_blocks(qtype: str, rows: int, cols: int, rng, scale: float = 1e-2) -> np.ndarray:
    """uint8 [rows, blocks * bytes]: random bytes, finite fp16 scales of a weight's size."""
    nbytes, values = BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
    offsets = (208,) if qtype == "Q6_K" else ((0, 2) if qtype in ("Q4_1", "Q5_1", "Q4_K",
                                                                  "Q5_K") else (0,))
    for i, offset in enumerate(offsets):
        sign = rng.choice([-1.0, 1.0], raw.shape[:2]) if i == 0 else 1.0
        d = (sign * rng.uniform(0.5, 2.0, raw.shape[:2]) * scale).astype(np.float16)
        raw[..., offset:offset + 2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


# ---- timing ----

def time_calls(fns: list, min_calls: int = 30) -> float:
    """Microseconds per call of fns (cycled), from replays of a CUDA graph of them."""
    for fn in fns:
        fn()
    calls = max(min_calls, len(fns))
    sequence = [fns[i % len(fns)] for i in range(calls)]
    torch.cuda.synchronize()
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
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 ** 30) -> float:
    """Bytes (read + written) per second of a device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    us = time_calls([lambda: dst.copy_(src)], min_calls=10)
    return 2 * nbytes / (us * 1e-6)


def _copies(make, nbytes: int) -> list:
    return [make() for _ in range(max(2, -(-3 * L2_BYTES // nbytes)))]


# ---- micro ----

def section_micro(results: dict, deadline: float) -> None:
    from tllm.kernels.triton.gguf_gemm import gguf_mm
    bandwidth = copy_bandwidth()
    results["micro"] = micro = {"copy_tb_s": bandwidth / 1e12, "shapes": {}}
    rng = np.random.default_rng(0)
    for name, (n, k) in SHAPES.items():
        shape = micro["shapes"][f"{name} {n}x{k}"] = {}
        weights = _copies(lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16),
                          n * k * 2)
        for m in (1, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = time_calls([lambda w=w: torch.matmul(x, w.t()) for w in weights])
            shape[f"bf16 M={m}"] = {"us": us, "weight_bytes": n * k * 2}
        del weights
        for qtype in KERNEL_TYPES:
            if time.perf_counter() > deadline:
                shape[qtype] = "skipped: out of time"
                continue
            blocks = torch.from_numpy(random_blocks(qtype, n, k, rng)).cuda()
            buffer = pack_planes(blocks.reshape(n, k // BLOCK_BYTES[qtype][1], -1), qtype)
            copies = _copies(lambda: buffer.clone(), buffer.numel())
            planes = [planes_view(b, qtype, n, k) for b in copies]
            for m in (1, 32):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                err = _rel(gguf_mm(x, planes[0]), gguf_mm_ref(x, planes[0]))
                us = time_calls([lambda p=p: gguf_mm(x, p) for p in planes])
                floor_us = buffer.numel() / (bandwidth / 2) * 1e6
                bf16_us = shape[f"bf16 M={m}"]["us"]
                shape[f"{qtype} M={m}"] = {
                    "us": us, "rel_err": err, "weight_bytes": buffer.numel(),
                    "achieved_tb_s": buffer.numel() / (us * 1e-6) / 1e12,
                    "floor_us": floor_us, "of_floor": floor_us / us, "vs_bf16": bf16_us / us}
            del copies, planes, buffer, blocks
            torch.cuda.empty_cache()


def make_planes(qtype: str, n: int, k: int, rng=None) -> list:
    """Views of enough copies of one random [n, k] weight's planes to overflow L2."""
    rng = rng or np.random.default_rng(0)
    blocks = torch.from_numpy(random_blocks(qtype, n, k, rng)).cuda()
    buffer = pack_planes(blocks.reshape(n, k // BLOCK_BYTES[qtype][1], -1), qtype)
    return [planes_view(b, qtype, n, k) for b in _copies(lambda: buffer.clone(),
                                                         buffer.numel())]


def section_sweep(results: dict, deadline: float) -> None:
    from gguf_sweep import sweep
    from tllm.kernels.triton import gguf_configs
    best = sweep(results, deadline, make_planes, time_calls, _rel)
    gguf_configs.TUNED.update(best)
    name = gguf_configs.device_file_name(torch.cuda.get_device_name())
    table = gguf_configs.tuned_to_json(best)
    (Path(os.environ.get("OUT", ".")) / name).write_text(table)
    results["tuned"] = {"file": name, "entries": len(best)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if not a.isnan().any() else float("nan")


# ---- e2e ----

def write_model(path: Path, shape: str, rng) -> Path:
    import gguf
    hidden, layers, heads, kv_heads, ffn, vocab = MODEL_SHAPES[shape]
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([2, 3, 3] + [1] * (vocab - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def quantized(name: str, qtype: str, rows: int, cols: int, scale: float) -> None:
        writer.add_tensor(name, random_blocks(qtype, rows, cols, rng, scale),
                          raw_dtype=gguf.GGMLQuantizationType[qtype])

    ones = np.ones(hidden, dtype=np.float32)
    quantized("token_embd.weight", "Q4_K", vocab, hidden, 2e-3)
    writer.add_tensor("output_norm.weight", ones)
    quantized("output.weight", "Q6_K", vocab, hidden, 1e-4)
    rows = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden),
            "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
            "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        for kind, (r, c) in rows.items():
            scale = 1e-4 if Q4_K_M[kind] == "Q6_K" else 1e-3   # ~ 1 / sqrt(cols) weights
            quantized(f"blk.{i}.{kind}.weight", Q4_K_M[kind], r, c, scale)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def held_bytes(model: torch.nn.Module) -> int:
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run_engine(path: Path, quantization: str | None, isl: int, osl: int) -> dict:
    from tllm import LLM, SamplingParams
    from tllm.bench.offline import LatencyConfig, run_latency
    started = time.perf_counter()
    llm = LLM(str(path), dtype="bfloat16" if torch.cuda.is_available() else "float32",
              quantization=quantization, max_batch_size=8,
              max_seq_len=isl + osl + 64)
    out = {"build_s": time.perf_counter() - started}
    with llm:
        model = llm._engine.executor.runner.model
        out["weight_bytes"] = held_bytes(model)
        out["forms"] = sorted({getattr(m.quant, "form", type(m.quant).__name__)
                               for m in model.modules() if hasattr(m, "quant")})
        if torch.cuda.is_available():
            out["memory_allocated_gib"] = torch.cuda.memory_allocated() / 2 ** 30
        latency = run_latency(llm, LatencyConfig(isl=isl, osl=osl, iterations=3))
        out.update({key: latency[key] for key in ("output_tokens_per_s", "tpot_ms", "ttft_ms",
                                                  "latency_s")})
        prompts = [{"prompt_token_ids": list(range(10 + i, 42 + i))} for i in range(4)]
        greedy = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, logprobs=5,
                                                      ignore_eos=True), use_tqdm=False)
        out["greedy"] = [list(o.outputs[0].token_ids) for o in greedy]
        out["top5"] = [[sorted(step) for step in o.outputs[0].logprobs] for o in greedy]
        from tllm.kernels.triton import gguf_configs
        out["tuned_entries"] = len(gguf_configs.TUNED)
    del llm, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def section_e2e(results: dict, deadline: float, shape: str, skip_dense: bool) -> None:
    results["e2e"] = e2e = {"shape": shape, "layout": "Q4_K_M-like (random blocks)"}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        path = write_model(Path(tmp) / f"llama-{shape}-q4_k_m.gguf", shape,
                           np.random.default_rng(1))
        e2e["file_bytes"] = path.stat().st_size
        e2e["write_s"] = time.perf_counter() - started
        _save(results)
        e2e["kept"] = run_engine(path, None, 128, 256)
        _save(results)
        if skip_dense or time.perf_counter() > deadline:  # the whole budget twice over
            e2e["dense"] = "skipped"
            return
        e2e["dense"] = run_engine(path, "none", 128, 256)
    kept, dense = e2e["kept"]["greedy"], e2e["dense"]["greedy"]
    e2e["greedy_agree"] = [_common_prefix(a, b) for a, b in zip(kept, dense)]
    e2e["top5_at_parting"] = [_in_top5(a, b, ta, tb, i) for a, b, ta, tb, i in zip(
        kept, dense, e2e["kept"]["top5"], e2e["dense"]["top5"], e2e["greedy_agree"])]
    e2e["speedup"] = e2e["kept"]["output_tokens_per_s"] / e2e["dense"]["output_tokens_per_s"]


def _in_top5(a: list, b: list, top_a: list, top_b: list, i: int) -> bool | None:
    """Where two greedy runs part (step i): each side's token is in the other's top 5."""
    if i >= min(len(a), len(b)) or i >= min(len(top_a), len(top_b)):
        return None
    return a[i] in top_b[i] and b[i] in top_a[i]


def _common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- output ----

def _save(results: dict) -> None:
    out = Path(os.environ.get("OUT", "."))
    (out / "gpu_gguf.json").write_text(json.dumps(results, indent=1, default=str))


def summary(results: dict) -> str:
    lines = []
    micro = results.get("micro")
    if isinstance(micro, dict):
        lines.append(f" GGUF GEMMs (copy {micro['copy_tb_s']:.2f} TB/s r+w) ".center(96, "="))
        lines.append(f"{'shape':<18}{'op':<12}{'us':>9}{'TB/s':>8}{'floor us':>10}"
                     f"{'of floor':>10}{'vs bf16':>9}{'rel err':>10}")
        for name, ops in micro["shapes"].items():
            for op, v in ops.items():
                if not isinstance(v, dict):
                    lines.append(f"{name:<18}{op:<12} {v}")
                elif "floor_us" not in v:
                    lines.append(f"{name:<18}{op:<12}{v['us']:>9.1f}"
                                 f"{v['weight_bytes'] / v['us'] / 1e6:>8.2f}")
                else:
                    lines.append(f"{name:<18}{op:<12}{v['us']:>9.1f}{v['achieved_tb_s']:>8.2f}"
                                 f"{v['floor_us']:>10.1f}{v['of_floor']:>10.2f}"
                                 f"{v['vs_bf16']:>9.2f}{v['rel_err']:>10.1e}")
    lines += sweep_lines(results)
    e2e = results.get("e2e")
    if isinstance(e2e, dict):
        lines.append(f" LLM(gguf) batch 1, ISL 128 / OSL 256, {e2e['shape']} "
                     f"({e2e.get('file_bytes', 0) / 1e6:.0f} MB file) ".center(96, "="))
        for name in ("kept", "dense"):
            v = e2e.get(name)
            if isinstance(v, dict):
                lines.append(f"{name:<6} {v['output_tokens_per_s']:>8.1f} tok/s  tpot "
                             f"{v['tpot_ms']:.2f} ms  weights {v['weight_bytes'] / 1e6:.0f} MB"
                             f"  build {v['build_s']:.0f} s  forms {v['forms']}")
            elif v is not None:
                lines.append(f"{name:<6} {v}")
        if "speedup" in e2e:
            lines.append(f"kept / dense: {e2e['speedup']:.2f}x; greedy tokens agreed for "
                         f"{e2e['greedy_agree']} of 32; where they part, each in the other's "
                         f"top 5: {e2e.get('top5_at_parting')}; kept ran with "
                         f"{e2e['kept'].get('tuned_entries', 0)} tuned configs")
    for key, value in results.items():
        if key.endswith("_error"):
            lines.append(f"{key}: {value.splitlines()[-1] if value else value}")
    return "\n".join(lines)


def sweep_lines(results: dict) -> list[str]:
    sweep = results.get("sweep")
    if not isinstance(sweep, dict):
        return []
    lines = [" launch sweep (bf16 x; us; the best goes to TUNED) ".center(96, "=")]
    for kind in ("gemv", "fused"):
        for label, e in sweep.get(kind, {}).items():
            default = e.get("default_us")
            lines.append(f"{kind:<6}{label:<28} default "
                         f"{default if not isinstance(default, float) else f'{default:.1f}'}"
                         f"  best {e.get('best_us', float('nan')):.1f}  {e.get('best', '-')}")
    for qtype, ranked in sweep.get("tile_ranking", {}).items():
        lines.append(f"GEMV tiles for {qtype} (geomean of best-split time / shape's best):")
        lines += [f"    {tile}: {ratio:.2f} over {count}" for tile, ratio, count in ranked[:4]]
    if "stopped" in sweep:
        lines.append(f"sweep {sweep['stopped']}")
    if "tuned" in results:
        lines.append(f"tuned configs: {results['tuned']}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default="micro,sweep,e2e")
    parser.add_argument("--budget", type=float, default=220.0)
    parser.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="1b")
    parser.add_argument("--skip-dense", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results = {"device": device, "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:]}
    sections = args.sections.split(",")
    for name in sections:
        # micro and sweep take fixed shares (~25 s, <= 30 s at --budget 130); e2e runs its
        # two engines unless past twice the budget
        seconds = {"micro": 0.2 * args.budget, "sweep": min(30.0, 0.25 * args.budget)}
        deadline = time.perf_counter() + seconds.get(name, 2 * args.budget)
        try:
            if name == "micro":
                section_micro(results, deadline)
            elif name == "sweep":
                section_sweep(results, deadline)
            elif name == "e2e":
                section_e2e(results, deadline, args.shape, args.skip_dense)
        except Exception:
            results[f"{name}_error"] = traceback.format_exc()
            print(results[f"{name}_error"], flush=True)
        _save(results)
    results["total_s"] = time.perf_counter() - start
    _save(results)
    print(summary(results), flush=True)


if __name__ == "__main__":
    main()
