"""Where a model's decode step goes on the GPU: one engine per model (graphs on, as the
benchmarks run), a warm-up, then one `generate` of `--batch` prompts of 16 tokens x `--osl`
output tokens under torch.profiler. Per output step: wall, GPU busy time, and the top kernels
by time (their calls per step). A diagnosis aid, not a figure of merit: the profiler adds
host time; `gpu_models.py` times the same models without it.

    python benchmarks/gpu_profile_decode.py [--models dummy:gpt-oss-20b,...] [--batch 1,128]
        [--osl 64] [--budget 200] [--mtp K] [--quantization fp8]
        # --mtp: DeepSeek-V3 models with MTP drafting
        (random weights accept ~nothing: a step is a verify of 1 + K tokens and K drafts)
    python benchmarks/gpu_profile_decode.py --smoke   # the plumbing on the CPU
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

TOP = 12


def profile_model(model: str, batches: list[int], osl: int, smoke: bool,
                  mtp: int = 0, quantization: str | None = None) -> dict:
    from gpu_fastpath import _profiler, _trace_events, short_kernel_name, trace_summary
    from tllm import LLM, SamplingParams
    device = torch.device("cpu" if smoke else "cuda")
    started = time.perf_counter()
    options = {"dtype": "float32"} if smoke else {}
    if quantization:
        options["quantization"] = quantization
    if mtp:
        from tllm import MTPDecodingConfig
        options["speculative_config"] = MTPDecodingConfig(max_draft_len=mtp)
    llm = LLM(model, device=device.type, max_batch_size=max(batches),
              max_seq_len=16 + osl + 8 + mtp, **options)
    result = {"model": model, "quantization": quantization,
              "build_s": time.perf_counter() - started, "batches": {}}
    params = SamplingParams(max_tokens=osl, temperature=0.0, ignore_eos=True)
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    for batch in batches:
        prompts = [[(7 * i + j) % 1000 + 10 for j in range(16)] for i in range(batch)]
        llm.generate(prompts, params)  # warm-up (compiles, graphs)
        sync()
        started = time.perf_counter()
        llm.generate(prompts, params)
        sync()
        unprofiled_ms = (time.perf_counter() - started) * 1e3
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            with _profiler(device) as prof:
                sync()
                started = time.perf_counter()
                llm.generate(prompts, params)
                sync()
                wall_ms = (time.perf_counter() - started) * 1e3
            prof.export_chrome_trace(str(path))
            trace = trace_summary(_trace_events(path))
        per_step = lambda value: value / osl  # noqa: E731
        top = [{"name": short_kernel_name(name)[:140], "ms_per_step": per_step(us / 1e3),
                "calls_per_step": per_step(trace["per_name_count"][name])}
               for name, us in trace["per_name_us"].most_common(TOP)]
        result["batches"][batch] = {
            "unprofiled_ms_per_step": per_step(unprofiled_ms),
            "profiled_ms_per_step": per_step(wall_ms),
            "gpu_busy_ms_per_step": per_step(trace["busy_us"] / 1e3),
            "kernels_per_step": per_step(sum(trace["per_name_count"].values())),
            "top_kernels": top}
        print(format_batch(model, batch, result["batches"][batch]), flush=True)
    llm.shutdown()
    return result


def format_batch(model: str, batch: int, row: dict) -> str:
    lines = [f" {model} decode, batch {batch} ".center(100, "="),
             f"wall per step {row['unprofiled_ms_per_step']:.3f} ms (profiled "
             f"{row['profiled_ms_per_step']:.3f}); GPU busy {row['gpu_busy_ms_per_step']:.3f} ms;"
             f" {row['kernels_per_step']:.0f} kernels a step"]
    for kernel in row["top_kernels"]:
        lines.append(f"  {kernel['ms_per_step']:8.3f} ms  x{kernel['calls_per_step']:6.1f}  "
                     f"{kernel['name']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dummy:gpt-oss-20b,dummy:qwen3-30b-a3b")
    parser.add_argument("--batch", default="1,128")
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--budget", type=float, default=200.0, help="seconds, all models")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--mtp", type=int, default=0, help="MTP drafts a step (0: none)")
    parser.add_argument("--quantization", default=None, help="e.g. fp8 (at load)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    if args.child:  # one model in its own process
        print("RESULT " + json.dumps(profile_model(args.child, batches, args.osl, args.smoke,
                                                   args.mtp, args.quantization)))
        return 0
    models = ["dummy:smollm2-135m"] if args.smoke else args.models.split(",")
    results, deadline = [], time.perf_counter() + args.budget
    for i, model in enumerate(models):
        share = (deadline - time.perf_counter()) / (len(models) - i)
        argv = [sys.executable, __file__, "--child", model, "--batch", args.batch,
                "--osl", str(args.osl), "--mtp", str(args.mtp)]
        argv += ["--quantization", args.quantization] if args.quantization else []
        argv += ["--smoke"] if args.smoke else []
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=share)
        except subprocess.TimeoutExpired as exc:
            print(f"{model}: timed out after {share:.0f} s\n{(exc.stdout or b'')[-2000:]}")
            continue
        sys.stderr.write(done.stderr[-3000:] if done.returncode else "")
        for line in done.stdout.splitlines():
            if line.startswith("RESULT "):
                results.append(json.loads(line[7:]))
            else:
                print(line)
    out = Path(os.environ.get("OUT", "/tmp")) / "gpu_profile_decode.json"
    out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
