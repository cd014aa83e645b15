"""Issue 35 on the CPU: what deterministic mode (LlmArgs.deterministic) costs. For each model
(a tiny random Llama, SmolLM2-135M), engines with deterministic off (the comparator) and on,
built in the same run and timed in turns: a batch of --batch prompts (--isl tokens, --osl
out, greedy) and the first prompt alone, each --repeats times (median), wall clock of
`generate`. Also whether the first prompt's logprobs alone equal its logprobs in the batch
(bitwise).

    python benchmarks/cpu_deterministic.py [--batch 16 --isl 32 --osl 16 --repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tllm import LLM, KvCacheConfig, SamplingParams  # noqa: E402


def tiny_llama(path: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def timed(llm: LLM, prompts, params: SamplingParams) -> tuple[float, object]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def engine(model: str, deterministic: bool, args) -> LLM:
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=args.batch * (args.isl + args.osl) + 256,
                       enable_block_reuse=False)  # each repeat computes its prompts again
    return LLM(model, dtype="float32", max_batch_size=args.batch, max_num_tokens=256,
               max_seq_len=512, kv_cache_config=kv, deterministic=deterministic)


def measure(model: str, name: str, args) -> list[dict]:
    """Both engines built first, then their timings interleaved repeat by repeat, so a
    change in the machine's load falls on both."""
    vocab = 384 if name == "tiny" else 49152
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (args.isl,), generator=g).tolist()
               for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.osl, temperature=0, ignore_eos=True, logprobs=1)
    engines = {mode: engine(model, mode, args) for mode in (False, True)}
    for llm in engines.values():  # warm-up: lazy set-up and first-call costs
        timed(llm, prompts, params)
    times = {mode: {"batch": [], "alone": []} for mode in engines}
    outputs = {}
    try:
        for _ in range(args.repeats):
            for mode, llm in engines.items():
                seconds, outputs[mode, "batch"] = timed(llm, prompts, params)
                times[mode]["batch"].append(seconds)
                seconds, outputs[mode, "alone"] = timed(llm, prompts[0], params)
                times[mode]["alone"].append(seconds)
    finally:
        for llm in engines.values():
            llm.shutdown()
    rows = []
    for mode in engines:
        same = (outputs[mode, "batch"][0].outputs[0].logprobs
                == outputs[mode, "alone"].outputs[0].logprobs)
        rows.append({"model": name, "deterministic": mode,
                     "batch_tok_s": args.batch * args.osl / statistics.median(
                         times[mode]["batch"]),
                     "alone_tok_s": args.osl / statistics.median(times[mode]["alone"]),
                     "first_prompt_logprobs_alone_equal_batched": same,
                     "times_s": times[mode]})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--isl", type=int, default=32)
    parser.add_argument("--osl", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="tiny,smollm2")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model = tiny_llama(Path(tmp) / "tiny") if name == "tiny" else name
            for row in measure(model, name, args):
                rows.append(row)
                print(row, flush=True)
    print(f"\n| model | deterministic | batch {args.batch} tok/s | batch 1 tok/s | "
          "logprobs alone == in batch |\n|---|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['model']} | {r['deterministic']} | {r['batch_tok_s']:.1f} | "
              f"{r['alone_tok_s']:.1f} | {r['first_prompt_logprobs_alone_equal_batched']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
