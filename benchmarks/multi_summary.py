"""The tables benchmarks/gpu_multi.py prints last, from its sections' results."""
from __future__ import annotations

TRTLLM_70B_FP8_TP2_TOK_S = 6823.0
GOAL_TP2_SPEEDUP = 1.7


def summary(results: list[dict], smoke: bool) -> str:
    by_name = {r["config"]: r for r in results}
    parts = [f"== gpu_multi ({'CPU smoke, gloo, tiny models' if smoke else '2 GPUs'}) =="]
    for r in results:
        if "error" in r:
            parts.append(f"{r['config']}: FAILED or skipped: {r['error'][:200]}")
    if "parity" in by_name and "error" not in by_name["parity"]:
        parts.append(_parity(by_name["parity"]))
    if "allreduce" in by_name and "error" not in by_name["allreduce"]:
        import allreduce_bench
        parts.append(allreduce_bench.table(by_name["allreduce"]))
    engines = [r for r in results if "latency" in r]
    if engines:
        parts.append(_engines(engines))
        parts.append(_ratios({r["config"]: r for r in engines}))
    if "disagg" in by_name and "error" not in by_name["disagg"]:
        import multi_disagg
        parts.append(multi_disagg.table(by_name["disagg"]))
    return "\n\n".join(p for p in parts if p)


def _parity(r: dict) -> str:
    return (f"parity (tiny Llama, {r['num_prompts']} prompts): fp32 TP=2 identical to TP=1: "
            f"{r['fp32_tp2_identical']} (custom all-reduce {r['custom_all_reduce']['fp32-tp2']}"
            f"), with NCCL: {r['fp32_tp2_nccl_identical']}; bf16 top-5 rule holds: "
            f"{r['bf16_top5_rule_holds']} ({r['bf16_prompts_identical']} of "
            f"{r['num_prompts']} identical)")


def _engines(engines: list[dict]) -> str:
    lines = ["| config | custom AR | build s | batch-1 tok/s | ITL p50 ms | floor tok/s | "
             "max-load output tok/s (done/requests) | TTFT p50 ms | peak GiB/GPU |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in engines:
        lat, thr = r["latency"], r.get("throughput")
        floor = f"{r['floor_tokens_per_s']:.1f}" if "floor_tokens_per_s" in r else "-"
        load = (f"{thr['output_tokens_per_s']:.0f} ({thr['num_completed']}/"
                f"{thr['num_requests']}) | {thr['ttft_ms']['p50']:.0f} | "
                f"{thr['peak_gpu_memory_gib']}" if thr else "- | - | -")
        lines.append(f"| {r['config']} | {r.get('custom_all_reduce')} | {r['build_s']:.0f} | "
                     f"{lat['output_tokens_per_s']:.1f} | {lat['itl_ms']['p50']:.2f} | "
                     f"{floor} | {load} |")
    return "\n".join(lines)


def _batch1(engines: dict, name: str) -> float | None:
    r = engines.get(name)
    return r["latency"]["output_tokens_per_s"] if r else None


def _ratios(engines: dict) -> str:
    lines = []
    tp1, tp2, nccl = (_batch1(engines, n) for n in ("8b-tp1", "8b-tp2", "8b-tp2-nccl"))
    if tp1 and tp2:
        lines.append(f"8B batch-1 TP=2 / TP=1: {tp2 / tp1:.2f}x (goal {GOAL_TP2_SPEEDUP}x)")
    if tp2 and nccl:
        lines.append(f"8B batch-1 TP=2 custom all-reduce / NCCL only: {tp2 / nccl:.2f}x")
    for name in ("8b-tp1", "8b-tp2"):
        if name in engines and engines[name].get("throughput"):
            lines.append(f"{name} max-load: "
                         f"{engines[name]['throughput']['output_tokens_per_s']:.0f} tok/s")
    for name in ("70b-tp2", "70b-tp2-fp8"):
        r = engines.get(name)
        if r and "floor_tokens_per_s" in r:
            lines.append(f"{name} batch-1: {r['latency']['output_tokens_per_s']:.1f} tok/s = "
                         f"{r['latency']['output_tokens_per_s'] / r['floor_tokens_per_s']:.0%} "
                         f"of its weight-read floor ({r['weight_bytes_per_gpu'] / 1e9:.1f} GB "
                         f"per GPU at {r['copy_bytes_per_s'] / 1e12:.2f} TB/s copy)")
    fp8 = engines.get("70b-tp2-fp8")
    if fp8 and fp8.get("throughput"):
        ours = fp8["throughput"]["output_tokens_per_s"]
        lines.append(f"70B FP8 TP=2 max-load: {ours:.0f} tok/s vs TensorRT-LLM's published "
                     f"{TRTLLM_70B_FP8_TP2_TOK_S:.0f} ({ours / TRTLLM_70B_FP8_TP2_TOK_S:.2f}x; "
                     "not the same workload, a reference only)")
    ep, tp = _batch1(engines, "moe-ep2"), _batch1(engines, "moe-tp2")
    if ep and tp:
        lines.append(f"MoE batch-1 EP=2 / TP=2: {ep / tp:.2f}x")
        thr = [engines[n].get("throughput") for n in ("moe-ep2", "moe-tp2")]
        if all(thr):
            lines.append(f"MoE max-load EP=2 / TP=2: "
                         f"{thr[0]['output_tokens_per_s'] / thr[1]['output_tokens_per_s']:.2f}x")
    return "\n".join(lines)
