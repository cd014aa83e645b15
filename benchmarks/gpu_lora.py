"""Issue 22's multi-LoRA figures on one H200, in one process. First the batched LoRA op alone
(Triton shrink + expand) at dummy:llama-3.1-8b's merged projections, batch 32, rank 16, with
8 adapters, 1 adapter and none in the batch, timed inside a CUDA graph (as decode runs it),
against the plain-torch gathered-bmm reference and the layer's base GEMM, after a check
against the grouped float32 reference; with a short sweep of the kernels' launch settings
(<= ~20 s), whose best is printed. Then decode tok/s at batch 32 (bf16, CUDA graphs) with no
LoRA (enable_lora off) and with LoRA on and 0, 1 and 8 distinct rank-16 adapters in the batch
(goal: 8 adapters >= 0.8x no LoRA); the LoRA engine runs the sweep's best settings when they
beat the defaults by more than 5% (the table says which).

Adapters are random PEFT folders in the real shapes (every projection q/k/v/o/gate/up/down,
rank 16, alpha 32), written to a temporary folder. A decode step's time is each request's
mean inter-token time, (e2e - ttft) / (max_tokens - 1), median over the batch and over the
repeats, after a warm-up generate per case; a cross-check takes the difference of a long and
a short run (prefill cancels) and is shown only when the long run is the slower one.

    python benchmarks/gpu_lora.py                 # ~3 minutes on an H200
    python benchmarks/gpu_lora.py --smoke         # plumbing on the CPU (Triton interpreter)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYERS = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "o_proj": ["o_proj"],
          "gate_up_proj": ["gate_proj", "up_proj"], "down_proj": ["down_proj"]}
SWEEP_BUDGET_S = 20.0
SMOKE_OP_SHAPES = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                   "num_key_value_heads": 2}  # the interpreter is slow


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of a Llama layer."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    return {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def write_adapter(path: Path, config: dict, rank: int, seed: int) -> None:
    """A random PEFT adapter folder (what save_pretrained writes) for this model shape."""
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (out, inp) in projection_shapes(config).items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, inp, generator=gen)
                                                  / inp ** 0.5).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out, rank, generator=gen)
                                                  * 0.01).bfloat16()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS), "lora_dropout": 0.0, "bias": "none",
        "use_rslora": False, "base_model_name_or_path": None}))


def model_config(name: str) -> dict:
    from tllm.loader.dummy import PRESETS
    return PRESETS[name.removeprefix("dummy:")][1]


# ---- the engine ----

def decode_step_time(llm, prompts, loras, short: int, long: int, repeats: int) -> dict:
    """Decode step ms of the batch: each request's mean inter-token time (median over the
    batch, then over the repeats), and the long-minus-short cross-check."""
    from tllm import SamplingParams

    def run(max_tokens: int) -> tuple[float, float]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - started
        if any(len(o.outputs[0].token_ids) != max_tokens for o in outputs):
            raise SystemExit(f"a request did not give {max_tokens} tokens")
        itl = statistics.median((o.metrics["e2e_s"] - o.metrics["ttft_s"]) / (max_tokens - 1)
                                for o in outputs)
        return elapsed, itl

    run(long)  # warm-up: loads the adapters, compiles, settles the allocator
    shorts, longs, itls = [], [], []
    for _ in range(repeats):
        shorts.append(run(short)[0])
        elapsed, itl = run(long)
        longs.append(elapsed)
        itls.append(itl)
    step_s = statistics.median(itls)
    extra_s = statistics.median(longs) - statistics.median(shorts)
    diff_ms = extra_s / (long - short) * 1e3 if extra_s > 0 else None
    return {"step_ms": step_s * 1e3, "tok_per_s": len(prompts) / step_s,
            "step_ms_long_minus_short": diff_ms, "itl_s": itls, "short_s": shorts,
            "long_s": longs}


def engine_part(args, adapters: list, results: dict) -> None:
    from tllm import LLM, KvCacheConfig
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 1000, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.batch)]
    common = dict(max_batch_size=args.batch, max_seq_len=args.prompt_len + args.long + 8,
                  kv_cache_config=KvCacheConfig(max_tokens=args.batch * (args.prompt_len
                                                                         + args.long + 64)),
                  device=args.device)
    rows = {}
    label = "no LoRA (enable_lora off)"
    with LLM(args.model, **common) as llm:
        rows[label] = decode_step_time(llm, prompts, None, args.short, args.long, args.repeats)
        print(f"{label}: {rows[label]['step_ms']:.2f} ms a step", flush=True)
    with LLM(args.model, enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank,
             **common) as llm:
        for count in (0, 1, len(adapters)):
            label = f"LoRA on, {count} adapters"
            loras = [adapters[i % count] for i in range(args.batch)] if count else None
            rows[label] = decode_step_time(llm, prompts, loras, args.short, args.long,
                                           args.repeats)
            print(f"{label}: {rows[label]['step_ms']:.2f} ms a step", flush=True)
        results["graphs"] = llm._engine.executor.runner.cuda_graphs is not None
    base = rows["no LoRA (enable_lora off)"]["tok_per_s"]
    for row in rows.values():
        row["vs_no_lora"] = row["tok_per_s"] / base
    results["decode"] = rows


# ---- the op alone ----

def op_cases(args, config: dict) -> dict:
    """Inputs of each merged projection's LoRA op: 8 adapters, 1 adapter, none."""
    from tllm.kernels.lora_batch import LoraBatch
    device, dtype, rank, slots = torch.device(args.device), torch.bfloat16, args.rank, 8
    shapes = projection_shapes(config)
    gen = torch.Generator(device=device).manual_seed(0)
    batches = {}
    for label, per_token in (("8 adapters", torch.arange(args.batch) % slots),
                             ("1 adapter", torch.zeros(args.batch, dtype=torch.long)),
                             ("no adapter", torch.full((args.batch,), -1))):
        batches[label] = LoraBatch(args.batch, slots, device)
        batches[label].fill(per_token.to(torch.int32))
    cases = {}
    for layer, names in LAYERS.items():
        inp = shapes[names[0]][1]
        bounds = [0]
        for name in names:
            bounds.append(bounds[-1] + shapes[name][0])
        def rand(*shape):
            return torch.randn(*shape, device=device, dtype=dtype, generator=gen)
        cases[layer] = dict(
            x=rand(args.batch, inp), a=rand(slots, len(names) * rank, inp) / inp ** .5,
            b=rand(slots, bounds[-1], rank) * 0.1, out=rand(args.batch, bounds[-1]),
            weight=rand(bounds[-1], inp) / inp ** .5, bounds=tuple(bounds), batches=batches)
    return cases


def run_op(case: dict, label: str, kernel_config=None):
    from tllm.kernels.triton import lora as triton_lora
    batch = case["batches"][label]
    h = triton_lora.lora_shrink(case["x"], case["a"], batch, config=kernel_config)
    return triton_lora.lora_expand(case["out"], h, case["b"], batch, case["bounds"],
                                   config=kernel_config)


def check_op(case: dict, kernel_config=None) -> float:
    """Relative error of the op (8 adapters) against the grouped float64 reference."""
    from tllm.kernels.lora import lora_expand_ref, lora_shrink_ref
    batch = case["batches"]["8 adapters"]
    saved = case["out"].clone()
    got = run_op(case, "8 adapters", kernel_config).double()
    case["out"].copy_(saved)
    idx = batch.indices[:case["x"].shape[0]]
    want = lora_expand_ref(saved.double(), lora_shrink_ref(case["x"].double(),
                                                           case["a"].double(), idx),
                           case["b"].double(), idx, case["bounds"])
    return ((got - want).norm() / want.norm()).item()


def time_op(fn, device: torch.device, calls: int = 20, replays: int = 10) -> float:
    """Seconds a call of fn, inside a CUDA graph of `calls` calls (median of the replays),
    so launch cost on the host does not count, as in a decode step; wall time on a CPU."""
    for _ in range(2):
        fn()
    if device.type != "cuda":
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times) / calls


def total_op_time(cases: dict, device, kernel_config) -> float:
    """Seconds of the four merged projections' ops (8 adapters): one layer's LoRA cost."""
    return sum(time_op(lambda c=c: run_op(c, "8 adapters", kernel_config), device)
               for c in cases.values())


def sweep(cases: dict, device, smoke: bool) -> dict:
    """Coordinate search over the launch settings (shrink first, then expand), within
    SWEEP_BUDGET_S; the default is always measured."""
    from tllm.kernels.lora_batch import LoraKernelConfig
    default = LoraKernelConfig()
    shrink_options = [dict(shrink_block_k=bk, shrink_programs_per_sm=p)
                      for bk in (64, 128, 256) for p in (1, 2, 4, 8)]
    expand_options = [dict(expand_block_n=bn, num_warps=w)
                      for bn, w in ((32, 4), (64, 4), (128, 4), (256, 4), (128, 2), (256, 8))]
    if smoke:
        shrink_options, expand_options = shrink_options[5:6], expand_options[1:2]
    started = time.perf_counter()
    tried = {}

    def measure(config) -> float:
        key = json.dumps(dataclasses.asdict(config), sort_keys=True)
        if key not in tried and time.perf_counter() - started < SWEEP_BUDGET_S:
            tried[key] = total_op_time(cases, device, config)
        return tried.get(key, float("inf"))

    best, best_s = default, measure(default)
    for options in (shrink_options, expand_options):
        for option in options:
            config = dataclasses.replace(best, **option)
            seconds = measure(config)
            if seconds < best_s:
                best, best_s = config, seconds
    rows = sorted(tried.items(), key=lambda kv: kv[1])
    return {"default": dataclasses.asdict(default), "default_us": tried[next(iter(tried))] * 1e6,
            "best": dataclasses.asdict(best), "best_us": best_s * 1e6,
            "num_tried": len(tried), "seconds": time.perf_counter() - started,
            "top": [{"config": json.loads(k), "us": v * 1e6} for k, v in rows[:5]]}


def kernel_part(args, config: dict, results: dict) -> None:
    from tllm.kernels.lora import lora_bmm_ref
    from tllm.kernels.lora_batch import LoraKernelConfig
    device = torch.device(args.device)
    cases = op_cases(args, config)
    found = sweep(cases, device, args.smoke)
    results["sweep"] = found
    print(f"sweep: {found['num_tried']} settings in {found['seconds']:.1f} s; default "
          f"{found['default_us']:.1f} us a layer, best {found['best_us']:.1f} us with "
          f"{found['best']}", flush=True)
    best = LoraKernelConfig(**found["best"])
    rows = {}
    for layer, case in cases.items():
        row = {"rel_error": check_op(case), "rel_error_best": check_op(case, best)}
        for label in case["batches"]:
            row[f"triton_us {label}"] = time_op(lambda: run_op(case, label, best), device) * 1e6
        idx = case["batches"]["8 adapters"].indices[:args.batch]
        row["torch_bmm_us"] = time_op(lambda: lora_bmm_ref(case["out"], case["x"], case["a"],
                                                           case["b"], idx, case["bounds"]),
                                      device) * 1e6
        row["base_gemm_us"] = time_op(lambda: torch.nn.functional.linear(
            case["x"], case["weight"]), device) * 1e6
        rows[layer] = row
        print(f"kernel {layer}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()),
              flush=True)
        if max(row["rel_error"], row["rel_error_best"]) > 1e-2:
            raise SystemExit(f"{layer}: the LoRA op is off by {row['rel_error']:.2e}")
    results["kernel"] = rows
    if found["best_us"] < 0.95 * found["default_us"]:
        from tllm.kernels.triton import lora as triton_lora
        triton_lora._DEFAULT = best  # the engine below runs the sweep's best
        results["engine_kernel_config"] = found["best"]
    else:
        results["engine_kernel_config"] = found["default"]


def summary(results: dict) -> str:
    lines = [f"device: {results['device']}, model {results['model']}, batch "
             f"{results['batch']}, rank {results['rank']}, CUDA graphs {results.get('graphs')}",
             f"LoRA engine kernel settings: {results.get('engine_kernel_config')}",
             f"{'case':30} {'tok/s':>8} {'step ms':>8} {'vs none':>8} {'long-short ms':>14}"]
    for label, row in results.get("decode", {}).items():
        diff = row["step_ms_long_minus_short"]
        lines.append(f"{label:30} {row['tok_per_s']:8.0f} {row['step_ms']:8.2f} "
                     f"{row['vs_no_lora']:8.2f} {f'{diff:.2f}' if diff else 'n/a':>14}")
    lines.append(f"{'LoRA op, us in a graph':18} {'8 ad.':>7} {'1 ad.':>7} {'none':>7} "
                 f"{'bmm ref':>8} {'base GEMM':>10} {'rel err':>8}")
    for layer, row in results.get("kernel", {}).items():
        lines.append(f"{layer:18} {row['triton_us 8 adapters']:7.1f} "
                     f"{row['triton_us 1 adapter']:7.1f} {row['triton_us no adapter']:7.1f} "
                     f"{row['torch_bmm_us']:8.1f} {row['base_gemm_us']:10.1f} "
                     f"{row['rel_error']:8.1e}")
    found = results.get("sweep")
    if found:
        lines.append(f"sweep best {found['best_us']:.1f} us a layer (default "
                     f"{found['default_us']:.1f}): {found['best']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=144)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = parser.parse_args()
    args.device = "cuda"
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        args.model, args.device, args.batch = "dummy:smollm2-135m", "cpu", 4
        args.prompt_len, args.short, args.long, args.repeats = 8, 2, 6, 1
        args.num_adapters = 2
    from tllm import LoRARequest
    config = model_config(args.model)
    results = {"model": args.model, "batch": args.batch, "rank": args.rank,
               "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    kernel_part(args, SMOKE_OP_SHAPES if args.smoke else config, results)
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the op's inputs and graphs, before the engines' memory
    with tempfile.TemporaryDirectory() as root:
        adapters = []
        for i in range(args.num_adapters):
            write_adapter(Path(root) / f"a{i}", config, args.rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, str(Path(root) / f"a{i}")))
        engine_part(args, adapters, results)
    out = Path(os.environ.get("OUT", "."))
    (out / "gpu_lora.json").write_text(json.dumps(results, indent=2))
    print(summary(results))


if __name__ == "__main__":
    main()
