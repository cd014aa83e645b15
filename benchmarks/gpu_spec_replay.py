"""Issue 18's end-to-end batch-1 speed-up as a function of the mean accepted length, on one
H200 with dummy:llama-3.1-8b.

Random weights accept nothing a real drafter proposes, so the drafts here come from a
BENCHMARK-ONLY replay drafter: it knows the target's own greedy continuation of each prompt
(from a run without speculation) and proposes its next k tokens, each replaced by a random
token with probability `corrupt` (seeded). It is never a user option: it is patched into
the engine by this script alone. Greedy output must equal the run without speculation
(checked), so the figures are the cost of verification alone, at a known acceptance.

Plain random bf16 weights leave near-ties in the logits everywhere, which a verify forward
(a few rows a GEMM) and a decode step (one row) round differently: the replayed
continuation then stops matching and acceptance collapses. Two ways keep the replay valid:
`--dtype float32` (rounding far below the gaps), or `--planted` (bf16; the random weights
get a planted next-token map: the embedding writes a random code into the first
PLANT_DIMS hidden dims, which every layer leaves untouched (o_proj and down_proj rows there
scaled to ~0), and the LM head reads only those dims, so the argmax is the map's, with a
margin far above any rounding; every GEMM keeps its shape, so the cost is a dense model's).

    python benchmarks/gpu_spec_replay.py [--k 4] [--corrupt 0,0.245,0.4] [--osl 256]
                                         [--dtype bfloat16 --planted | --dtype float32]
    python benchmarks/gpu_spec_replay.py --smoke     # plumbing on the CPU, tiny model
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tllm import LLM, SamplingParams  # noqa: E402
from tllm.executor.py_executor import PyExecutor  # noqa: E402
from tllm.llmapi import engine as engine_module  # noqa: E402
from tllm.config import NGramDecodingConfig  # noqa: E402
from tllm.runner.cuda_graph import CudaGraphRunner  # noqa: E402
from tllm.speculative.interface import Drafter, Drafts  # noqa: E402

PLANT_DIMS = 256
DEFAULT_MODEL = "dummy:llama-3.1-8b"


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


@torch.no_grad()
def plant_next_token_map(model, seed: int = 0, quiet_layer=None):
    """See the module docstring: token t's next token becomes perm[t] (benchmark only).
    `quiet_layer(layer, dims)` keeps a layer from writing the planted dims (default: a
    dense layer's o_proj and down_proj rows there scaled to ~0). Returns (codes, perm, dims)."""
    if model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr():
        raise ValueError("--planted needs an untied LM head")
    embed, head = model.embed_tokens.weight, model.lm_head.weight
    vocab, dims = embed.shape[0], min(PLANT_DIMS, embed.shape[1] // 4)
    g = torch.Generator(device=embed.device).manual_seed(seed)
    codes = torch.randn(vocab, dims, device=embed.device, generator=g)
    perm = torch.randperm(vocab, device=embed.device, generator=g)
    embed[:, :dims] = codes.to(embed.dtype)
    head[perm, :dims] = codes.to(head.dtype)   # row perm[t] scores t's code highest
    head[:, dims:] *= 1e-3                      # nonzero bits, ~no say in the argmax
    for layer in model.layers:                  # the layers (almost) never write there
        (quiet_layer or _quiet_dense_layer)(layer, dims)
    return codes, perm, dims


def _quiet_dense_layer(layer, dims: int) -> None:
    layer.self_attn.o_proj.weight[:dims] *= 1e-4
    layer.mlp.down_proj.weight[:dims] *= 1e-4


def count_graph_replays(counts: dict[str, int]) -> None:
    run = CudaGraphRunner.run

    def counting_run(self, input_ids, metadata):
        counts["verify" if metadata.max_query_len > 1 else "decode"] += 1
        return run(self, input_ids, metadata)
    CudaGraphRunner.run = counting_run


class IterationProfiler:
    """cProfile of the loop thread's iterations while `active` (host time of each step;
    cProfile sees only the thread it runs in, so it is switched on inside the loop)."""

    def __init__(self) -> None:
        self.active = False
        self.profiler = cProfile.Profile()
        iteration = PyExecutor._iteration

        def profiled(executor) -> None:
            if not self.active:
                return iteration(executor)
            self.profiler.enable()
            try:
                return iteration(executor)
            finally:
                self.profiler.disable()
        PyExecutor._iteration = profiled

    def run(self, fn) -> str:
        """The profile of `fn()`, top functions by own time."""
        self.profiler = cProfile.Profile()
        self.active = True
        try:
            fn()
        finally:
            self.active = False
        text = io.StringIO()
        pstats.Stats(self.profiler, stream=text).sort_stats("tottime").print_stats(25)
        return text.getvalue()


def build_llm(model: str, kwargs: dict, planted: bool, **extra) -> LLM:
    llm = LLM(model, **kwargs, **extra)
    if planted:
        plant_next_token_map(llm._engine.executor.runner.model)
    return llm


def timed_generate(llm: LLM, prompts, params, repeats: int,
                   profiler: IterationProfiler | None = None,
                   profiles: list | None = None) -> tuple[float, list]:
    """Median seconds of `repeats` runs after a warm-up (kernels compiled, pools settled);
    with a profiler, one more (untimed) run is profiled into `profiles`."""
    llm.generate(prompts, params, use_tqdm=False)
    outs, seconds = None, []
    for _ in range(repeats):
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - started)
    if profiler is not None:
        profiles.append(profiler.run(lambda: llm.generate(prompts, params, use_tqdm=False)))
    return (statistics.median(seconds) if seconds else None,
            [list(o.outputs[0].token_ids) for o in outs or []])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--corrupt", default="0,0.245,0.4")  # 0.245: mean accepted ~3 at k 4
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--planted", action="store_true")
    parser.add_argument("--profile", action="store_true", help="host profile of one run each")
    parser.add_argument("--tag", default="")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    smoke = args.smoke
    model = args.model
    if smoke and args.model == DEFAULT_MODEL:  # SmolLM2 ties its head: --planted needs another
        model = _smoke_untied_model() if args.planted else "dummy:smollm2-135m"
    osl = 16 if smoke else args.osl
    kwargs = dict(dtype="float32" if smoke else args.dtype,
                  device="cpu" if smoke else "cuda", max_batch_size=1,
                  max_seq_len=args.isl + osl + 64)
    params = SamplingParams(max_tokens=osl, temperature=0, ignore_eos=True)
    replays = {"decode": 0, "verify": 0}
    count_graph_replays(replays)
    profiles: list[str] = []
    results = {"model": model, "dtype": kwargs["dtype"], "planted": args.planted, "k": args.k,
               "isl": args.isl, "osl": osl, "rows": [],
               "device": torch.cuda.get_device_name() if not smoke else "cpu"}
    profiler = IterationProfiler() if args.profile else None
    with build_llm(model, kwargs, args.planted) as llm:  # the plain run and its continuation
        vocab = min(1000, llm._engine.config.vocab_size)  # prompts' ids, corruptions' too
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (args.isl,), generator=g).tolist()]
        base_s, base_tokens = timed_generate(llm, prompts, params, args.repeats, profiler,
                                             profiles)
    results["baseline_tok_s"] = osl / base_s
    results["baseline_graph_replays"] = dict(replays)
    print(f"no speculation: {osl / base_s:.1f} tok/s ({base_s * 1e3 / osl:.2f} ms/token, "
          f"graph replays {replays})", flush=True)
    known = {tuple(p): t for p, t in zip(prompts, base_tokens)}
    build = engine_module.build_drafter
    levels = [float(c) for c in args.corrupt.split(",")]
    for corrupt in levels:
        engine_module.build_drafter = lambda a, parts, c=corrupt: ReplayDrafter(
            args.k, known, c, vocab)
        replays.update(decode=0, verify=0)
        try:
            spec = {"speculative_config": NGramDecodingConfig(max_draft_len=args.k)}
            with build_llm(model, kwargs, args.planted, **spec) as llm:
                seconds, tokens = timed_generate(llm, prompts, params, args.repeats)
                stats = llm.get_stats()
                if profiler is not None and corrupt == max(levels):
                    timed_generate(llm, prompts, params, 0, profiler, profiles)
        finally:
            engine_module.build_drafter = build
        steps = stats.get("spec_verify_steps") or 1
        row = {"corrupt": corrupt, "tok_s": osl / seconds, "speedup": base_s / seconds,
               "identical": tokens == base_tokens,
               "mean_accepted_length": stats.get("spec_mean_accepted_length"),
               "acceptance_rate": stats.get("spec_acceptance_rate"),
               "ms_per_step": seconds * 1e3 * (1 + args.repeats) / steps,
               "graph_replays": dict(replays)}
        results["rows"].append(row)
        print(f"corrupt {corrupt:.3f}: mean accepted length {row['mean_accepted_length']:.2f}, "
              f"{row['tok_s']:.1f} tok/s = {row['speedup']:.2f}x, {row['ms_per_step']:.2f} ms "
              f"a step, identical {row['identical']}, graph replays {replays}", flush=True)
    tag = args.tag or f"{kwargs['dtype']}{'_planted' if args.planted else ''}"
    out = os.environ.get("OUT")
    if out:
        Path(out, f"spec_replay_{tag}.json").write_text(json.dumps(results, indent=1))
        if profiles:
            Path(out, f"spec_profile_{tag}.txt").write_text("\n\n".join(profiles))
    print(f"\n{tag}: plain {results['baseline_tok_s']:.1f} tok/s")
    print("| corrupt | mean accepted length | tok/s | speed-up | identical |")
    for r in results["rows"]:
        print(f"| {r['corrupt']:.3f} | {r['mean_accepted_length']:.2f} | {r['tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['identical']} |")
    return 0


def _smoke_untied_model() -> str:
    """A tiny random Llama with an untied LM head, in a temporary folder (--smoke
    --planted on the CPU)."""
    import tempfile
    import transformers
    path = Path(tempfile.mkdtemp()) / "tiny_untied_llama"
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


if __name__ == "__main__":
    sys.exit(main())
