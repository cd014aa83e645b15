"""The CPU path on the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF), same run:

- batch 1: tllm against llama.cpp (llama-cpp-python, the same GGUF file, the same threads)
  and HF transformers (the same weights dequantised, fp32);
- batch 32: tllm against HF transformers' batched `generate` (left padding);
- 200 requests sharing a long prefix, prefix reuse off: tllm's wall time.

Every figure is output tokens per second over `--max-tokens` new tokens per request (EOS is
masked until then, so every side makes the same number), prefill included, median of
`--repeats`. llama-cpp-python is built from PyPI by the set-up (once; about 9 minutes here):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \\
        pip install llama-cpp-python==0.3.36
    python benchmarks/cpu_path.py --threads 2 --repeats 3

(GGML_NATIVE=ON, the default, segfaulted at the first token on these VMs: DESIGN.md.)"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
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


def llama_cpp_rate(llama, prompt: list[int], max_tokens: int, eos: int) -> float:
    """Greedy with llama.cpp's own decode; EOS masked in the argmax (no logit_bias hook)."""
    llama.reset()
    start = time.perf_counter()
    llama.eval(prompt)
    for _ in range(max_tokens):
        logits = np.array(llama.scores[llama.n_tokens - 1], copy=True)
        logits[eos] = -np.inf
        llama.eval([int(logits.argmax())])
    return max_tokens / (time.perf_counter() - start)


def median(values: list[float]) -> float:
    return statistics.median(values)


def section_batch1(args, llm, hf, llama, prompts) -> dict:
    out = {"tllm": [], "hf": [], "llama_cpp": []}
    for _ in range(args.repeats):
        for prompt in prompts[:2]:
            out["tllm"].append(tllm_rate(llm, [prompt], args.max_tokens))
            out["hf"].append(hf_rate(hf, [prompt], args.max_tokens, 2))
            if llama is not None:
                out["llama_cpp"].append(llama_cpp_rate(llama, prompt, args.max_tokens, 2))
    return {k: median(v) if v else None for k, v in out.items()} | {"runs": out}


def section_batch32(args, llm, hf, prompts) -> dict:
    out = {"tllm": [], "hf": []}
    for _ in range(args.repeats):
        out["tllm"].append(tllm_rate(llm, prompts, args.max_tokens))
        out["hf"].append(hf_rate(hf, prompts, args.max_tokens, 2))
    return {k: median(v) for k, v in out.items()} | {"runs": out}


def section_shared_prefix(args, tokenizer) -> dict:
    """200 requests = one 300-token shared document + a different question each; reuse off."""
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


def load_llama_cpp(path: str, threads: int):
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp comparator (see the docstring)")
        return None
    return Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024,
                 verbose=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sections", default="batch1,batch32,prefix")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from tllm import LLM, KvCacheConfig
    from tllm.loader import smollm2_path
    path = smollm2_path()
    sections = args.sections.split(",")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    results: dict = {"threads": args.threads, "max_tokens": args.max_tokens}
    with LLM("smollm2", max_batch_size=32,
             kv_cache_config=KvCacheConfig(max_tokens=32 * 512)) as llm:
        prompts = [chat_ids(llm.tokenizer, i) for i in range(32)]
        tllm_rate(llm, prompts[:2], 4), hf_rate(hf, prompts[:1], 4, 2)  # warm-up
        if "batch1" in sections:
            llama = load_llama_cpp(str(path), args.threads)
            results["batch1"] = section_batch1(args, llm, hf, llama, prompts)
            del llama
        if "batch32" in sections:
            results["batch32"] = section_batch32(args, llm, hf, prompts)
        tokenizer = llm.tokenizer
    del hf
    if "prefix" in sections:
        results["shared_prefix_no_reuse"] = section_shared_prefix(args, tokenizer)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print_table(results)


def print_table(results: dict) -> None:
    print(f"| workload ({results['max_tokens']} new tokens, {results['threads']} threads) "
          "| tllm | HF transformers | llama.cpp | tllm / HF | tllm / llama.cpp |")
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
    prefix = results.get("shared_prefix_no_reuse")
    if prefix:
        print(f"| 200 requests, shared {prefix['prompt_tokens'] // 200}-token prompts, reuse off "
              f"| {prefix['wall_s']:.1f} s | - | - | - | - |")


if __name__ == "__main__":
    main()
