"""The torch.compile'd CPU decode step (`torch_compile_config`) against eager, on the default
model (SmolLM2-135M-Instruct, the Q4_1 GGUF, int8 per channel), in one process:

- tok/s at batch 1 and 32 (`--max-tokens` new tokens a request, prefill included), eager and
  compiled engines alternating within a repeat, median of `--repeats`;
- whether the two engines' greedy tokens agree (first differing position per request) and,
  where they part ways, whether each side's token is in the other's top 5 (`parity`);
- ops per decode step (torch.profiler over every thread): the top-level ones and every
  aten op, nested ones included;
- start time: the compiled engine in a fresh process with an empty Inductor cache, then
  again with the cache that start left (`--sections start`).

    python benchmarks/cpu_compile.py --threads 2 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from cpu_path import chat_ids, tllm_rate


def make_llm(compiled: bool):
    from tllm import LLM, KvCacheConfig, TorchCompileConfig
    return LLM("smollm2", max_batch_size=32, kv_cache_config=KvCacheConfig(max_tokens=32 * 512),
               torch_compile_config=TorchCompileConfig() if compiled else None)


def greedy(llm, prompts, max_tokens: int) -> list[list[int]]:
    from tllm import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def ops_per_step(llm, prompts, max_tokens: int) -> dict:
    """Top-level ops (no op above them) and every aten op, per engine step."""
    from torch.profiler import ProfilerActivity, profile
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        greedy(llm, prompts, max_tokens)
    events = prof.events()
    top = sum(1 for e in events if e.cpu_parent is None)
    aten = sum(1 for e in events if e.name.startswith("aten::"))
    return {"top_level": top / max_tokens, "aten_all": aten / max_tokens}


def section_speed(args, prompts) -> dict:
    results: dict = {"batch1": {"eager": [], "compiled": []},
                     "batch32": {"eager": [], "compiled": []}}
    started = time.perf_counter()
    eager = make_llm(False)
    results["eager_start_s"] = time.perf_counter() - started
    started = time.perf_counter()
    compiled = make_llm(True)
    results["compiled_start_s"] = time.perf_counter() - started
    engines = {"eager": eager, "compiled": compiled}
    for llm in engines.values():
        tllm_rate(llm, prompts[:2], 4)  # warm-up
    for _ in range(args.repeats):
        for name, llm in engines.items():
            results["batch1"][name].append(tllm_rate(llm, prompts[:1], args.max_tokens))
        for name, llm in engines.items():
            results["batch32"][name].append(tllm_rate(llm, prompts, args.max_tokens))
    tokens = {name: greedy(llm, prompts, args.max_tokens) for name, llm in engines.items()}
    results["first_difference"] = [first_difference(a, b) for a, b in
                                   zip(tokens["eager"], tokens["compiled"])]
    results["ops"] = {f"{name} batch{len(p)}": ops_per_step(llm, p, 16)
                      for name, llm in engines.items() for p in (prompts[:1], prompts)}
    for llm in engines.values():
        llm.shutdown()
    return results


def section_parity(args, prompts) -> dict:
    """Where the eager and compiled engines' greedy tokens part ways, is each side's token
    in the other's top 5 (vLLM's rule for quantized or reduced-precision paths), and by how
    much did the eager side's two candidates differ in logprob?"""
    from tllm import SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens,
                            temperature=0, logprobs=5)
    outs = {}
    for name in ("eager", "compiled"):
        llm = make_llm(name == "compiled")
        outs[name] = [o.outputs[0] for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        llm.shutdown()
    differ, within, gaps = 0, 0, []
    for a, b in zip(outs["eager"], outs["compiled"]):
        i = first_difference(a.token_ids, b.token_ids)
        if i is None:
            continue
        differ += 1
        mine, theirs = a.token_ids[i], b.token_ids[i]
        within += mine in b.logprobs[i] and theirs in a.logprobs[i]
        if theirs in a.logprobs[i]:
            gaps.append(a.logprobs[i][mine].logprob - a.logprobs[i][theirs].logprob)
    return {"requests": len(prompts), "differ": differ, "within_top5": within,
            "eager_logprob_gaps": gaps}


def section_start(args) -> dict:
    """Compiled engine start in fresh processes: an empty Inductor cache, then a warm one."""
    times = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        for name in ("cold_cache_s", "warm_cache_s"):
            cmd = [sys.executable, __file__, "--worker", "start", "--threads", str(args.threads)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode:
                raise RuntimeError(done.stderr[-3000:])
            times[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sections", default="speed,parity,start")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker == "start":
        started = time.perf_counter()
        make_llm(True).shutdown()
        eager_started = time.perf_counter()
        make_llm(False).shutdown()
        print(json.dumps({"compiled": eager_started - started,
                          "eager": time.perf_counter() - eager_started}))
        return
    from tllm import loader
    tokenizer = loader.load_tokenizer(loader.resolve_model("smollm2"))
    prompts = [chat_ids(tokenizer, i) for i in range(32)]
    results: dict = {"threads": args.threads, "max_tokens": args.max_tokens}
    if "speed" in args.sections:
        results["speed"] = section_speed(args, prompts)
    if "parity" in args.sections:
        results["parity"] = section_parity(args, prompts)
    if "start" in args.sections:
        results["start"] = section_start(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print_table(results)


def print_table(results: dict) -> None:
    speed = results.get("speed")
    if speed:
        print(f"| {results['max_tokens']} new tokens, {results['threads']} threads | eager "
              "tok/s | compiled tok/s | compiled / eager | runs (eager; compiled) |")
        print("|---|---:|---:|---:|---|")
        for name in ("batch1", "batch32"):
            eager, compiled = (statistics.median(speed[name][k]) for k in ("eager", "compiled"))
            runs = "; ".join(", ".join(f"{r:.1f}" for r in speed[name][k])
                             for k in ("eager", "compiled"))
            print(f"| {name} | {eager:.1f} | {compiled:.1f} | {compiled / eager:.2f}x | {runs} |")
        print(f"engine start in this process: eager {speed['eager_start_s']:.1f} s, compiled "
              f"{speed['compiled_start_s']:.1f} s")
        print("ops per step:", {k: {n: round(v) for n, v in c.items()}
                                for k, c in speed["ops"].items()})
        print("first differing token (eager vs compiled) per request:",
              speed["first_difference"])
    if "parity" in results:
        print("parity:", results["parity"])
    if "start" in results:
        print("fresh-process start (compiled, eager):", results["start"])


if __name__ == "__main__":
    main()
