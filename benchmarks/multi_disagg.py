"""Disaggregated serving across two GPUs against two aggregated replicas behind the router,
at the same request rate (the `disagg` section of benchmarks/gpu_multi.py).

- disaggregated: a context server on GPU 0 and a generation server on GPU 1 (each process
  sees only its own GPU); KV moves over CUDA IPC (the generation server opens the context
  server's pool, its copy kernels read GPU 0's memory through peer access), behind the
  disaggregated front;
- aggregated: one full server on each GPU behind `tllm serve router` (least loaded).

All four servers start at once; each load runs while the other pair idles. TTFT/TPOT/ITL
percentiles come from tllm.bench's load generator (random token-id prompts, streamed).
KV transfer bandwidth: a probe process on GPU 1 prefills prompts on the context server and
fetches their KV as the generation server does (gpu_disagg.py's fetch), against the GPU 0 ->
GPU 1 copy bandwidth measured in the same run. On the CPU (smoke) the transport is TCP."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


@dataclass(frozen=True)
class DisaggPlan:
    model: str
    flags: tuple[str, ...]         # engine flags every server gets
    isl: int
    osl: int
    num_prompts: int
    rate: float
    probe_tokens: tuple[int, ...]
    is_gpu: bool
    vocab_size: int = 20000      # prompt token ids are drawn below it


def gpu_plan() -> DisaggPlan:
    return DisaggPlan("dummy:llama-3.1-8b", ("--max-seq-len", "8192", "--kv-cache-tokens",
                                             "65536"), 1024, 128, 120, 8.0, (1024, 4096), True)


def smoke_plan(model_dir: str) -> DisaggPlan:
    return DisaggPlan(model_dir, ("--max-seq-len", "256", "--kv-cache-tokens", "2048",
                                  "--dtype", "float32", "--device", "cpu",
                                  "--max-batch-size", "8"), 32, 8, 6, 2.0, (64,), False, 250)


def run_disagg(plan: DisaggPlan, time_limit_s: float) -> dict:
    from gpu_disagg import start_server, wait_healthy
    deadline = time.monotonic() + time_limit_s
    result = {"model": plan.model, "isl": plan.isl, "osl": plan.osl,
              "num_prompts": plan.num_prompts, "request_rate": plan.rate}
    if plan.is_gpu:
        result["p2p_copy_GB_per_s"] = _p2p_bandwidth() / 1e9
    from gpu_disagg import free_port
    transport = "cuda_ipc" if plan.is_gpu else "tcp"
    kv_port = str(free_port())
    specs = {"context": ("0", "--role", "context", "--kv-port", kv_port),
             "generation": ("1", "--role", "generation", "--kv-transport", transport,
                            "--kv-sources", f"127.0.0.1:{kv_port}"),
             "replica0": ("0",), "replica1": ("1",)}
    servers = {}
    try:
        for name, (gpu, *role) in specs.items():
            servers[name] = _start(start_server, plan, gpu, role)
        for proc, url in servers.values():
            wait_healthy(proc, url, timeout_s=max(30.0, deadline - time.monotonic()))
        urls = {name: url for name, (_, url) in servers.items()}
        result["disaggregated"] = _load_through_front(plan, urls)
        result["aggregated"] = _load_through_router(plan, urls)
        result["kv_transfer"] = _probe(plan, urls["context"], deadline)
    finally:
        _stop([proc for proc, _ in servers.values()])
    return result


def _start(start_server, plan: DisaggPlan, gpu: str, role: list[str]):
    """gpu_disagg.start_server with only `gpu` visible (on a GPU host)."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if plan.is_gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    try:
        return start_server(plan.model, *role, *plan.flags)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _bench(plan: DisaggPlan, base_url: str) -> dict:
    from tllm.bench.serve import BenchConfig, run_benchmark
    from tllm.bench.serve_metrics import summarize
    config = BenchConfig(base_url=base_url, num_prompts=plan.num_prompts, input_len=plan.isl,
                         output_len=plan.osl, request_rate=plan.rate,
                         vocab_size=plan.vocab_size)
    summary = summarize(asyncio.run(run_benchmark(config)), [50, 90, 99])
    return {k: v for k, v in summary.items() if not k.startswith("std")}


def _load_through_front(plan: DisaggPlan, urls: dict) -> dict:
    from tllm.serve.fronts.disagg_front import DisaggFront, DisaggFrontConfig, build_front_app
    from tllm.serve.testing import ServerThread
    config = DisaggFrontConfig(context_servers={"urls": [urls["context"]]},
                               generation_servers={"urls": [urls["generation"]]})
    with ServerThread(build_front_app(DisaggFront(config))) as front:
        return _bench(plan, front.base_url)


def _load_through_router(plan: DisaggPlan, urls: dict) -> dict:
    from tllm.serve.fronts.router import Router, RouterConfig, build_router_app
    from tllm.serve.testing import ServerThread
    router = Router(RouterConfig([urls["replica0"], urls["replica1"]], policy="least_loaded"))
    with ServerThread(build_router_app(router)) as front:
        return _bench(plan, front.base_url)


def _probe(plan: DisaggPlan, ctx_url: str, deadline: float) -> list[dict] | dict:
    """The KV fetch timed in a process of GPU 1 (`python multi_disagg.py --probe URL`)."""
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": "1"} if plan.is_gpu else {}))
    cmd = [sys.executable, __file__, "--probe", ctx_url, "--transport",
           "cuda_ipc" if plan.is_gpu else "tcp",
           "--tokens", ",".join(map(str, plan.probe_tokens)), "--vocab", str(plan.vocab_size)]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True,
                             timeout=max(10.0, deadline - time.monotonic())).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)[-300:] + getattr(exc, "stderr", "")[-1500:]}
    return json.loads([line for line in out.splitlines() if line.startswith("PROBE ")][-1][6:])


def probe_main(ctx_url: str, transport: str, lengths: list[int], vocab_size: int,
               repeats: int = 3) -> None:
    import httpx
    from gpu_disagg import time_fetch
    endpoint = httpx.get(ctx_url + "/disagg/info").json()["kv_endpoint"]
    opened: dict = {}
    rows = []
    for length in lengths:
        prompt = [(13 * i + 5) % (vocab_size - 10) + 10 for i in range(length)]
        median, nbytes = time_fetch(ctx_url, endpoint, prompt, transport, repeats, opened)
        rows.append({"prompt_tokens": length, "transport": transport, "bytes": nbytes,
                     "median_s": median, "GB_per_s": nbytes / median / 1e9})
    print("PROBE " + json.dumps(rows), flush=True)


def _p2p_bandwidth(nbytes: int = 1 << 30) -> float:
    """GPU 0 -> GPU 1 copy, bytes per second (best of 5)."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize("cuda:1")
        best = min(best, time.perf_counter() - started)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / best


def _stop(procs: list) -> None:
    import signal
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def table(result: dict) -> str:
    keys = ("completed", "failed", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p50_tpot_ms",
            "p90_tpot_ms", "p99_tpot_ms", "output_throughput")
    lines = [f"{result['model']}, ISL {result['isl']} / OSL {result['osl']}, "
             f"{result['request_rate']} req/s, {result['num_prompts']} prompts",
             "| metric | 1 ctx + 1 gen GPU | 2 replicas + router |", "|---|---:|---:|"]
    for key in keys:
        a, b = (result.get(k, {}).get(key, float("nan")) for k in ("disaggregated",
                                                                    "aggregated"))
        lines.append(f"| {key} | {a:.1f} | {b:.1f} |")
    transfer = result.get("kv_transfer", [])
    for row in transfer if isinstance(transfer, list) else []:
        lines.append(f"KV {row['transport']}, {row['prompt_tokens']} tokens: {row['GB_per_s']:.2f} "
                     f"GB/s ({row['bytes'] / 1e6:.1f} MB in {row['median_s'] * 1e3:.2f} ms)")
    if "p2p_copy_GB_per_s" in result:
        lines.append(f"GPU0 -> GPU1 copy (same run): {result['p2p_copy_GB_per_s']:.0f} GB/s")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--probe", required=True, help="the context server's URL")
    parser.add_argument("--transport", default="cuda_ipc")
    parser.add_argument("--tokens", default="1024,4096")
    parser.add_argument("--vocab", type=int, default=20000)
    args = parser.parse_args()
    probe_main(args.probe, args.transport, [int(t) for t in args.tokens.split(",")],
               args.vocab)
