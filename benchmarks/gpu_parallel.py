"""Tensor parallelism on GPUs: batch-1 latency and 128/128 throughput at TP=1 and TP=2 for the
Llama-3.1-8B shape, and the 70B shape (which does not fit one H200 in bf16) at TP=2, each
engine built once per configuration in a process of its own; plus a greedy parity check of
TP=2 / PP=2 against one GPU on a tiny HF model (fp32).

    python benchmarks/gpu_parallel.py --out results.json [--requests 1000]

Every figure it prints goes into benchmarks/RESULTS.md."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CONFIGS = {  # name: (model, tp, pp, throughput requests or None)
    "8b-tp1": ("dummy:llama-3.1-8b", 1, 1, None),
    "8b-tp2": ("dummy:llama-3.1-8b", 2, 1, None),
    "70b-tp2": ("dummy:llama-3.1-70b", 2, 1, None),
}


def run_config(name: str, requests: int, osl_latency: int) -> dict:
    model, tp, pp, num_requests = CONFIGS[name]
    return run_engine(name, {"model": model, "tensor_parallel_size": tp,
                             "pipeline_parallel_size": pp}, num_requests or requests,
                      osl_latency)


def run_engine(name: str, llm_kwargs: dict, requests: int, osl_latency: int,
               latency_iterations: int = 3, time_limit_s: float | None = None,
               on_built=None, isl: int = 128, osl: int = 128) -> dict:
    """Build LLM(**llm_kwargs) (this script's defaults underneath), run batch-1 latency
    (ISL `isl`) and, when `requests`, isl/osl max-load throughput; print the RESULT line.
    `on_built(llm)` adds fields measured on the built engine (gpu_multi.py's weight bytes)."""
    from tllm import LLM
    from tllm.bench.offline import LatencyConfig, ThroughputConfig, run_latency, run_throughput
    start = time.perf_counter()
    graphs = {} if os.environ.get("TLLM_BENCH_GRAPHS", "1") == "1" else {"cuda_graph_config": None}
    llm = LLM(**{"max_seq_len": 1152, "max_batch_size": 256, **graphs, **llm_kwargs})
    build_s = time.perf_counter() - start
    result = {"config": name, "model": llm_kwargs["model"],
              "tp": llm_kwargs.get("tensor_parallel_size", 1),
              "pp": llm_kwargs.get("pipeline_parallel_size", 1), "build_s": build_s,
              **(on_built(llm) if on_built else {})}
    result["latency"] = run_latency(llm, LatencyConfig(
        isl=isl, osl=osl_latency, batch_size=1, iterations=latency_iterations,
        time_limit_s=time_limit_s))
    if requests:
        result["throughput"] = run_throughput(llm, ThroughputConfig(
            isl=isl, osl=osl, num_requests=requests, warmup=8, time_limit_s=time_limit_s))
    print("RESULT " + json.dumps(result), flush=True)  # before a shutdown that could hang
    llm.shutdown()
    return result


def parity(graphs: bool) -> dict:
    """Greedy tokens of TP=2 and PP=2 against one GPU, fp32, tiny random Llama (GQA 2)."""
    import torch
    import transformers
    from tllm import LLM, SamplingParams
    path = tempfile.mkdtemp()
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
        architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    prompts = [[1] + list(range(10 + i, 60 + 9 * i)) for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    out = {}
    for name, tp, pp in (("tp1", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2)):
        extra = {} if graphs else {"cuda_graph_config": None}
        with LLM(path, dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                 kv_cache_config={"max_tokens": 8192}, **extra) as llm:
            out[name] = [o.outputs[0].token_ids
                         for o in llm.generate(prompts, params, use_tqdm=False)]
    return {"config": f"parity-graphs-{graphs}", "tp2_equal": out["tp2"] == out["tp1"],
            "pp2_equal": out["pp2"] == out["tp1"]}


def summarise(results: list[dict]) -> str:
    lines = ["| config | build s | batch-1 tok/s | ITL ms | 128/128 output tok/s | "
             "TTFT p50 ms | peak GiB/GPU |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | failed: {r['error'][:80]} |")
            continue
        lat, thr = r["latency"], r.get("throughput")
        throughput = (f"{thr['output_tokens_per_s']:.0f} | {thr['ttft_ms']['p50']:.0f} | "
                      f"{thr['peak_gpu_memory_gib']}" if thr else "- | - | -")
        lines.append(
            f"| {r['config']} | {r['build_s']:.0f} | {lat['output_tokens_per_s']:.1f}"
            f" | {lat['itl_ms']['p50']:.2f} | {throughput} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_parallel.json")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--osl-latency", type=int, default=256)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--parity", choices=["graphs", "eager"], help=argparse.SUPPRESS)
    parser.add_argument("--stage-timeout", type=float, default=240)
    parser.add_argument("--stages", help="e.g. parity-eager:60,8b-tp1:120 (default: all)")
    args = parser.parse_args()
    if args.one:
        run_config(args.one, args.requests, args.osl_latency)
        return
    if args.parity:
        print("RESULT " + json.dumps(parity(args.parity == "graphs")))
        return
    results = []
    # a stage is "parity-eager", "parity-graphs" or a config name, with ":SECONDS" to bound it
    stages = args.stages.split(",") if args.stages else (
        ["parity-eager", "parity-graphs"] + [c for c in args.configs.split(",") if c])
    for stage in stages:
        name, _, limit = stage.partition(":")
        extra = (["--parity", name.removeprefix("parity-")] if name.startswith("parity-")
                 else ["--one", name])
        cmd = [sys.executable, __file__, "--requests", str(args.requests),
               "--osl-latency", str(args.osl_latency), *extra]
        result = run_stage(cmd, name, float(limit or args.stage_timeout))
        print(json.dumps(result)[:600], flush=True)
        results.append(result)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(summarise([r for r in results if r["config"] in CONFIGS]))


def run_stage(cmd: list[str], name: str, timeout: float) -> dict:
    """One stage in its own session; if it hangs, every process in it dumps its Python
    stacks (faulthandler on SIGABRT) and the stage is reported as failed."""
    import os
    import signal
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        out, err = proc.communicate()
        print(f"STAGE {name} HUNG; stacks:\n{err[-12000:]}", file=sys.stderr, flush=True)
        found = [l for l in out.splitlines() if l.startswith("RESULT ")]
        # figures printed before a hung teardown still count
        return ({**json.loads(found[-1][7:]), "teardown": "hung"} if found
                else {"config": name, "error": "timed out"})
    found = [l for l in out.splitlines() if l.startswith("RESULT ")]
    if not found:
        print(f"STAGE {name} FAILED:\n{err[-4000:]}", file=sys.stderr, flush=True)
        return {"config": name, "error": err[-1500:]}
    return json.loads(found[-1][7:])


if __name__ == "__main__":
    main()
