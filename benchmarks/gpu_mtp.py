"""Issue 33's MTP figure: batch-1 decode speed-up of DeepSeek-V3's multi-token-prediction
drafter (MTPDecodingConfig) at a known acceptance, on one GPU with a DeepSeek-V3-shaped dummy
(Moonlight-16B-A3B's shape by default: MLA, 64 routed experts + 2 shared, layer 0 dense;
the dummy loader gives the MTP module (layer num_hidden_layers, a MoE layer) random weights).

Random weights accept nothing, so, as gpu_spec_replay.py --planted does, a next-token map
is planted into the bf16 weights (benchmark only; every GEMM keeps its shape, so the cost is
the model's):
- target: the embedding writes a random code into the first PLANT_DIMS hidden dims; every
  layer leaves them (almost) alone (MLA's o_proj, the dense MLP's down_proj, the routed
  experts' w2 and the shared experts' down_proj rows there scaled by 1e-4); the LM head
  reads only them (its other columns scaled by 1e-3), so greedy argmax = perm[token] with a
  wide margin;
- MTP module: its input is [enorm(embed(next token)); hnorm(hidden)]; eh_proj copies the
  embedding half's planted dims straight through (the rest of those rows zeroed, so the
  hidden half adds nothing there), its decoder layer leaves them alone, and
  shared_head.head reads them with a copy of the map: its draft is map(next token), the
  target's true token after next. With `corrupt` c, a seeded fraction c of the map's
  entries is rotated among themselves (still a permutation, every one wrong), so a draft
  from such a token is rejected: expected mean accepted length 1 + sum_{j=1..k} (1-c)^j.
  A chained draft (k > 1) reads the module's own state and its previous draft's embedding,
  so it follows the same (corrupted) map.

One engine per k (a corruption level only rewrites the head's rows in place); greedy tokens
with MTP must equal those without (checked). ISL 128, OSL 256, batch 1; the median of
`--repeats` runs after a warm-up. JSON to $OUT/gpu_mtp.json (or --out).

    python benchmarks/gpu_mtp.py [--k 1,3] [--corrupt 0,0.3] [--budget 110]
    python benchmarks/gpu_mtp.py --smoke    # plumbing on the CPU, a tiny V3 in float32
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from gpu_spec_replay import plant_next_token_map, timed_generate  # noqa: E402
from tllm import LLM, MTPDecodingConfig, SamplingParams  # noqa: E402
from tllm.loader import dummy  # noqa: E402

GPU_PRESET = "moonlight-16b-a3b"
SMOKE_PRESET = "tiny-deepseek-v3-mtp"   # registered here (benchmark only)
SMOKE_CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], hidden_size=256, intermediate_size=384,
    moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=64, q_lora_rank=96,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, norm_topk_prob=True,
    routed_scaling_factor=2.5, vocab_size=2048, max_position_embeddings=1024,
    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False, dtype="float32")
QUIET, HEAD_OTHER_DIMS = 1e-4, 1e-3


@dataclass
class PlantedMap:
    codes: torch.Tensor    # [vocab, dims]: what token t's embedding writes
    perm: torch.Tensor     # [vocab]: the target's greedy next token of t
    dims: int


def register_presets(layers: int | None) -> str:
    """The smoke preset, and (with `layers`) Moonlight's shape cut to that many layers."""
    dummy.PRESETS[SMOKE_PRESET] = ("deepseek_v3", SMOKE_CONFIG)
    if layers is None:
        return GPU_PRESET
    model_type, config = dummy.PRESETS[GPU_PRESET]
    name = f"{GPU_PRESET}-{layers}l"
    dummy.PRESETS[name] = (model_type, {**config, "num_hidden_layers": layers})
    return name


@torch.no_grad()
def quiet_planted_dims(layer, dims: int) -> None:
    """One decoder layer (almost) never writes the planted dims: the rows of its output
    projections there scaled to ~0 (MLA's o_proj; a dense MLP's down_proj, or a MoE's
    experts' w2 [E, hidden, inter] and shared experts' down_proj)."""
    layer.self_attn.o_proj.weight[:dims] *= QUIET
    mlp = layer.mlp
    if hasattr(mlp, "experts"):
        mlp.experts.w2_weight[:, :dims] *= QUIET
        if mlp.shared_experts is not None:
            mlp.shared_experts.down_proj.weight[:dims] *= QUIET
    else:
        mlp.down_proj.weight[:dims] *= QUIET


@torch.no_grad()
def plant_target(model, seed: int = 0) -> PlantedMap:
    """The module docstring's target map: token t's greedy next token becomes perm[t]."""
    codes, perm, dims = plant_next_token_map(model, seed, quiet_planted_dims)
    return PlantedMap(codes, perm, dims)


def corrupted_map(perm: torch.Tensor, corrupt: float, seed: int) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """(perm with a seeded fraction `corrupt` of its entries rotated one place among
    themselves: still a permutation, each of those entries wrong; the corrupted tokens)."""
    g = torch.Generator(device=perm.device).manual_seed(seed)
    order = torch.randperm(perm.numel(), device=perm.device, generator=g)
    chosen = order[:round(corrupt * perm.numel())]
    wrong = perm.clone()
    if chosen.numel() > 1:
        wrong[chosen] = perm[chosen.roll(-1)]
    return wrong, chosen


@torch.no_grad()
def plant_mtp(head, planted: PlantedMap, corrupt: float, seed: int = 1) -> torch.Tensor:
    """The module docstring's MTP map (idempotent: each call rewrites the same entries);
    returns the corrupted tokens."""
    dims = planted.dims
    eh = head.eh_proj.weight                    # [hidden, 2 hidden]: [embedding; state]
    eh[:dims] = 0
    eh[:dims, :dims] = torch.eye(dims, device=eh.device, dtype=eh.dtype)
    quiet_planted_dims(head.block, dims)        # (re-scaling ~0 rows changes nothing)
    out = head.shared_head.weight               # [vocab, hidden]
    wrong, chosen = corrupted_map(planted.perm, corrupt, seed)
    out[wrong, :dims] = planted.codes.to(out.dtype)
    if not getattr(head, "_planted", False):    # the other columns once
        out[:, dims:] *= HEAD_OTHER_DIMS
        head._planted = True
    return chosen


def spec_counts(llm: LLM) -> dict[str, int]:
    stats = llm.get_stats()
    return {key: stats.get(f"spec_{key}", 0)
            for key in ("draft_tokens", "accepted_tokens", "verify_steps")}


def expected_length(k: int, wrong_fraction: float) -> float:
    """Mean accepted length when each draft from a token of the corrupted set is rejected
    (and chains stop there), the tokens met being a random sample of the vocabulary."""
    return 1 + sum((1 - wrong_fraction) ** j for j in range(1, k + 1))


def measure_k(model: str, kwargs: dict, k: int, levels: list[float], run, base) -> list[dict]:
    """Rows of one engine with MTP max_draft_len k: every corruption level in turn."""
    rows = []
    with LLM(model, **kwargs, speculative_config=MTPDecodingConfig(max_draft_len=k)) as llm:
        planted = plant_target(llm._engine.executor.runner.model)
        head = llm._engine.executor.speculation.drafter.head
        for corrupt in levels:
            chosen = plant_mtp(head, planted, corrupt)
            before = spec_counts(llm)
            seconds, tokens = run(llm)
            after = spec_counts(llm)
            d = {key: after[key] - before[key] for key in after}
            steps = d["verify_steps"] or 1
            hit = torch.isin(torch.tensor(tokens[0]), chosen.cpu()).float().mean().item()
            rows.append({
                "k": k, "corrupt": corrupt, "tok_s": base["osl"] / seconds,
                "speedup": base["seconds"] / seconds, "identical": tokens == base["tokens"],
                # no drafts at all: the drafter failed (each step logs why), not a figure
                "drafted": d["draft_tokens"] > 0,
                "mean_accepted_length": (d["accepted_tokens"] + steps) / steps,
                "acceptance_rate": d["accepted_tokens"] / (d["draft_tokens"] or 1),
                "expected_mean_accepted_length": expected_length(k, hit),
                "corrupted_fraction_of_output": hit, "spec_counts": d})
            print(f"k {k} corrupt {corrupt:.2f}: {rows[-1]['tok_s']:.1f} tok/s "
                  f"({rows[-1]['speedup']:.2f}x), mean accepted length "
                  f"{rows[-1]['mean_accepted_length']:.2f} (expected "
                  f"{rows[-1]['expected_mean_accepted_length']:.2f}), identical "
                  f"{rows[-1]['identical']}", flush=True)
    return rows


def print_table(results: dict) -> None:
    print(f"\n{results['model']} {results['dtype']} on {results['device']}, ISL "
          f"{results['isl']} / OSL {results['osl']}, batch 1: no speculation "
          f"{results['baseline_tok_s']:.1f} tok/s")
    print("| k | corrupt | mean accepted length (expected) | acceptance | tok/s | speed-up "
          "| identical |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for r in results["rows"]:
        print(f"| {r['k']} | {r['corrupt']:.2f} | {r['mean_accepted_length']:.2f} "
              f"({r['expected_mean_accepted_length']:.2f}) | {r['acceptance_rate']:.1%} | "
              f"{r['tok_s']:.1f} | {r['speedup']:.2f}x | {r['identical']} |")
    for note in results["skipped"]:
        print(f"skipped: {note}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=None,
                        help="cut Moonlight's shape to this many layers (default all 27)")
    parser.add_argument("--k", default="1,3", help="MTP max_draft_len values")
    parser.add_argument("--corrupt", default="0,0.3")
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget", type=float, default=110.0, help="seconds, build included")
    parser.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_mtp.json)")
    parser.add_argument("--smoke", action="store_true")
    return parser.parse_args()


def main() -> int:
    started = time.perf_counter()
    args = parse_args()
    preset = register_presets(args.layers)
    model = f"dummy:{SMOKE_PRESET if args.smoke else preset}"
    osl, isl = (16, 32) if args.smoke else (args.osl, args.isl)
    kwargs = dict(dtype="float32" if args.smoke else "bfloat16",
                  device="cpu" if args.smoke else "cuda", max_batch_size=1,
                  max_seq_len=isl + osl + 64, kv_cache_config={"max_tokens": 4 * (isl + osl)})
    params = SamplingParams(max_tokens=osl, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (isl,), generator=g).tolist()]

    def run(llm):
        return timed_generate(llm, prompts, params, args.repeats)

    results = {"argv": sys.argv, "date": time.strftime("%Y-%m-%d", time.gmtime()),
               "torch": torch.__version__, "model": model, "dtype": kwargs["dtype"],
               "isl": isl, "osl": osl,
               "repeats": args.repeats, "rows": [], "skipped": [], "phase_s": {},
               "device": "cpu" if args.smoke else torch.cuda.get_device_name()}
    with LLM(model, **kwargs) as llm:
        plant_target(llm._engine.executor.runner.model)
        seconds, tokens = run(llm)
    results["phase_s"]["plain"] = phase = time.perf_counter() - started
    base = {"seconds": seconds, "tokens": tokens, "osl": osl}
    results["baseline_tok_s"] = osl / seconds
    print(f"no speculation: {osl / seconds:.1f} tok/s (phase {phase:.1f} s)", flush=True)
    levels = [float(c) for c in args.corrupt.split(",")]
    for k in (int(v) for v in args.k.split(",")):
        left = args.budget - (time.perf_counter() - started)
        if left < 1.2 * phase * max(1, len(levels) / 2):   # a build plus its runs
            results["skipped"].append(f"k {k}: {left:.0f} s of the budget left")
            continue
        t0 = time.perf_counter()
        results["rows"] += measure_k(model, kwargs, k, levels, run, base)
        results["phase_s"][f"k{k}"] = time.perf_counter() - t0
    results["total_s"] = time.perf_counter() - started
    print_table(results)
    out = args.out or (os.environ.get("OUT") and str(Path(os.environ["OUT"], "gpu_mtp.json")))
    if out:
        Path(out).write_text(json.dumps(results, indent=1))
    return 0 if all(r["identical"] and r["drafted"] for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
