"""Issue 22's beam-search figure on one H200, in one process: beam search with B = 4 (the 4
beams returned) against 4 independent samples per prompt (n = 4, temperature 1), on
dummy:llama-3.1-8b (bf16, CUDA graphs), the same prompts and lengths, so both run 4
sequences per prompt and the same number of rows per decode step.

Decode speed is the difference of two runs (max_tokens short and long, ignore_eos; beam
search has no stop token then and runs every beam to the limit), so prefill cancels:
tok/s = sequences x (long - short) / (long run - short run). Checked in the same run: every
beam output has the full length, its 4 beams distinct and ranked, and every KV block is free
afterwards (beams fork blocks by reference count).

    python benchmarks/gpu_beam.py            # ~2 minutes on an H200
    python benchmarks/gpu_beam.py --smoke    # plumbing on the CPU, tiny model
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


def case_params(case: str, width: int, max_tokens: int) -> SamplingParams:
    if case == "beam":
        return SamplingParams(use_beam_search=True, best_of=width, n=width, temperature=0,
                              max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(n=width, temperature=1.0, seed=0, max_tokens=max_tokens,
                          ignore_eos=True)


def check_outputs(case: str, outputs, max_tokens: int) -> None:
    for output in outputs:
        assert all(len(o.token_ids) == max_tokens for o in output.outputs), case
        if case == "beam":
            scores = [o.cumulative_logprob for o in output.outputs]
            assert scores == sorted(scores, reverse=True), scores
            assert len({tuple(o.token_ids) for o in output.outputs}) == len(output.outputs)


def decode_rate(llm: LLM, prompts, case: str, args) -> dict:
    def run(max_tokens: int) -> float:
        params = case_params(case, args.width, max_tokens)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        check_outputs(case, outputs, max_tokens)
        return elapsed

    run(args.short)  # warm-up
    shorts = [run(args.short) for _ in range(args.repeats)]
    longs = [run(args.long) for _ in range(args.repeats)]
    step_s = (statistics.median(longs) - statistics.median(shorts)) / (args.long - args.short)
    stats = llm.get_kv_cache_stats()
    assert stats["blocks_free"] == stats["blocks_total"], stats
    sequences = len(prompts) * args.width
    return {"tok_per_s": sequences / step_s, "step_ms": step_s * 1e3, "sequences": sequences,
            "short_s": shorts, "long_s": longs}


def summary(results: dict) -> str:
    lines = [f"device: {results['device']}, model {results['model']}, {results['prompts']} "
             f"prompts x {results['width']} sequences, prompt {results['prompt_len']}, "
             f"CUDA graphs {results.get('graphs')}",
             f"{'case':36} {'tok/s':>9} {'step ms':>8} {'vs n=4':>7}"]
    rows = results.get("decode", {})
    base = rows.get("sampling", {}).get("tok_per_s")
    labels = {"beam": f"beam search B={results['width']}",
              "sampling": f"{results['width']} independent samples (n={results['width']})"}
    for case, row in rows.items():
        ratio = row["tok_per_s"] / base if base else float("nan")
        lines.append(f"{labels[case]:36} {row['tok_per_s']:9.0f} {row['step_ms']:8.2f} "
                     f"{ratio:7.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=144)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = parser.parse_args()
    device = "cuda"
    if args.smoke:
        args.model, device, args.prompts = "dummy:smollm2-135m", "cpu", 2
        args.prompt_len, args.short, args.long, args.repeats = 8, 2, 6, 1
    results = {"model": args.model, "prompts": args.prompts, "width": args.width,
               "prompt_len": args.prompt_len, "short": args.short, "long": args.long,
               "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 1000, (args.prompt_len,),
                                                  generator=gen).tolist()}
               for _ in range(args.prompts)]
    sequences = args.prompts * args.width
    room = args.prompt_len + args.long + 8
    with LLM(args.model, max_batch_size=sequences, max_seq_len=room, device=device,
             kv_cache_config=KvCacheConfig(max_tokens=sequences * (room + 64))) as llm:
        results["graphs"] = llm._engine.executor.runner.cuda_graphs is not None
        results["decode"] = {}
        for case in ("sampling", "beam"):
            results["decode"][case] = decode_rate(llm, prompts, case, args)
            print(f"{case}: {results['decode'][case]['tok_per_s']:.0f} tok/s", flush=True)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_beam.json").write_text(json.dumps(results, indent=2))
    print(summary(results))


if __name__ == "__main__":
    main()
