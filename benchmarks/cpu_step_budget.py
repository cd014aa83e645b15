"""Issue 21 on the CPU: why `step_token_budget` halves throughput under load, counted (not
timed) on a tiny random Llama. All requests at once (a saturating load); for each policy
the per-step batch composition: mean running batch, decodes and prefill tokens a step,
how many steps mix prefill chunks into their decodes (on a GPU those run eagerly, pure
decode steps replay CUDA graphs), the running batch over time; and whether the greedy
outputs equal the default policy's.

    python benchmarks/cpu_step_budget.py [--requests 256 --batch 32 --isl 32 --osl 32]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tllm import LLM, KvCacheConfig, SamplingParams, SchedulerConfig  # noqa: E402

from step_composition import StepRecorder, running_curve, summarize  # noqa: E402


def tiny_llama(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(config).save_pretrained(path)


def run(path: Path, config: SchedulerConfig, args) -> tuple[dict, list]:
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 384, (args.isl,), generator=g).tolist()}
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.osl, temperature=0, ignore_eos=True)
    kv = KvCacheConfig(tokens_per_block=16,
                       max_tokens=args.batch * (args.isl + args.osl) + 256)
    with LLM(str(path), dtype="float32", max_batch_size=args.batch,
             max_num_tokens=args.max_num_tokens, kv_cache_config=kv,
             scheduler_config=config) as llm:
        recorder = StepRecorder(llm._engine.executor.scheduler)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        steps = recorder.take()
    return {**summarize(steps), "running_every_16": running_curve(steps)}, \
        [o.outputs[0].token_ids for o in outputs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--isl", type=int, default=32)
    parser.add_argument("--osl", type=int, default=32)
    parser.add_argument("--max-num-tokens", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=64,
                        help="the step / prefill budget (default: batch * isl / osl * 2)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    policies = {"default": SchedulerConfig(),
                f"step_token_budget={args.budget}": SchedulerConfig(step_token_budget=args.budget),
                f"prefill_token_budget={args.budget}":
                    SchedulerConfig(prefill_token_budget=args.budget),
                f"prefill_token_budget={args.budget}, every step":
                    SchedulerConfig(prefill_token_budget=args.budget, admit_whole_chunks=False)}
    results, reference = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        tiny_llama(Path(tmp))
        for name, config in policies.items():
            summary, tokens = run(Path(tmp), config, args)
            reference = reference or tokens
            summary["greedy_equal_to_default"] = tokens == reference
            results[name] = summary
            print(f"{name}: {json.dumps(summary)}", flush=True)
    default = results["default"]["mean_running"]
    print(f"\n{args.requests} requests {args.isl}/{args.osl} at once, max_batch_size "
          f"{args.batch}, max_num_tokens {args.max_num_tokens}")
    print(f"{'policy':<38}{'steps':>6}{'running':>9}{'vs dflt':>8}{'decodes':>8}"
          f"{'prefill':>8}{'mixed':>7}{'pure':>6}{'greedy=':>8}")
    for name, r in results.items():
        kinds = r["steps_by_kind"]
        print(f"{name:<38}{r['num_steps']:>6}{r['mean_running']:>9.1f}"
              f"{r['mean_running'] / default:>8.0%}{r['mean_decodes']:>8.1f}"
              f"{r['mean_prefill_tokens']:>8.1f}{kinds['mixed']:>7}{kinds['pure_decode']:>6}"
              f"{str(r['greedy_equal_to_default']):>8}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
