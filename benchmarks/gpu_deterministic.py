"""Issue 35's deterministic-mode figures on dummy:llama-3.1-8b (BF16), one engine at a time
(each freed before the next is built):

  cost        deterministic off (the comparator) and on, the same engine arguments, in the
              same run: batch-1 latency (ISL 128 / OSL 128) and 128/128 at max load
              (tllm.bench.offline's run_throughput, --requests requests, time-limited). The
              off engine also runs --contrast random compositions: how often the check
              below fails without the mode (it shows the check can fail).
  invariance  LLM(deterministic=True): two probe requests (greedy, and seeded sampling with
              top-p; logprobs on, top 3) alone, then inside random batch compositions
              (1-64 requests, some sharing the probe's first blocks; the scheduler's step
              token budget, Scheduler.max_num_tokens, drawn per composition at or below the
              built max_num_tokens, so prompts are chunked differently), on four engines:
              prefix reuse on/off x the overlap scheduler on/off. Every probe's token ids
              and logprobs must equal its alone answer bit for bit (the alone answers come
              from the first engine and hold for all four).

The first deterministic engine (reuse on, overlap on: the defaults) runs both parts. Prints
as it goes, rewrites $OUT/deterministic.json (default /tmp/gpu_deterministic) after each
piece; a table comes last.

    python benchmarks/gpu_deterministic.py [--compositions 50] [--requests 1024] [--budget 420]
    python benchmarks/gpu_deterministic.py --tiny     # the plumbing on the CPU, a tiny Llama
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from tllm import LLM, KvCacheConfig, SamplingParams  # noqa: E402

from gpu_scale import latency, throughput  # noqa: E402

PROBES = (SamplingParams(max_tokens=8, temperature=0, logprobs=3),
          SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=11, logprobs=3))
ENGINES = ((True, True), (True, False), (False, True), (False, False))  # (reuse, overlap)


class Plan:
    """What a run measures: the real model on the GPU, or the tiny one on the CPU."""

    def __init__(self, args) -> None:
        self.tiny = args.tiny
        self.model = tiny_model() if args.tiny else args.model
        self.kwargs = ({"dtype": "float32", "device": "cpu"} if args.tiny
                       else {"dtype": "bfloat16"})
        self.max_batch_size = 64 if args.tiny else 512
        self.max_num_tokens = 128 if args.tiny else 8192
        self.max_seq_len = 128 if args.tiny else 2048
        self.vocab = 384 if args.tiny else 128256
        self.probe_len = 37 if args.tiny else 100
        self.block = 4 if args.tiny else 32           # tokens per KV block
        self.budgets = (9, 23, 40, None) if args.tiny else (64, 100, 256, 1024, None)
        self.other_len = 16 if args.tiny else 64       # other requests: prompt tokens, at most
        self.other_out = 2 if args.tiny else 8         # and output tokens
        self.shape = (16, 8) if args.tiny else (128, 128)
        self.requests = 16 if args.tiny else args.requests
        self.load_limit_s = 10 if args.tiny else args.load_limit
        self.compositions = 8 if args.tiny else args.compositions
        self.contrast = 4 if args.tiny else args.contrast
        self.probe_prompt = [random.Random(0).randrange(3, self.vocab - 3)
                             for _ in range(self.probe_len)]


def tiny_model() -> str:
    from tests.conftest import make_tiny_model
    path = Path(tempfile.mkdtemp()) / "tiny_llama"
    make_tiny_model("Llama", path)
    return str(path)


def build(plan: Plan, deterministic: bool, reuse: bool = True, overlap: bool = True) -> LLM:
    started = time.perf_counter()
    kv = KvCacheConfig(tokens_per_block=plan.block, enable_block_reuse=reuse,
                       **({"max_tokens": 8192} if plan.tiny else {}))
    llm = LLM(plan.model, deterministic=deterministic, max_batch_size=plan.max_batch_size,
              max_num_tokens=plan.max_num_tokens, max_seq_len=plan.max_seq_len,
              disable_overlap_scheduler=not overlap, kv_cache_config=kv, **plan.kwargs)
    print(f"built: deterministic={deterministic} reuse={reuse} overlap={overlap} in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    return llm


def free(llm: LLM) -> None:
    llm.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def answers(outputs) -> list[tuple[list[int], list]]:
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


def alone_answers(llm: LLM, plan: Plan) -> list:
    return [answers([llm.generate(plan.probe_prompt, p, use_tqdm=False)])[0] for p in PROBES]


def composition(rng: random.Random, plan: Plan) -> tuple[list, list, list[int]]:
    """Other requests around the probes (a fifth of them sharing the probe's first blocks),
    and where the probes sit in the batch."""
    prompts, params = [], []
    for _ in range(max(0, rng.randint(1, 64) - len(PROBES))):
        head = (plan.probe_prompt[:plan.block * rng.choice((2, 4))]
                if rng.random() < 0.2 else [])
        prompts.append(head + [rng.randrange(3, plan.vocab - 3)
                               for _ in range(rng.randint(1, plan.other_len))])
        params.append(SamplingParams(max_tokens=rng.randint(1, plan.other_out),
                                     temperature=rng.choice((0, 0.7, 1.0)),
                                     seed=rng.randrange(1000)))
    slots: list[int] = []
    for probe in PROBES:
        at = rng.randint(0, len(prompts))
        prompts.insert(at, plan.probe_prompt)
        params.insert(at, probe)
        slots = [s + (s >= at) for s in slots] + [at]
    return prompts, params, slots


def differences(got: tuple, want: tuple) -> dict:
    """Where a probe's answer departs from its alone answer."""
    tokens_equal = got[0] == want[0]
    diffs = [abs(g[t].logprob - w[t].logprob) for g, w in zip(got[1], want[1])
             for t in set(g) & set(w)]
    return {"tokens_equal": tokens_equal,
            "first_token_diff": next((i for i, (a, b) in enumerate(zip(got[0], want[0]))
                                      if a != b), None),
            "max_logprob_diff": max(diffs, default=None)}


def check_compositions(llm: LLM, plan: Plan, alone: list, rng: random.Random, count: int,
                       deadline: float, label: str) -> dict:
    """Up to `count` compositions (fewer when the deadline comes): each probe's answer
    against `alone`; the scheduler's token budget restored after."""
    scheduler = llm._engine.executor.scheduler
    checked, mismatches = 0, []
    try:
        while checked < count and time.perf_counter() < deadline:
            prompts, params, slots = composition(rng, plan)
            budget = rng.choice(plan.budgets) or plan.max_num_tokens
            scheduler.max_num_tokens = budget  # read per step; below the built maximum
            got = answers(llm.generate(prompts, params, use_tqdm=False))
            for probe, slot in enumerate(slots):
                if got[slot] != alone[probe]:
                    mismatches.append({"engine": label, "composition": checked,
                                       "batch": len(prompts), "budget": budget,
                                       "probe": probe, **differences(got[slot], alone[probe])})
            checked += 1
    finally:
        scheduler.max_num_tokens = plan.max_num_tokens
    print(f"[{label}] {checked} compositions, {len(mismatches)} probe mismatches", flush=True)
    return {"checked": checked, "mismatches": mismatches}


def cost(llm: LLM, plan: Plan) -> dict:
    isl, osl = plan.shape
    return {"batch1": latency(llm, 1, isl=isl, osl=osl, iterations=3),
            "load": throughput(llm, isl, osl, plan.requests, plan.load_limit_s,
                               warmup=8 if plan.tiny else 64)}


def run(plan: Plan, results: dict, save, deadline: float) -> None:
    llm = build(plan, deterministic=False)
    try:
        results["off"] = cost(llm, plan)
        save()
        results["off"]["contrast"] = check_compositions(
            llm, plan, alone_answers(llm, plan), random.Random("contrast"), plan.contrast,
            deadline, "off")
    finally:
        free(llm)
    save()
    alone, results["invariance"] = None, {}
    for index, (reuse, overlap) in enumerate(ENGINES):
        label = f"reuse={'on' if reuse else 'off'} overlap={'on' if overlap else 'off'}"
        llm = build(plan, True, reuse, overlap)
        try:
            if alone is None:
                alone = alone_answers(llm, plan)
                results["on"] = cost(llm, plan)
                save()
            share = (deadline - time.perf_counter()) / (len(ENGINES) - index)
            count = plan.compositions // 4 + (index == 0) * (plan.compositions % 4)
            results["invariance"][label] = check_compositions(
                llm, plan, alone, random.Random(label), count,
                time.perf_counter() + share, label)
        finally:
            free(llm)
        save()


def summary(results: dict) -> str:
    lines = [f"deterministic mode: {results['meta']['model']} on {results['meta']['device']}",
             f"{'deterministic':<14}{'batch-1 tok/s':>14}{'TPOT ms':>9}{'load tok/s':>12}"
             f"{'ITL p50 ms':>11}{'done':>7}"]
    for mode in ("off", "on"):
        r = results.get(mode)
        if r is None or "batch1" not in r:
            continue
        b, load = r["batch1"], r["load"]
        lines.append(f"{mode:<14}{b['output_tokens_per_s']:>14.1f}{b['tpot_ms']:>9.2f}"
                     f"{load['output_tok_s']:>12.0f}{load['itl_ms'].get('p50') or 0:>11.1f}"
                     f"{load['num_completed']:>7}")
    if results.get("off", {}).get("load") and results.get("on", {}).get("load"):
        lines.append(f"on/off: batch 1 {results['on']['batch1']['output_tokens_per_s'] / results['off']['batch1']['output_tokens_per_s']:.2f}x, "  # noqa: E501
                     f"load {results['on']['load']['output_tok_s'] / results['off']['load']['output_tok_s']:.2f}x")  # noqa: E501
    contrast = results.get("off", {}).get("contrast")
    if contrast:
        lines.append(f"deterministic off: {contrast['checked']} compositions, "
                     f"{len(contrast['mismatches'])} probe mismatches")
    inv = results.get("invariance", {})
    total = sum(r["checked"] for r in inv.values())
    bad = [m for r in inv.values() for m in r["mismatches"]]
    for label, r in inv.items():
        lines.append(f"deterministic on, {label}: {r['checked']} compositions, "
                     f"{len(r['mismatches'])} mismatches")
    lines.append(f"deterministic on, all engines: {total} compositions checked, "
                 f"{len(bad)} probe mismatches{'' if bad else ' (bitwise identical)'}")
    for m in bad[:5]:
        lines.append(f"  mismatch: {m}")
    if "error" in results:
        lines.append(f"error: {results['error'][:300]}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--compositions", type=int, default=50)
    parser.add_argument("--contrast", type=int, default=10)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--load-limit", type=float, default=90.0,
                        help="seconds each max-load run may take (then it is cut)")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for everything")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    deadline = time.perf_counter() + args.budget
    torch.manual_seed(0)
    plan = Plan(args)
    out_dir = Path(os.environ.get("OUT") or "/tmp/gpu_deterministic")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"meta": {"date": datetime.date.today().isoformat(), "argv": sys.argv,
                        "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                        else "cpu", "torch": torch.__version__, "model": plan.model}}

    def save() -> None:
        (out_dir / "deterministic.json").write_text(json.dumps(results, indent=1, default=str))
    try:
        run(plan, results, save, deadline)
    except Exception as exc:  # what was measured before still prints
        traceback.print_exc()
        results["error"] = f"{type(exc).__name__}: {exc}"
    save()
    print(summary(results), flush=True)
    return 1 if "error" in results else 0


if __name__ == "__main__":
    sys.exit(main())
