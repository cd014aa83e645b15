"""Issue 22's multi-LoRA figures on one H200, in one process: decode tok/s at batch 32 on
dummy:llama-3.1-8b (bf16, CUDA graphs) with no LoRA (enable_lora off), and with LoRA on and
0, 1 and 8 distinct rank-16 adapters in the batch (goal: 8 adapters >= 0.8x no LoRA); then
the batched LoRA op alone (Triton shrink + expand) against the plain-torch gathered-bmm
reference at the model's shapes, checked against the grouped float32 reference first.

Adapters are random PEFT folders in the real shapes (every projection q/k/v/o/gate/up/down,
rank 16, alpha 32), written to a temporary folder. Decode speed is measured as the
difference of two runs of the same prompts (max_tokens short and long), so prefill cancels.

    python benchmarks/gpu_lora.py                 # ~3 minutes on an H200
    python benchmarks/gpu_lora.py --smoke         # plumbing on the CPU, tiny model
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tllm import LLM, KvCacheConfig, LoRARequest, SamplingParams  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


def decode_tok_per_s(llm: LLM, prompts, loras, short: int, long: int, repeats: int) -> dict:
    """Decode tokens/s of the batch: (long - short) tokens per request over the time the
    long run took beyond the short one (median of repeats)."""
    def run(max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - started
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
        return elapsed

    run(short)  # warm-up: loads the adapters, settles the allocator
    shorts = [run(short) for _ in range(repeats)]
    longs = [run(long) for _ in range(repeats)]
    step_s = (statistics.median(longs) - statistics.median(shorts)) / (long - short)
    return {"tok_per_s": len(prompts) / step_s, "step_ms": step_s * 1e3,
            "short_s": shorts, "long_s": longs}


def engine_part(args, adapters: list[LoRARequest], results: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 1000, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.batch)]
    common = dict(max_batch_size=args.batch, max_seq_len=args.prompt_len + args.long + 8,
                  kv_cache_config=KvCacheConfig(max_tokens=args.batch * (args.prompt_len
                                                                         + args.long + 64)),
                  device=args.device)
    cases = [("no LoRA (enable_lora off)", False, 0)]
    cases += [(f"LoRA on, {n} adapters", True, n) for n in (0, 1, len(adapters))]
    rows = {}
    with LLM(args.model, **common) as llm:
        rows[cases[0][0]] = decode_tok_per_s(llm, prompts, None, args.short, args.long,
                                             args.repeats)
        print(f"{cases[0][0]}: {rows[cases[0][0]]['tok_per_s']:.0f} tok/s", flush=True)
    with LLM(args.model, enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank,
             **common) as llm:
        for label, _, count in cases[1:]:
            loras = ([adapters[i % count] for i in range(args.batch)] if count else None)
            rows[label] = decode_tok_per_s(llm, prompts, loras, args.short, args.long,
                                           args.repeats)
            print(f"{label}: {rows[label]['tok_per_s']:.0f} tok/s", flush=True)
        results["graphs"] = llm._engine.executor.runner.cuda_graphs is not None
    base = rows[cases[0][0]]["tok_per_s"]
    for row in rows.values():
        row["vs_no_lora"] = row["tok_per_s"] / base
    results["decode"] = rows


def kernel_part(args, config: dict, results: dict) -> None:
    """The LoRA op of each merged projection at batch `args.batch`, 8 adapters."""
    from tllm.kernels.lora import add_lora, lora_bmm_ref, lora_expand_ref, lora_shrink_ref
    device, dtype, rank, slots = torch.device(args.device), torch.bfloat16, args.rank, 8
    shapes = projection_shapes(config)
    layers = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "o_proj": ["o_proj"],
              "gate_up_proj": ["gate_proj", "up_proj"], "down_proj": ["down_proj"]}
    rows = {}
    for layer, names in layers.items():
        inp = shapes[names[0]][1]
        bounds = [0]
        for name in names:
            bounds.append(bounds[-1] + shapes[name][0])
        x = torch.randn(args.batch, inp, device=device, dtype=dtype)
        a = torch.randn(slots, len(names) * rank, inp, device=device, dtype=dtype) / inp ** .5
        b = torch.randn(slots, bounds[-1], rank, device=device, dtype=dtype) * 0.1
        idx = (torch.arange(args.batch, device=device) % slots).to(torch.int32)
        bounds_t = torch.tensor(bounds, dtype=torch.int32, device=device)
        base = torch.randn(args.batch, bounds[-1], device=device, dtype=dtype)
        got = add_lora(base.clone(), x, a, b, idx, tuple(bounds), bounds_t)
        want = lora_expand_ref(base.double(), lora_shrink_ref(x.double(), a.double(), idx),
                               b.double(), idx, tuple(bounds))
        error = ((got.double() - want).norm() / want.norm()).item()
        ours = time_op(lambda: add_lora(base.clone(), x, a, b, idx, tuple(bounds), bounds_t),
                       device)
        torch_ref = time_op(lambda: lora_bmm_ref(base, x, a, b, idx, tuple(bounds)), device)
        copy = time_op(lambda: base.clone(), device)
        weight_bytes = (a.numel() + b.numel()) * a.element_size()
        rows[layer] = {"triton_us": ours * 1e6, "torch_bmm_us": torch_ref * 1e6,
                       "clone_us": copy * 1e6, "speedup": torch_ref / ours,
                       "rel_error": error, "adapter_weight_GBps": weight_bytes / ours / 1e9}
        print(f"kernel {layer}: triton {ours * 1e6:.1f} us, torch bmm {torch_ref * 1e6:.1f} us,"
              f" rel err {error:.1e}", flush=True)
        if error > 1e-2:
            raise SystemExit(f"{layer}: the LoRA op is off by {error:.2e}")
    results["kernel"] = rows


def time_op(fn, device: torch.device, repeats: int = 50) -> float:
    """Median seconds of fn (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def summary(results: dict) -> str:
    lines = [f"device: {results['device']}, model {results['model']}, batch "
             f"{results['batch']}, rank {results['rank']}, CUDA graphs {results.get('graphs')}",
             f"{'case':32} {'tok/s':>8} {'step ms':>8} {'vs none':>8}"]
    for label, row in results.get("decode", {}).items():
        lines.append(f"{label:32} {row['tok_per_s']:8.0f} {row['step_ms']:8.2f} "
                     f"{row['vs_no_lora']:8.2f}")
    lines.append(f"{'LoRA op (8 adapters)':32} {'triton us':>9} {'bmm us':>8} {'speedup':>8} "
                 f"{'rel err':>8}")
    for layer, row in results.get("kernel", {}).items():
        lines.append(f"{layer:32} {row['triton_us']:9.1f} {row['torch_bmm_us']:8.1f} "
                     f"{row['speedup']:8.2f} {row['rel_error']:8.1e}")
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
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = parser.parse_args()
    args.device = "cuda"
    if args.smoke:
        args.model, args.device, args.batch = "dummy:smollm2-135m", "cpu", 4
        args.prompt_len, args.short, args.long, args.repeats = 8, 2, 6, 1
        args.num_adapters = 2
    config = model_config(args.model)
    results = {"model": args.model, "batch": args.batch, "rank": args.rank,
               "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    with tempfile.TemporaryDirectory() as root:
        adapters = []
        for i in range(args.num_adapters):
            write_adapter(Path(root) / f"a{i}", config, args.rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, str(Path(root) / f"a{i}")))
        engine_part(args, adapters, results)
    kernel_part(args, config, results)
    out = Path(os.environ.get("OUT", "."))
    (out / "gpu_lora.json").write_text(json.dumps(results, indent=2))
    print(summary(results))


if __name__ == "__main__":
    main()
