"""CPU decode speed of tllm against HF transformers on the default model (SmolLM2-135M,
fp32), same prompts, greedy, same number of new tokens; median of several runs.

    python benchmarks/cpu_generate_vs_hf.py [--max-tokens 128] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "Write a short poem about the sea.",
           "Explain what a hash table is.",
           "List three uses of Python."]


def time_tllm(llm, prompt_ids, max_tokens):
    from tllm import SamplingParams
    # min_tokens masks EOS exactly as HF min_new_tokens does, so both make max_tokens tokens
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0)
    start = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return len(out.outputs[0].token_ids) / elapsed, out.outputs[0].token_ids


def time_hf(model, prompt_ids, max_tokens):
    ids = torch.tensor([prompt_ids])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=2)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) / elapsed, out[0, ids.shape[1]:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM
    from tllm import LLM
    from tllm.loader import smollm2_path
    path = smollm2_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    llm = LLM("smollm2")
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    time_tllm(llm, prompts[0], 8), time_hf(hf, prompts[0], 8)  # warm-up
    ours, theirs, same = [], [], True
    for _ in range(args.repeats):
        for prompt in prompts:
            tps, tokens = time_tllm(llm, prompt, args.max_tokens)
            ref_tps, ref_tokens = time_hf(hf, prompt, args.max_tokens)
            ours.append(tps)
            theirs.append(ref_tps)
            same &= tokens == ref_tokens
    llm.shutdown()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{len(prompts)} prompts x {args.repeats} repeats, {args.max_tokens} new tokens, batch 1")
    print(f"tllm  median {statistics.median(ours):7.1f} tok/s")
    print(f"HF    median {statistics.median(theirs):7.1f} tok/s")
    print(f"ratio {statistics.median(ours) / statistics.median(theirs):.2f}x; "
          f"greedy tokens identical: {same}")


if __name__ == "__main__":
    main()
