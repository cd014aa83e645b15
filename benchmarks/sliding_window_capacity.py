"""Sliding-window KV savings: how many requests of a long shape run at once in a fixed KV
memory, with the window savings on and off (the scheduler's own admission: the KV cache's
`peak_requests`, the most requests holding blocks in one step; not a formula).

The default model is a Gemma-2-9B-shaped dummy (42 layers alternating window 4096 / global,
8 kv heads of 256): `dummy:gemma-2-9b` when the loader has that preset, else the same shapes
on the Llama code path with Gemma 2's `layer_types` (what the KV cache sees is the same).

    python benchmarks/sliding_window_capacity.py                      # H200: the real figure
    python benchmarks/sliding_window_capacity.py --simulate           # scheduler + cache only
    python benchmarks/sliding_window_capacity.py --model tiny --isl 600 --osl 16 --kv-gib 0.01

--simulate runs the real Scheduler and KVCacheManager (on the meta device, no forward), so
it answers on any machine in seconds; without it the whole engine runs the requests.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tllm import LLM, KvCacheConfig, SamplingParams  # noqa: E402
from tllm.loader import dummy  # noqa: E402

GEMMA2_9B_SHAPE = dict(
    architectures=["LlamaForCausalLM"], hidden_size=3584, intermediate_size=14336,
    num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
    vocab_size=256000, max_position_embeddings=8192, rms_norm_eps=1e-6, sliding_window=4096,
    layer_types=["sliding_attention", "full_attention"] * 21,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype="bfloat16")
TINY_SHAPE = dict(
    architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-6, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype="float32")


def resolve_model(name: str) -> str:
    """A `dummy:` model name; presets this script brings are added to the loader's."""
    if name == "tiny":
        dummy.PRESETS.setdefault("window-tiny", ("llama", TINY_SHAPE))
        return "dummy:window-tiny"
    if name == "dummy:gemma-2-9b" and "gemma-2-9b" not in dummy.PRESETS:
        dummy.PRESETS["gemma-2-9b-shaped"] = ("llama", GEMMA2_9B_SHAPE)
        return "dummy:gemma-2-9b-shaped"
    return name


def kv_tokens(model: str, kv_gib: float) -> int:
    """kv_cache_config.max_tokens for `kv_gib` of bf16 keys and values of every layer."""
    config = dummy.dummy_config(model.removeprefix("dummy:"))
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size
                                                     // config.num_attention_heads)
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2
    return int(kv_gib * 2**30 // per_token)


def kv_config(model: str, savings: bool, args) -> KvCacheConfig:
    return KvCacheConfig(tokens_per_block=args.block, max_tokens=kv_tokens(model, args.kv_gib),
                         enable_sliding_window_savings=savings)


def prompts(vocab: int, args) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (args.isl,), generator=g).tolist()
            for _ in range(args.requests)]


def run_engine(model: str, savings: bool, args) -> dict:
    """The whole engine runs the requests."""
    with LLM(model, kv_cache_config=kv_config(model, savings, args),
             max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
             max_seq_len=args.isl + args.osl + 8) as llm:
        params = SamplingParams(max_tokens=args.osl, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p}
                             for p in prompts(llm._engine.config.vocab_size, args)],
                            params, use_tqdm=False)
        seconds = time.perf_counter() - start
        stats = llm.get_kv_cache_stats()
        blocks, steps = llm._engine.kv_cache.num_blocks, llm._engine.executor.num_steps
    assert all(len(o.outputs[0].token_ids) == args.osl for o in outs)
    return {"savings": savings, "max_running": stats["peak_requests"], "steps": steps,
            "seconds": seconds, "kv_blocks": blocks,
            "output_tok_s": args.requests * args.osl / seconds, "kv_stats": stats}


def run_simulated(model: str, savings: bool, args) -> dict:
    """The scheduler and KV cache manager alone: every scheduled token counts as computed,
    every request that reaches its end samples token 1."""
    from tllm import loader
    from tllm.attention import get_attention_backend
    from tllm.config import LlmArgs
    from tllm.request import FinishReason, Request
    from tllm.runner.build import build_kv_cache
    from tllm.scheduler.scheduler import Scheduler
    config = dummy.dummy_config(model.removeprefix("dummy:"))
    max_seq_len = args.isl + args.osl + 8
    from accelerate import init_empty_weights
    with init_empty_weights():  # no weights: the model only says what its KV cache holds
        meta_model = loader.model_class(config)(config, get_attention_backend("torch"),
                                                max_seq_len)
    llm_args = LlmArgs(model=model, max_batch_size=args.max_batch_size,
                       max_num_tokens=args.max_num_tokens, kv_cache_config=kv_config(
                           model, savings, args))
    kv = build_kv_cache(config, llm_args, torch.bfloat16, torch.device("meta"), max_seq_len,
                        reserve_full_generation=True, model=meta_model)
    scheduler = Scheduler(kv, max_batch_size=args.max_batch_size,
                          max_num_tokens=args.max_num_tokens, enable_chunked_prefill=True)
    for i, prompt in enumerate(prompts(config.vocab_size, args)):
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(),
                                      max_new_tokens=args.osl))
    steps = 0
    while scheduler.has_unfinished:
        batch = scheduler.schedule()
        kv.prepare(batch)
        scheduler.advance(batch)
        kv.update(batch)
        steps += 1
        for request in batch.requests:
            if request.num_computed_tokens == request.num_tokens:
                request.append_token(1)
                if request.num_output_tokens >= request.max_new_tokens:
                    request.finish(FinishReason.LENGTH)
                    scheduler.finish(request)
                    kv.free(request)
    return {"savings": savings, "max_running": kv.stats.peak_requests, "steps": steps,
            "kv_blocks": kv.num_blocks, "kv_stats": kv.stats_dict()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:gemma-2-9b")
    parser.add_argument("--isl", type=int, default=8000)
    parser.add_argument("--osl", type=int, default=256)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--kv-gib", type=float, default=40.0,
                        help="KV memory of both runs, as bf16 keys and values")
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--simulate", action="store_true",
                        help="scheduler and KV cache only (no model forward)")
    args = parser.parse_args()
    model = resolve_model(args.model)
    run = run_simulated if args.simulate else run_engine
    off, on = run(model, False, args), run(model, True, args)
    print(f"{model}: {args.requests} requests of ISL {args.isl} + OSL {args.osl}, "
          f"{args.kv_gib} GiB of KV, {args.block}-token blocks, max_num_tokens "
          f"{args.max_num_tokens}{' (simulated)' if args.simulate else ''}")
    print(f"{'window savings':15} {'max running':>11} {'KV blocks':>10} {'steps':>6} "
          f"{'freed by window':>16}")
    for r in (off, on):
        print(f"{'on' if r['savings'] else 'off':15} {r['max_running']:11d} "
              f"{r['kv_blocks']:10d} {r['steps']:6d} "
              f"{r['kv_stats']['blocks_freed_by_window']:16d}")
    print(f"concurrent requests: {on['max_running'] / off['max_running']:.2f}x with the savings")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "sliding_window_capacity.json").write_text(
            json.dumps({"args": vars(args), "model": model, "off": off, "on": on}, indent=1))


if __name__ == "__main__":
    main()
