"""Issue 17's GPU figures in one device call: MoE models, the fused MoE kernel, and the
sliding-window KV capacity.

  floor      device-to-device copy bandwidth (the roofline every floor below divides)
  kernel     benchmarks/gpu_moe_kernel.py: the fused MoE kernels against a per-expert loop
             of torch matmuls, in Mixtral-8x7B and Qwen3-30B-A3B shapes
  mixtral    dummy:mixtral-8x7b, bf16: batch-1 decode (ISL 128 / OSL 256) against the
             weight-read floor of the active experts, and ISL/OSL 128/128 max-load
             throughput (1,000 requests)
  qwen3moe   the same for dummy:qwen3-30b-a3b
  mixtral_fp8  the mixtral part with quantization="fp8" (FP8 W8A8 experts and linears,
             quantized at load; the floor counts their fp8 bytes); not in the default parts:
             --parts floor,mixtral,mixtral_fp8
  gptoss     the same for dummy:gpt-oss-20b (MXFP4 experts through the dequant-in-GEMM
             kernels, attention sinks); not in the default parts: --parts floor,gptoss
  nemotron   the same for dummy:nemotron-h-8b (Mamba-2 layers with their per-request state,
             4 attention layers), with its state bytes per request beside the KV bytes of
             an 8k-token request (its own attention layers, and all-attention of its width)
  nemotron_bf16state  the nemotron part with KvCacheConfig(mamba_ssm_cache_dtype="bfloat16")
             (half the state a decode step reads and writes)
  qwen3next  dummy:qwen3-next-80b-a3b-24l (24 of Qwen3-Next-80B-A3B's 48 layers, ~80 GB:
             gated DeltaNet state, 512 experts), with its state beside the KV at 8k
  llama4     dummy:llama-4-scout-24l (24 of Llama-4-Scout's 48 layers, ~111 GB: an H200
             only; chunked attention, top-1 experts + a shared expert)
  qwen3next12, llama4_12  the same two models with 12 layers (~40 / ~55 GB: one H100)
  qwen3moe_fp8kv, mixtral_fp8_fp8kv  qwen3moe and mixtral_fp8 with an fp8 KV cache (twice
             the tokens in the same memory: max load where KV capacity bounds the batch, as
             on an H100)
  window     benchmarks/sliding_window_capacity.py on dummy:gemma-2-9b: concurrent
             requests that fit with and without window-aware KV in the same memory

Each part runs in its own process (a model's memory is gone when the next one starts) with
its share of the budget; results go to $OUT/models.json and the log to $OUT/models.log.

    python benchmarks/gpu_models.py [--parts floor,kernel,mixtral,qwen3moe,window]
        [--budget 560]
    python benchmarks/gpu_models.py --smoke    # the plumbing on the CPU, tiny models
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

PARTS = ("floor", "kernel", "mixtral", "qwen3moe", "window")
MODELS = {"mixtral": "dummy:mixtral-8x7b", "qwen3moe": "dummy:qwen3-30b-a3b",
          "gptoss": "dummy:gpt-oss-20b", "nemotron": "dummy:nemotron-h-8b",
          "mixtral_fp8": "dummy:mixtral-8x7b", "qwen3next": "dummy:qwen3-next-80b-a3b-24l",
          "llama4": "dummy:llama-4-scout-24l", "nemotron_bf16state": "dummy:nemotron-h-8b",
          "qwen3next12": "dummy:qwen3-next-80b-a3b-12l", "llama4_12": "dummy:llama-4-scout-12l",
          "qwen3moe_fp8kv": "dummy:qwen3-30b-a3b", "mixtral_fp8_fp8kv": "dummy:mixtral-8x7b"}
# a part's `quantization`; None for the rest
QUANTIZATION = {"mixtral_fp8": "fp8", "mixtral_fp8_fp8kv": "fp8"}
# a part's KvCacheConfig fields (the rest: the defaults)
KV_OPTIONS = {"nemotron_bf16state": {"mamba_ssm_cache_dtype": "bfloat16"},
              "qwen3moe_fp8kv": {"dtype": "fp8"}, "mixtral_fp8_fp8kv": {"dtype": "fp8"}}
# parts whose per-request state slots (held from start-up, max_batch_size of them) must
# stay small: Nemotron-H-8B's fp32 SSM state is ~100 MB a request
PART_MAX_BATCH = {"nemotron": 256, "nemotron_bf16state": 256}
# each part's weight in sharing --budget (seconds at the 560 s default)
SHARES = {"floor": 20, "kernel": 75, "mixtral": 195, "qwen3moe": 170, "window": 160,
          "gptoss": 195, "nemotron": 195, "mixtral_fp8": 195, "qwen3next": 195,
          "llama4": 195, "nemotron_bf16state": 195, "qwen3next12": 195, "llama4_12": 195,
          "qwen3moe_fp8kv": 170, "mixtral_fp8_fp8kv": 195}
FLOOR_CONVENTION = ("floor tok/s at batch 1 = copy bandwidth / bytes one decode step must "
                    "read: every non-expert parameter (LM head included; the input "
                    "embedding counted apart) plus top_k experts' weights per MoE layer")


def active_weight_bytes(model: str, dtype: torch.dtype, quantization: str | None = None) -> dict:
    """Bytes a batch-1 decode step reads, from the model tllm builds (on the meta device:
    no memory), in the checkpoint's own format (MXFP4 experts: blocks and scales) or the
    one `quantization` converts it to at load. Expert weights are the experts' parameters
    with the experts as first dim (biases too)."""
    from tllm import loader
    from tllm.attention import get_attention_backend
    from tllm.layers.linear import process_loaded_weights
    source = loader.resolve_model(model)
    config, _ = loader.load_config(source)
    built = loader.build_model(config, get_attention_backend("torch"), dtype,
                               torch.device("meta"), 64,
                               loader.quant_config(source, config, quantization))
    if quantization is not None:
        process_loaded_weights(built)  # the run-time form (fp8 weights and their scales)
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
    top_k = getattr(config, "num_experts_per_tok", 0)
    dense = experts = embedding = 0
    for name, p in built.named_parameters():
        size = p.numel() * p.element_size()
        if num_experts and p.dim() >= 2 and p.shape[0] == num_experts and ".experts." in name:
            experts += size
        else:
            dense += size
            embedding += size if name.split(".")[-2] in ("embed_tokens", "embeddings") else 0
    active = dense + (experts * top_k // num_experts if num_experts else 0)
    return {"total_bytes": dense + experts, "active_bytes": active, "embedding_bytes": embedding,
            "num_experts": num_experts, "top_k": top_k, **state_memory(built, config, dtype)}


def state_memory(built, config, dtype: torch.dtype, tokens: int = 8192) -> dict:
    """A hybrid's per-request state against the KV of a `tokens`-token request: its own
    attention layers' KV, and the KV if every layer were attention of the same geometry."""
    state_spec = getattr(built, "state_spec", None)
    if state_spec is None:
        return {}
    state = state_spec.bytes_per_request(dtype)
    kv = built.kv_cache_spec
    size = torch.empty((), dtype=dtype).element_size()
    per_layer = kv.bytes_per_token(size) * tokens
    return {"state_bytes_per_request": state, "state_layers": state_spec.num_layers,
            "kv_tokens": tokens, "kv_bytes_per_request": kv.num_layers * per_layer,
            "all_attention_kv_bytes": (kv.num_layers + state_spec.num_layers) * per_layer}


def part_floor(budget_s: float, smoke: bool) -> dict:
    from gpu_fastpath import copy_bandwidth
    device = torch.device("cpu" if smoke else "cuda")
    nbytes = (64 << 20) if smoke else (4 << 30)
    result = {"copy_bw_gbs": copy_bandwidth(device, nbytes) / 1e9, "copy_bytes": nbytes}
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the children need the memory the copy took
    return result


def lean_graphs(max_batch_size: int) -> dict:
    """Fewer CUDA graphs than the engine's default (powers of two; five token buckets): a
    MoE model's build compiles Triton kernels for every captured shape, which took GPT-OSS
    past a 60 s share on an H100. Decode at max load runs full batches (an exact size); a
    prompt step pads to a coarser bucket."""
    from tllm import CudaGraphConfig
    sizes = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size]
    return {"cuda_graph_config": CudaGraphConfig(
        batch_sizes=sorted({*sizes, max_batch_size}),
        token_buckets=[256, 1024, 2048, 4096, 8192])}


def part_model(model: str, budget_s: float, smoke: bool, copy_bw_gbs: float | None,
               quantization: str | None = None, max_batch_size: int = 256,
               full_graphs: bool = False, kv_options: dict | None = None) -> dict:
    from tllm import LLM, KvCacheConfig
    from tllm.bench.offline import LatencyConfig, ThroughputConfig, run_latency, run_throughput
    from tllm.bench.offline_cli import format_report
    deadline = time.perf_counter() + budget_s
    dtype = "float32" if smoke else "bfloat16"
    result = {"model": model, "dtype": dtype, "quantization": quantization,
              "weights": active_weight_bytes(model, getattr(torch, dtype), quantization)}
    if not smoke and result["weights"]["total_bytes"] > 0.9 * torch.cuda.mem_get_info()[0]:
        result["skipped"] = (f"{result['weights']['total_bytes'] / 1e9:.1f} GB of weights do not "
                             f"fit {torch.cuda.get_device_name()}")
        print(result["skipped"], flush=True)
        return result
    latency_shape, tput = ((8, 16), (16, 8, 24)) if smoke else ((128, 256), (128, 128, 1000))
    kwargs = {"dtype": dtype, "device": "cpu" if smoke else "cuda",
              "max_seq_len": 512 if not smoke else 64, "quantization": quantization}
    if kv_options:
        kwargs["kv_cache_config"] = KvCacheConfig(**kv_options)
        result["kv_options"] = kv_options
    started = time.perf_counter()
    # one engine for both (a second one would need the first's weights gone first)
    result["max_batch_size"] = max_batch_size = 8 if smoke else max_batch_size
    if not smoke and not full_graphs:
        kwargs.update(lean_graphs(max_batch_size))
    result["graphs"] = "default" if full_graphs else "lean"
    with LLM(model, max_batch_size=max_batch_size, **kwargs) as llm:
        result["build_s"] = time.perf_counter() - started
        print(f"{model}: built in {result['build_s']:.1f} s", flush=True)  # (a timeout's clue)
        config = LatencyConfig(isl=latency_shape[0], osl=latency_shape[1], batch_size=1,
                               iterations=3, warmup=1, time_limit_s=budget_s * 0.2)
        result["latency"] = run_latency(llm, config)
        print(format_report(result["latency"]), flush=True)
        if copy_bw_gbs:
            _add_floor(result, copy_bw_gbs)
        isl, osl, num = tput
        config = ThroughputConfig(isl=isl, osl=osl, num_requests=num, warmup=8,
                                  time_limit_s=max(5.0, deadline - time.perf_counter() - 20))
        result["max_load"] = run_throughput(llm, config)
    print(format_report(result["max_load"]), flush=True)
    return result


def _add_floor(result: dict, copy_bw_gbs: float) -> None:
    w, tok_s = result["weights"], result["latency"]["output_tokens_per_s"]
    result["floor_tok_s"] = copy_bw_gbs * 1e9 / w["active_bytes"]
    result["floor_tok_s_without_input_embedding"] = (
        copy_bw_gbs * 1e9 / (w["active_bytes"] - w["embedding_bytes"]))
    result["of_floor"] = tok_s / result["floor_tok_s"]
    print(f"{result['model']} batch 1: {tok_s:.1f} tok/s = {result['of_floor']:.1%} of the "
          f"active-weight floor ({result['floor_tok_s']:.1f} tok/s, "
          f"{w['active_bytes'] / 1e9:.2f} GB a step)", flush=True)


def run_script(argv: list[str], budget_s: float, json_path: Path) -> dict:
    """Another benchmark script in its own process; its JSON (written to json_path)."""
    try:
        proc = subprocess.run([sys.executable, *argv], timeout=budget_s, text=True,
                              capture_output=True)
    except subprocess.TimeoutExpired as exc:
        for stream in (exc.stdout, exc.stderr):  # bytes on a timeout, even with text=True
            text = stream.decode(errors="replace") if isinstance(stream, bytes) else stream
            print((text or "")[-3000:], flush=True)
        return {"error": f"timed out after {budget_s:.0f} s"}
    print(proc.stdout[-8000:], proc.stderr[-4000:], sep="\n", flush=True)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}", "stderr": proc.stderr[-4000:]}
    return json.loads(json_path.read_text()) if json_path.is_file() else {"stdout": proc.stdout}


def run_child(part: str, budget_s: float, smoke: bool, copy_bw: float | None,
              out_dir: Path, max_batch_size: int, full_graphs: bool = False) -> dict:
    json_path = out_dir / f"{part}.json"
    if part == "kernel":
        argv = [str(HERE / "gpu_moe_kernel.py"), "--out", str(json_path),
                "--budget", str(budget_s - 15)]
        return run_script(argv + (["--cpu-smoke"] if smoke else []), budget_s, json_path)
    if part == "window":  # it writes $OUT/sliding_window_capacity.json
        # 24 requests: more than fit at once either way, so the peak is the capacity
        argv = [str(HERE / "sliding_window_capacity.py"), "--requests", "24"]
        if smoke:
            argv += ["--model", "tiny", "--isl", "600", "--osl", "16", "--kv-gib", "0.002",
                     "--requests", "12", "--max-num-tokens", "512"]
        return run_script(argv, budget_s, out_dir / "sliding_window_capacity.json")
    max_batch_size = min(max_batch_size, PART_MAX_BATCH.get(part, max_batch_size))
    argv = [str(Path(__file__)), "--child", part, "--budget", str(budget_s),
            "--child-out", str(json_path), "--max-batch-size", str(max_batch_size)]
    argv += (["--smoke"] if smoke else []) + (["--full-graphs"] if full_graphs else [])
    if copy_bw:
        argv += ["--copy-bw", str(copy_bw)]
    return run_script(argv, budget_s + 30, json_path)


def summary(results: dict) -> str:
    lines = ["", "=== summary ==="]
    if "floor" in results and "copy_bw_gbs" in results["floor"]:
        lines.append(f"copy bandwidth {results['floor']['copy_bw_gbs']:.0f} GB/s")
    for part in MODELS:
        r = results.get(part, {})
        if "latency" in r:
            lines.append(f"{r['model']}{' ' + r['quantization'] if r.get('quantization') else ''}"
                         f": batch 1 {r['latency']['output_tokens_per_s']:.1f} "
                         f"tok/s (floor {r.get('floor_tok_s', float('nan')):.1f}, "
                         f"{r.get('of_floor', float('nan')):.1%}); 128/128 max load "
                         f"{r.get('max_load', {}).get('output_tokens_per_s', float('nan')):.0f}"
                         " tok/s")
        elif r:
            lines.append(f"{part}: {r.get('error') or r.get('skipped') or r}"[:300])
        w = r.get("weights", {})
        if "state_bytes_per_request" in w:
            lines.append(f"  state {w['state_bytes_per_request'] / 2**20:.1f} MiB a request "
                         f"({w['state_layers']} layers) + KV {w['kv_bytes_per_request'] / 2**20:.1f}"
                         f" MiB at {w['kv_tokens']} tokens; all-attention KV "
                         f"{w['all_attention_kv_bytes'] / 2**20:.1f} MiB")
    if "kernel" in results:
        lines.append("kernel: see kernel.json" if "error" not in results["kernel"]
                     else f"kernel: {results['kernel']['error']}")
    window = results.get("window", {})
    if "on" in window:
        off, on = window["off"]["max_running"], window["on"]["max_running"]
        lines.append(f"window ({window['model']}): {off} requests at once without the "
                     f"savings, {on} with ({on / off:.2f}x)")
    elif window:
        lines.append(f"window: {window.get('error', window)}"[:300])
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--budget", type=float, default=560.0)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--full-graphs", action="store_true",
                        help="the engine's default CUDA graph sizes (slower to build)")
    parser.add_argument("--max-batch-size", type=int, default=256,
                        help="the engine's cap on running requests (max load's concurrency)")
    parser.add_argument("--child", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--copy-bw", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model = _smoke_model() if args.smoke else MODELS[args.child]
        result = part_model(model, args.budget, args.smoke, args.copy_bw,
                            QUANTIZATION.get(args.child), args.max_batch_size,
                            args.full_graphs, KV_OPTIONS.get(args.child))
        args.child_out.write_text(json.dumps(result, indent=1, default=str))
        return 0
    out_dir = Path(os.environ.get("OUT") or "/tmp/gpu_models")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"meta": {"date": datetime.date.today().isoformat(), "argv": sys.argv,
                        "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                        else "cpu", "torch": torch.__version__,
                        "floor_convention": FLOOR_CONVENTION}}
    parts = args.parts.split(",")
    end = time.perf_counter() + args.budget
    for i, part in enumerate(parts):
        # the time left, shared by the parts left (a skipped part's time goes to the rest)
        left = end - time.perf_counter() - 5
        share = SHARES[part] * left / sum(SHARES[p] for p in parts[i:])
        budget = min(max(share, 10.0 if part == "floor" else 0.0), left)  # a few s of copies
        if budget < 8:
            results[part] = {"skipped": "out of time"}
            continue
        print(f"--- {part} (budget {budget:.0f} s)", flush=True)
        started = time.perf_counter()
        if part == "floor":
            results[part] = part_floor(budget, args.smoke)
        else:
            copy_bw = results.get("floor", {}).get("copy_bw_gbs")
            results[part] = run_child(part, budget, args.smoke, copy_bw, out_dir,
                                      args.max_batch_size, args.full_graphs)
        results[part]["part_s"] = time.perf_counter() - started
        (out_dir / "models.json").write_text(json.dumps(results, indent=1, default=str))
    print(summary(results), flush=True)
    return 0


def _smoke_model() -> str:
    """A tiny random Mixtral saved to a temporary directory (the CPU smoke run)."""
    import tempfile
    import transformers
    path = Path(tempfile.mkdtemp()) / "tiny_mixtral"
    config = transformers.MixtralConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256, architectures=["MixtralForCausalLM"])
    transformers.MixtralForCausalLM(config).save_pretrained(path)
    return str(path)


if __name__ == "__main__":
    sys.exit(main())
