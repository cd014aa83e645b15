"""Issue 18's end-to-end batch-1 speed-up as a function of the mean accepted length, on one
H200 with dummy:llama-3.1-8b bf16.

Random weights accept nothing a real drafter proposes, so the drafts here come from a
BENCHMARK-ONLY replay drafter: it knows the target's own greedy continuation of each prompt
(from a run without speculation) and proposes its next k tokens, each replaced by a random
token with probability `corrupt` (seeded). It is never a user option: it is patched into
the engine by this script alone. Greedy output must equal the run without speculation
(checked), so the figures are the cost of verification alone, at a known acceptance.

    python benchmarks/gpu_spec_replay.py [--k 4] [--corrupt 0,0.1,0.2,0.3,0.5] [--osl 256]
    python benchmarks/gpu_spec_replay.py --smoke     # plumbing on the CPU, tiny model
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tllm import LLM, SamplingParams  # noqa: E402
from tllm.llmapi import engine as engine_module  # noqa: E402
from tllm.llmapi.llm_args import NGramDecodingConfig  # noqa: E402
from tllm.speculative.interface import Drafter, Drafts  # noqa: E402


class ReplayDrafter(Drafter):
    """Proposes the known greedy continuation, each token corrupted with probability
    `corrupt` (benchmark only)."""

    def __init__(self, max_draft_len: int, known: dict[tuple[int, ...], list[int]],
                 corrupt: float, vocab: int, seed: int = 0) -> None:
        super().__init__(max_draft_len)
        self.known, self.corrupt, self.vocab = known, corrupt, vocab
        self.rng = random.Random(seed)

    def propose(self, requests, max_draft_lens) -> Drafts:
        drafts = []
        for request, k in zip(requests, max_draft_lens):
            continuation = self.known[tuple(request.prompt_token_ids)]
            done = len(request.token_ids) - len(request.prompt_token_ids)
            draft = list(continuation[done:done + k])
            for i, token in enumerate(draft):
                if self.rng.random() < self.corrupt:
                    draft[i] = (token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
            drafts.append(draft)
        return Drafts(drafts)

    def free(self, request) -> None:
        """Nothing is kept per request."""


def timed_generate(llm: LLM, prompts, params, repeats: int) -> tuple[float, list]:
    outs, seconds = None, []
    for _ in range(repeats):
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--corrupt", default="0,0.1,0.2,0.3,0.5")
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    model = "dummy:smollm2-135m" if args.smoke else args.model
    osl = 16 if args.smoke else args.osl
    kwargs = dict(dtype="float32" if args.smoke else args.dtype,
                  device="cpu" if args.smoke else "cuda", max_batch_size=1,
                  max_seq_len=args.isl + osl + 64)
    vocab = 1000
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.isl,), generator=g).tolist()]
    params = SamplingParams(max_tokens=osl, temperature=0, ignore_eos=True)
    results = {"model": model, "dtype": kwargs["dtype"], "k": args.k, "isl": args.isl, "osl": osl, "rows": []}
    with LLM(model, **kwargs) as llm:  # the plain run: its time and its greedy continuation
        base_s, base_tokens = timed_generate(llm, prompts, params, args.repeats)
    results["baseline_tok_s"] = osl / base_s
    print(f"no speculation: {osl / base_s:.1f} tok/s", flush=True)
    known = {tuple(p): t for p, t in zip(prompts, base_tokens)}
    build = engine_module.build_drafter
    for corrupt in [float(c) for c in args.corrupt.split(",")]:
        engine_module.build_drafter = lambda a, parts, c=corrupt: ReplayDrafter(
            args.k, known, c, vocab)
        try:
            spec = {"speculative_config": NGramDecodingConfig(max_draft_len=args.k)}
            with LLM(model, **kwargs, **spec) as llm:
                seconds, tokens = timed_generate(llm, prompts, params, args.repeats)
                stats = llm.get_stats()
        finally:
            engine_module.build_drafter = build
        row = {"corrupt": corrupt, "tok_s": osl / seconds, "speedup": base_s / seconds,
               "identical": tokens == base_tokens,
               "mean_accepted_length": stats.get("spec_mean_accepted_length"),
               "acceptance_rate": stats.get("spec_acceptance_rate")}
        results["rows"].append(row)
        print(f"corrupt {corrupt:.2f}: mean accepted length {row['mean_accepted_length']:.2f}, "
              f"{row['tok_s']:.1f} tok/s = {row['speedup']:.2f}x, identical "
              f"{row['identical']}", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "spec_replay.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
