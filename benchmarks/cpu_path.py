"""The CPU path on the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF), same run:

- batch 1: tllm against llama.cpp (llama-cpp-python, the same GGUF file, the same threads)
  and HF transformers (the same weights dequantised, fp32);
- batch 32: tllm against HF transformers' batched `generate` (left padding);
- 200 requests sharing a long prefix, prefix reuse off: tllm's wall time;
- `profile`: where one engine step's time goes at batch 1 and 32 (torch profiler over every
  thread): matmul time and the weight bytes it reads, attention (gather, SDPA calls), the
  other ops, and the time outside any op (Python, dispatch, the profiler's own cost).
  Run it with PYTHONPATH=<another tree> to profile that tree's tllm (the before figures).

Every figure is output tokens per second over `--max-tokens` new tokens per request,
prefill included, median of `--repeats`. tllm and HF mask EOS until then; llama.cpp's own
`generate` never stops at EOS, so every side makes the same number of tokens. Each system
runs in a fresh process of its own, the systems alternating within a repeat: in one process
the OpenMP thread teams of torch and ggml throttle each other (llama.cpp ran at a third of
its speed next to a torch model). llama-cpp-python is built from PyPI by the set-up (once;
about 9 minutes here):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \\
        pip install llama-cpp-python==0.3.36
    python benchmarks/cpu_path.py --threads 2 --repeats 3
    python benchmarks/cpu_path.py --sections profile   # the step profile

(GGML_NATIVE=ON, the default, segfaulted at the first token on these VMs: DESIGN.md.)"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "Write a short poem about the sea.",
           "Explain what a hash table is.",
           "List three uses of Python."]


def chat_ids(tokenizer, i: int) -> list[int]:
    text = PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" (variant {i})")
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def tllm_rate(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from tllm import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def hf_rate(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - width) * len(prompts) / elapsed


def llama_cpp_rate(llama, prompt: list[int], max_tokens: int) -> float:
    """Greedy (top_k 1) through llama.cpp's own sampler and decode loop: `generate` feeds
    back whatever it samples, EOS included, so it always makes max_tokens tokens."""
    llama.reset()
    start = time.perf_counter()
    for n, _ in enumerate(llama.generate(prompt, top_k=1, temp=0.0), 1):
        if n == max_tokens:
            break
    return max_tokens / (time.perf_counter() - start)


def median(values: list[float]) -> float:
    return statistics.median(values)


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int4pack_mm_for_cpu",
              "aten::_weight_int8pack_mm")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::index_select",
                 "aten::index_fill_", "aten::index_copy_", "aten::_safe_softmax",
                 "aten::_softmax", "aten::masked_fill_")


def profile_steps(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """ms per engine step (max_tokens steps, the prefill one of them) by kind of op, from the
    self CPU time of every op on every thread (the loop thread does the work)."""
    from torch.profiler import ProfilerActivity, profile

    from tllm import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0)
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    unprofiled = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
    per_step = {"matmul": 0.0, "attention": 0.0, "other ops": 0.0}
    calls = {"matmul": 0, "sdpa": 0, "ops": 0}
    top = []
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / max_tokens
        kind = ("matmul" if event.key in MATMUL_OPS else
                "attention" if event.key in ATTENTION_OPS or "scaled_dot_product" in event.key
                else "other ops")
        per_step[kind] += ms
        calls["ops"] += event.count
        calls["matmul"] += event.count if kind == "matmul" else 0
        calls["sdpa"] += event.count if event.key == "aten::scaled_dot_product_attention" else 0
        top.append((ms, event.key, event.count / max_tokens))
    per_step["outside ops (python, dispatch, profiler)"] = (
        wall * 1e3 / max_tokens - sum(per_step.values()))
    model = llm._engine.executor.runner.model
    weight_mb = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                     for t in [*model.parameters(), *model.buffers()]}.values()) / 2**20
    return {"batch": len(prompts), "steps": max_tokens, "ms_per_step": per_step,
            "step_ms_profiled": wall * 1e3 / max_tokens,
            "step_ms_unprofiled": unprofiled * 1e3 / max_tokens,
            "calls_per_step": {k: v / max_tokens for k, v in calls.items()},
            "weights_mb": weight_mb,
            "matmul_gb_s": weight_mb / 1024 / max(per_step["matmul"] / 1e3, 1e-9),
            "top_ops": [{"op": k, "ms_per_step": round(ms, 3), "calls_per_step": n}
                        for ms, k, n in sorted(top, reverse=True)[:12]]}


def section_profile(llm, prompts) -> dict:
    return {"batch1": profile_steps(llm, prompts[:1], 32),
            "batch32": profile_steps(llm, prompts, 32)}


def section_shared_prefix(tokenizer) -> dict:
    """200 requests = one shared document + a different question each; reuse off."""
    from tllm import LLM, KvCacheConfig, SamplingParams
    doc = " ".join(f"Fact {i}: the value of item {i} is {i * 7 % 13}." for i in range(40))
    prompts = [tokenizer.encode_chat([{"role": "user",
                                       "content": f"{doc}\nWhat is item {i % 40}?"}])
               for i in range(200)]
    with LLM("smollm2", max_batch_size=32, max_seq_len=1024,
             kv_cache_config=KvCacheConfig(enable_block_reuse=False,
                                           max_tokens=32 * 1024)) as llm:
        params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return {"num_requests": 200, "prompt_tokens": sum(map(len, prompts)), "new_tokens": 16,
            "wall_s": elapsed}


def run_worker(system: str, args) -> dict:
    """One repeat of one system in this (fresh) process: batch 1 over two prompts and, but
    for llama.cpp, batch 32; or the tllm profile, or the shared-prefix run."""
    torch.set_num_threads(args.threads)
    from tllm import loader
    path = loader.smollm2_path()
    tokenizer = loader.load_tokenizer(loader.resolve_model("smollm2"))
    prompts = [chat_ids(tokenizer, i) for i in range(32)]
    if system == "prefix":
        return section_shared_prefix(tokenizer)
    if system == "llama_cpp":
        from llama_cpp import Llama
        llama = Llama(model_path=str(path), n_threads=args.threads,
                      n_threads_batch=args.threads, n_ctx=1024, verbose=False)
        llama_cpp_rate(llama, prompts[0], 4)  # warm-up
        return {"batch1": [llama_cpp_rate(llama, p, args.max_tokens) for p in prompts[:2]]}
    if system == "hf":
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32).eval()
        hf_rate(hf, prompts[:1], 4, 2)  # warm-up
        return {"batch1": [hf_rate(hf, [p], args.max_tokens, 2) for p in prompts[:2]],
                "batch32": [hf_rate(hf, prompts, args.max_tokens, 2)]}
    from tllm import LLM, KvCacheConfig
    quantization = "gguf_int4" if system == "tllm_int4" else args.quantization
    with LLM("smollm2", max_batch_size=32, kv_cache_config=KvCacheConfig(max_tokens=32 * 512),
             quantization=quantization) as llm:
        tllm_rate(llm, prompts[:2], 4)  # warm-up
        if system == "profile":
            return section_profile(llm, prompts)
        return {"batch1": [tllm_rate(llm, [p], args.max_tokens) for p in prompts[:2]],
                "batch32": [tllm_rate(llm, prompts, args.max_tokens)]}


def spawn(system: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", system, "--threads", str(args.threads),
           "--max-tokens", str(args.max_tokens)]
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{system} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def has_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp comparator (see the docstring)")
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sections", default="batch1,batch32,prefix",
                        help="any of batch1,batch32,prefix,profile")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--quantization", help="tllm's LLM(quantization=...) (default: the "
                        "GGUF's kept form)")
    parser.add_argument("--with-int4", action="store_true",
                        help="also tllm with quantization='gguf_int4' (exact int4 linears)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_worker(args.worker, args)))
        return
    sections = args.sections.split(",")
    results: dict = {"threads": args.threads, "max_tokens": args.max_tokens}
    if "batch1" in sections or "batch32" in sections:
        systems = ["tllm", "hf"] + (["tllm_int4"] if args.with_int4 else []) + (
            ["llama_cpp"] if "batch1" in sections and has_llama_cpp() else [])
        runs: dict = {name: {system: [] for system in ("tllm", "hf", "llama_cpp", "tllm_int4")}
                      for name in ("batch1", "batch32")}
        for _ in range(args.repeats):
            for system in systems:
                for name, rates in spawn(system, args).items():
                    runs[name][system].extend(rates)
        for name in ("batch1", "batch32"):
            if name in sections:
                results[name] = {k: median(v) if v else None
                                 for k, v in runs[name].items()} | {"runs": runs[name]}
    if "profile" in sections:
        results["profile"] = spawn("profile", args)
    if "prefix" in sections:
        results["shared_prefix_no_reuse"] = spawn("prefix", args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print_table(results)


def print_table(results: dict) -> None:
    if any(name in results for name in ("batch1", "batch32")):
        print(f"| workload ({results['max_tokens']} new tokens, {results['threads']} threads)"
              " | tllm | HF transformers | llama.cpp | tllm / HF | tllm / llama.cpp |")
        print("|---|---:|---:|---:|---:|---:|")
    for name in ("batch1", "batch32"):
        r = results.get(name)
        if not r:
            continue
        ours, cpp = r["tllm"], r.get("llama_cpp")
        cpp_rate = f"{cpp:.1f}" if cpp else "-"
        vs_cpp = f"{ours / cpp:.2f}x" if cpp else "-"
        print(f"| {name} (tok/s) | {ours:.1f} | {r['hf']:.1f} | {cpp_rate} | "
              f"{ours / r['hf']:.2f}x | {vs_cpp} |")
        if r.get("tllm_int4"):
            int4 = r["tllm_int4"]
            vs_cpp = f"{int4 / cpp:.2f}x" if cpp else "-"
            print(f"| {name}, tllm gguf_int4 (tok/s) | {int4:.1f} | {r['hf']:.1f} | {cpp_rate} | "
                  f"{int4 / r['hf']:.2f}x | {vs_cpp} |")
    for name, p in results.get("profile", {}).items():
        parts = ", ".join(f"{k} {v:.1f}" for k, v in p["ms_per_step"].items())
        print(f"profile {name}: step {p['step_ms_unprofiled']:.1f} ms "
              f"({p['step_ms_profiled']:.1f} profiled): {parts}; "
              f"{p['calls_per_step']['sdpa']:.0f} SDPA and {p['calls_per_step']['ops']:.0f} "
              f"ops a step; weights {p['weights_mb']:.0f} MB read at "
              f"{p['matmul_gb_s']:.1f} GB/s in the matmuls")
    prefix = results.get("shared_prefix_no_reuse")
    if prefix:
        print(f"| 200 requests, shared {prefix['prompt_tokens'] // 200}-token prompts, reuse off "
              f"| {prefix['wall_s']:.1f} s | - | - | - | - |")


if __name__ == "__main__":
    main()
