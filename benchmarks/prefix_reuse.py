"""Prefix reuse on and off in the same run: requests sharing a long system prompt.

A warm-up request carries the shared prefix first (as earlier traffic would), then all
requests arrive at once. Greedy outputs must be identical with reuse on and off.

    python benchmarks/prefix_reuse.py --model smollm2 --requests 200 --prefix 1000
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tllm import LLM, KvCacheConfig, SamplingParams  # noqa: E402


def run(args, reuse: bool) -> dict:
    kv = KvCacheConfig(enable_block_reuse=reuse, tokens_per_block=32,
                       max_tokens=args.kv_tokens)
    with LLM(args.model, kv_cache_config=kv, max_batch_size=args.max_batch_size,
             max_seq_len=args.prefix + args.suffix + args.osl + 32) as llm:
        vocab = llm._engine.config.vocab_size
        g = torch.Generator().manual_seed(0)
        prefix = torch.randint(3, vocab, (args.prefix,), generator=g).tolist()
        prompts = [{"prompt_token_ids": prefix + torch.randint(3, vocab, (args.suffix,),
                                                               generator=g).tolist()}
                   for _ in range(args.requests + 1)]
        params = SamplingParams(max_tokens=args.osl, min_tokens=args.osl, temperature=0)
        llm.generate(prompts[0], params, use_tqdm=False)  # earlier traffic: warms the prefix
        start = time.perf_counter()
        outs = llm.generate(prompts[1:], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        stats = llm.get_kv_cache_stats()
    ttft = sorted(o.metrics["ttft_s"] * 1e3 for o in outs)
    return {"reuse": reuse, "seconds": elapsed,
            "output_tok_s": args.requests * args.osl / elapsed,
            "requests_s": args.requests / elapsed,
            "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": ttft[int(0.99 * len(ttft))],
            "hit_rate": stats["hit_rate"], "blocks_reused": stats["blocks_reused"],
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prefix", type=int, default=1000)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--osl", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--kv-tokens", type=int, default=131072)
    args = parser.parse_args()
    on, off = run(args, True), run(args, False)
    same = on.pop("tokens") == off.pop("tokens")
    print(f"{args.model}: {args.requests} requests, shared prefix {args.prefix} + {args.suffix} "
          f"own tokens, {args.osl} output tokens each")
    print(f"{'reuse':6} {'seconds':>8} {'out tok/s':>10} {'req/s':>7} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'hit rate':>8}")
    for r in (on, off):
        print(f"{'on' if r['reuse'] else 'off':6} {r['seconds']:8.2f} {r['output_tok_s']:10.1f} "
              f"{r['requests_s']:7.2f} {r['ttft_ms_p50']:8.0f}ms {r['ttft_ms_p99']:8.0f}ms "
              f"{r['hit_rate']:8.2f}")
    print(f"speed-up {off['seconds'] / on['seconds']:.2f}x; greedy outputs identical: {same}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "prefix_reuse.json").write_text(json.dumps([on, off], indent=1))


if __name__ == "__main__":
    main()
