"""Guided JSON decoding against unguided decoding on the CPU: SmolLM2-135M-Instruct (the Q4_1
GGUF), the same chat prompts, batch 1 and 32, output tokens per second (median of
`--repeats`). Both run on one engine, alternating within a repeat. The schema asks for a
long array, so guided requests run to `--max-tokens` like the unguided ones (ignore_eos).

    python benchmarks/guided_decoding.py --threads 2 --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tllm import LLM, GuidedDecodingParams, KvCacheConfig, SamplingParams

SCHEMA = {"type": "array", "minItems": 50, "items": {
    "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "number", "minimum": 0},
        "capital": {"type": "boolean"}},
    "required": ["id", "city", "population", "capital"]}}
TOPICS = ["cities of France", "cities of Japan", "rivers of Europe", "ports of Africa",
          "towns of Peru", "capitals of Asia", "villages of Wales", "cities of Canada"]


def prompts(llm: LLM, batch: int) -> list[str]:
    tokenizer = llm._engine.tokenizer
    return [tokenizer.apply_chat_template([{"role": "user", "content":
            f"List {TOPICS[i % len(TOPICS)]} as JSON objects with id, city, population and "
            f"capital (request {i})."}]) for i in range(batch)]


def tokens_per_second(llm: LLM, batch_prompts: list[str], params: SamplingParams) -> float:
    start = time.perf_counter()
    outputs = llm.generate(batch_prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    systems = {
        "unguided": SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True),
        "guided JSON": SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                      ignore_eos=True,
                                      guided_decoding=GuidedDecodingParams(json=SCHEMA))}
    with LLM(args.model, max_seq_len=512, max_batch_size=max(args.batch_sizes),
             kv_cache_config=KvCacheConfig(max_tokens=32768)) as llm:
        tokens_per_second(llm, prompts(llm, 2), systems["guided JSON"])  # warm-up, compile
        rows = []
        for batch in args.batch_sizes:
            batch_prompts = prompts(llm, batch)
            figures = {name: [] for name in systems}
            for _ in range(args.repeats):
                for name, params in systems.items():
                    figures[name].append(tokens_per_second(llm, batch_prompts, params))
            medians = {name: statistics.median(v) for name, v in figures.items()}
            rows.append((batch, medians["unguided"], medians["guided JSON"]))
    print(f"{args.model}, CPU, {args.threads} threads, {args.max_tokens} new tokens a request, "
          f"median of {args.repeats}")
    print(f"{'batch':>5} | {'unguided tok/s':>14} | {'guided JSON tok/s':>17} | ratio")
    for batch, plain, guided in rows:
        print(f"{batch:>5} | {plain:>14.1f} | {guided:>17.1f} | {guided / plain:.2f}")


if __name__ == "__main__":
    main()
