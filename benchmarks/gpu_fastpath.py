"""Issue 4's figures in one device call, on dummy:llama-3.1-8b (bf16):

  floor       device-to-device copy bandwidth and the model's weight bytes -> the batch-1
              bandwidth floor in tokens/s
  hf          HF transformers `generate` on the same config (random weights): batch 1
              ISL 128 / OSL 256 and batch 64 ISL 128 / OSL 128 (run first, then freed)
  latency     `bench latency` batch 1, ISL 128, OSL 256, next to the floor
  throughput  `bench throughput` ISL 128 / OSL 128, 1000 requests, max load; plus tllm at
              batch 64 on the HF comparator's shape
  profile     one decode step at batch 256: wall time vs GPU busy time (torch.profiler),
              top kernels, the CPU/Python gap
  long        `bench throughput` ISL 1000 / OSL 1000, as many requests (up to 1000) as fit
              the time that is left

Every part has a time budget, prints its figures as it finishes, and rewrites
$OUT/fastpath.json (when OUT is set; the printed log goes to $OUT/fastpath.log too); a
short summary table comes last. A failed part is recorded and the next one runs.

    python benchmarks/gpu_fastpath.py [--parts floor,hf,latency,throughput,profile,long]
        [--budget 480] [--extra-llm-api-options opts.yml]
    python benchmarks/gpu_fastpath.py --smoke     # the plumbing, on the CPU, tiny model
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tllm import LLM  # noqa: E402
from tllm.bench.offline import (LatencyConfig, ThroughputConfig, exact_length_params,  # noqa: E402
                                model_vocab_size, run_latency, run_throughput,
                                synthetic_prompts)
from tllm.bench.offline_cli import format_report, load_extra_options, no_nan  # noqa: E402

from gpu_common import Tee, interval_union, round_up, start_watchdog  # noqa: E402

PARTS = ("floor", "hf", "latency", "throughput", "profile", "long")
FLOOR_CONVENTION = ("copy bandwidth = (bytes read + bytes written) / time of a large "
                    "device-to-device tensor copy (median); floor tok/s at batch 1 = copy "
                    "bandwidth / weight bytes (every parameter, embedding included, read once "
                    "per decode step)")
_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_TRACE_LIMIT_BYTES = 16 << 20


@dataclass(frozen=True)
class Plan:
    model: str
    dtype: str
    device: str
    max_batch_size: int = 256
    latency_shape: tuple[int, int] = (128, 256)          # ISL, OSL at batch 1
    throughput_shape: tuple[int, int] = (128, 128)
    throughput_requests: int = 1000
    long_shape: tuple[int, int] = (1000, 1000)
    long_requests: int = 1000
    hf_batch: int = 64                                    # at throughput_shape
    profile_batch: int = 256                              # at ISL throughput_shape[0]
    profile_osls: tuple[int, int] = (8, 72)               # the step difference is profiled
    copy_bytes: int = 4 << 30
    latency_goal: float | None = 245.0        # tok/s, issue 4
    throughput_goal: float | None = 16000.0   # tok/s at throughput_shape, issue 4
    # seconds per part at --budget 480 (scaled with it); `long` gets what is left
    budgets: tuple[tuple[str, float], ...] = (("floor", 20), ("hf", 90), ("latency", 60),
                                              ("throughput", 100), ("profile", 45))


FULL = Plan(model="dummy:llama-3.1-8b", dtype="bfloat16", device="cuda")
SMOKE = Plan(model="", dtype="float32", device="cpu", max_batch_size=8,
             latency_shape=(8, 16), throughput_shape=(16, 8), throughput_requests=24,
             long_shape=(32, 32), long_requests=16, hf_batch=4, profile_batch=8,
             profile_osls=(2, 6), copy_bytes=64 << 20, latency_goal=None,
             throughput_goal=None)
_RESERVE_S = 15.0  # kept for the summary and teardown


class Session:
    """Time budget, results, and the JSON/log under $OUT."""

    def __init__(self, plan: Plan, budget_s: float, out_dir: Path | None, extra: dict) -> None:
        self.plan = plan
        self.extra = extra
        self.start = time.perf_counter()
        self.end = self.start + budget_s
        self.scale = budget_s / 480
        self.out_dir = out_dir
        self.results: dict = {"meta": _meta(plan, budget_s, extra)}

    def remaining(self) -> float:
        return self.end - _RESERVE_S - time.perf_counter()

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f} s] {message}", flush=True)

    def run_part(self, name: str, fn, *args) -> dict | None:
        cap = dict(self.plan.budgets).get(name)
        budget = self.remaining() if cap is None else min(cap * self.scale, self.remaining())
        if budget < min(5.0, cap * self.scale if cap else 5.0):
            self.log(f"--- {name}: skipped, {self.remaining():.0f} s left of the budget")
            self.results[name] = {"skipped": "out of time"}
            return None
        self.log(f"--- {name} (budget {budget:.0f} s)")
        started = time.perf_counter()
        try:
            result = fn(self, time.perf_counter() + budget, *args)
        except Exception as exc:  # one failed part must not cost the others
            traceback.print_exc()
            sys.stderr.flush()
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback":
                      traceback.format_exc()}
        result["part_s"] = time.perf_counter() - started
        self.results[name] = result
        self.save()
        self.log(f"--- {name} done in {result['part_s']:.1f} s")
        return result

    def llm(self, max_batch_size: int, isl: int, osl: int) -> LLM:
        block = (self.extra.get("kv_cache_config") or {}).get("tokens_per_block", 32)
        kwargs = {**self.extra, "dtype": self.plan.dtype, "device": self.plan.device,
                  "max_batch_size": max_batch_size, "max_seq_len": round_up(isl + osl, block)}
        started = time.perf_counter()
        llm = LLM(self.plan.model, **kwargs)
        self.log(f"built {self.plan.model} (max_batch_size {max_batch_size}, max_seq_len "
                 f"{kwargs['max_seq_len']}) in {time.perf_counter() - started:.1f} s")
        return llm

    def save(self) -> None:
        if self.out_dir is not None:
            (self.out_dir / "fastpath.json").write_text(json.dumps(no_nan(self.results),
                                                                   indent=1))


# ---- floor ----

def part_floor(session: Session, deadline: float) -> dict:
    plan = session.plan
    copy_bw = copy_bandwidth(torch.device(plan.device), plan.copy_bytes)
    weights, embedding = weight_bytes(plan.model, getattr(torch, plan.dtype))
    result = {"copy_bytes": plan.copy_bytes, "copy_bw_gbs": copy_bw / 1e9,
              "weight_bytes": weights, "embedding_bytes": embedding,
              "floor_tok_s": copy_bw / weights,
              "floor_tok_s_without_input_embedding": copy_bw / (weights - embedding),
              "convention": FLOOR_CONVENTION}
    session.log(f"copy bandwidth {result['copy_bw_gbs']:.0f} GB/s (read + write), weights "
                f"{weights / 1e9:.2f} GB -> floor {result['floor_tok_s']:.1f} tok/s at batch 1")
    session.log(f"convention: {FLOOR_CONVENTION}")
    return result


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - started)
    del src, dst
    return 2 * nbytes / statistics.median(seconds)


def weight_bytes(model: str, dtype: torch.dtype) -> tuple[int, int]:
    """(all parameters, the input embedding) in bytes, of the model tllm builds. Built on the
    CPU with empty (never touched) parameters, so it costs no real memory."""
    from tllm import loader
    from tllm.attention import get_attention_backend
    config, _ = loader.load_config(loader.resolve_model(model))
    built = loader.build_model(config, get_attention_backend("torch"), dtype,
                               torch.device("cpu"), 64)
    named = list(built.named_parameters())  # shared (tied) parameters appear once
    total = sum(p.numel() * p.element_size() for _, p in named)
    embedding = sum(p.numel() * p.element_size() for n, p in named if "embed_tokens" in n)
    return total, embedding


# ---- HF transformers comparator ----

def part_hf(session: Session, deadline: float) -> dict:
    plan = session.plan
    model = hf_model(plan.model, getattr(torch, plan.dtype), torch.device(plan.device))
    vocab = model.config.vocab_size
    result = {"attn_implementation": model.config._attn_implementation}
    try:
        runs = [("batch1", 1, plan.latency_shape), (f"batch{plan.hf_batch}", plan.hf_batch,
                                                    plan.throughput_shape)]
        for i, (key, batch, (isl, osl)) in enumerate(runs):
            share = (deadline - time.perf_counter()) / (len(runs) - i)
            result[key] = hf_generate(model, batch, isl, osl, vocab, share)
            r = result[key]
            note = f" (OSL cut from {osl} to fit the time budget)" if r["osl"] < osl else ""
            session.log(f"HF generate batch {batch}, ISL {isl} / OSL {r['osl']}: "
                        f"{r['output_tokens_per_s']:.1f} tok/s ({r['seconds']:.2f} s){note}")
    finally:
        del model
        _free_memory()
    return result


def hf_model(model: str, dtype: torch.dtype, device: torch.device):
    """HF transformers' own model class for the same config, random weights on the device."""
    import transformers
    from tllm import loader
    config, _ = loader.load_config(loader.resolve_model(model))
    cls = getattr(transformers, config.architectures[0])
    with torch.device(device), _hf_no_init():
        try:
            hf = cls._from_config(config, dtype=dtype, attn_implementation="sdpa")
        except TypeError:  # transformers 4.x spells it torch_dtype
            hf = cls._from_config(config, torch_dtype=dtype, attn_implementation="sdpa")
    hf = hf.to(device).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return hf


def _hf_no_init():
    for module in ("transformers.initialization", "transformers.modeling_utils"):
        with contextlib.suppress(ImportError, AttributeError):
            return __import__(module, fromlist=["no_init_weights"]).no_init_weights()
    return contextlib.nullcontext()


@torch.no_grad()
def hf_generate(model, batch: int, isl: int, osl: int, vocab: int, budget_s: float) -> dict:
    """Greedy `generate` of exactly `osl` tokens per row; OSL is cut (to a multiple of 16)
    when a short probe says the whole run would not fit `budget_s`."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(1)

    def timed(new_tokens: int) -> float:
        ids = torch.randint(0, vocab, (batch, isl), device=device, generator=generator)
        _sync(device)
        started = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
        _sync(device)
        if out.shape[1] != isl + new_tokens:
            raise RuntimeError(f"HF generated {out.shape[1] - isl} tokens, not {new_tokens}")
        return time.perf_counter() - started

    started = time.perf_counter()
    timed(2)  # warm-up
    probe_tokens = min(16, osl)
    per_token = timed(probe_tokens) / probe_tokens
    left = budget_s - (time.perf_counter() - started)
    fit = int(0.8 * left / per_token) if per_token > 0 else osl
    run_osl = osl if fit >= osl else max(16, fit // 16 * 16)
    seconds = timed(run_osl)
    return {"batch": batch, "isl": isl, "osl": run_osl, "osl_asked": osl, "seconds": seconds,
            "output_tokens_per_s": batch * run_osl / seconds,
            "probe_s_per_token": per_token}


# ---- tllm: latency, throughput, profile, long ----

def part_latency(session: Session, deadline: float) -> dict:
    isl, osl = session.plan.latency_shape
    with session.llm(1, isl, osl) as llm:
        config = LatencyConfig(isl=isl, osl=osl, batch_size=1, iterations=5, warmup=1,
                               time_limit_s=max(0.0, (deadline - time.perf_counter()) / 2))
        result = run_latency(llm, config)
    _free_memory()
    print(format_report(result), flush=True)
    floor = session.results.get("floor", {}).get("floor_tok_s")
    if floor:
        result["of_floor"] = result["output_tokens_per_s"] / floor
        session.log(f"batch 1: {result['output_tokens_per_s']:.1f} tok/s = "
                    f"{result['of_floor']:.1%} of the floor ({floor:.1f} tok/s)")
    return result


def part_throughput(session: Session, deadline: float, llm: LLM) -> dict:
    plan = session.plan
    isl, osl = plan.throughput_shape
    config = ThroughputConfig(isl=isl, osl=osl, num_requests=plan.throughput_requests,
                              warmup=plan.max_batch_size)
    config = replace(config, time_limit_s=max(1.0, deadline - time.perf_counter() - 10))
    result = {"max_load": run_throughput(llm, config)}
    print(format_report(result["max_load"]), flush=True)
    _say_truncated(session, result["max_load"])
    if deadline - time.perf_counter() > 5:  # the HF comparator's shape, same batch
        batch = LatencyConfig(isl=isl, osl=osl, batch_size=plan.hf_batch, iterations=2,
                              warmup=1)
        result[f"batch{plan.hf_batch}"] = run_latency(llm, batch)
        session.log(f"tllm batch {plan.hf_batch}, ISL {isl} / OSL {osl}: "
                    f"{result[f'batch{plan.hf_batch}']['output_tokens_per_s']:.1f} tok/s")
    return result


def part_long(session: Session, deadline: float) -> dict:
    plan = session.plan
    isl, osl = plan.long_shape
    num, why = long_request_count(session, deadline)
    session.log(f"ISL {isl} / OSL {osl}: {num} requests ({why})")
    with session.llm(plan.max_batch_size, isl, osl) as llm:
        config = ThroughputConfig(isl=isl, osl=osl, num_requests=num, warmup=0,
                                  time_limit_s=max(1.0, deadline - time.perf_counter()))
        result = run_throughput(llm, config)
    _free_memory()
    result["request_count_reason"] = why
    print(format_report(result), flush=True)
    _say_truncated(session, result)
    return result


def long_request_count(session: Session, deadline: float) -> tuple[int, str]:
    """Up to long_requests, as many as the 128/128 rate says fit (decode over longer contexts
    and 1000-token prefills are assumed to halve it); never fewer than a full batch."""
    plan = session.plan
    rate = session.results.get("throughput", {}).get("max_load", {}).get("output_tokens_per_s")
    if not rate:
        return plan.long_requests, "no 128/128 rate to size it from; the time limit guards it"
    seconds = deadline - time.perf_counter() - 30  # engine build and drain
    fit = int(0.8 * seconds * rate / 2 / plan.long_shape[1])
    if fit >= plan.long_requests:
        return plan.long_requests, "as asked"
    num = max(plan.max_batch_size, fit)
    return num, (f"FEWER than the {plan.long_requests} asked: about {fit} fit the "
                 f"{seconds:.0f} s left at half the 128/128 rate ({rate:.0f} tok/s)")


def part_profile(session: Session, deadline: float, llm: LLM) -> dict:
    """The difference between two runs of the same batch that differ only in OSL is pure
    decode steps at that batch: wall time (unprofiled) and GPU busy time (profiled) of it,
    per step."""
    plan = session.plan
    batch, isl = plan.profile_batch, plan.throughput_shape[0]
    short, long = plan.profile_osls
    num_steps = long - short
    generator = torch.Generator().manual_seed(7)
    device = torch.device(plan.device)

    def run(osl: int) -> tuple[float, int]:
        prompts = synthetic_prompts(batch, isl, model_vocab_size(llm), generator)
        steps = llm.get_stats()["num_steps"]
        _sync(device)
        started = time.perf_counter()
        llm.generate(prompts, exact_length_params(osl), use_tqdm=False)
        _sync(device)
        return time.perf_counter() - started, llm.get_stats()["num_steps"] - steps

    run(short)  # warm-up
    walls = {short: [], long: []}
    engine_steps = {}
    for _ in range(2):
        for osl in (short, long):
            wall, engine_steps[osl] = run(osl)
            walls[osl].append(wall)
    wall_per_step = (min(walls[long]) - min(walls[short])) / num_steps
    traces, profiled_walls = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for osl in (short, long):
            path = Path(tmp) / f"trace_{osl}.json"
            with _profiler(device) as prof:
                profiled_walls[osl], _ = run(osl)
            prof.export_chrome_trace(str(path))
            traces[osl] = trace_summary(_trace_events(path))
            if osl == long:
                _keep_trace(session, path, batch)
    step = diff_summaries(traces[long], traces[short], num_steps)
    result = {"batch": batch, "isl": isl, "osls": [short, long],
              "engine_steps": engine_steps, "decode_steps_profiled": num_steps,
              "wall_ms_per_step": 1e3 * wall_per_step,
              "profiled_wall_ms_per_step": 1e3 * (profiled_walls[long] - profiled_walls[short])
              / num_steps,
              **step}
    result["gpu_busy_fraction"] = result["gpu_busy_ms_per_step"] / result["wall_ms_per_step"]
    result["cpu_gap_ms_per_step"] = result["wall_ms_per_step"] - result["gpu_busy_ms_per_step"]
    print(format_profile(result), flush=True)
    return result


@contextlib.contextmanager
def _profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "profiler clears events each cycle"
        with profile(activities=activities) as prof:
            yield prof


def _trace_events(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def trace_summary(events: list[dict]) -> dict:
    """GPU busy time (the union of kernel/memcpy/memset intervals), time and count per kernel
    name, and CUDA runtime calls by name, from a Chrome trace's events (times in us)."""
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATEGORIES]
    per_name_us, per_name_count = Counter(), Counter()
    for e in device:
        per_name_us[e["name"]] += float(e.get("dur", 0))
        per_name_count[e["name"]] += 1
    runtime = Counter(e["name"] for e in events
                      if e.get("cat") in ("cuda_runtime", "cuda_driver"))
    return {"busy_us": interval_union([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
                                       for e in device]),
            "per_name_us": per_name_us, "per_name_count": per_name_count, "runtime": runtime}


def diff_summaries(long: dict, short: dict, num_steps: int, top: int = 12) -> dict:
    per_step = {name: (long["per_name_us"][name] - short["per_name_us"].get(name, 0.0))
                / num_steps / 1e3 for name in long["per_name_us"]}
    kernels = sorted(per_step.items(), key=lambda kv: -kv[1])[:top]
    runtime = {name: (long["runtime"][name] - short["runtime"].get(name, 0)) / num_steps
               for name in long["runtime"]}
    categories = Counter()
    for name, ms in per_step.items():
        categories[kernel_category(name)] += ms
    return {"gpu_busy_ms_per_step": (long["busy_us"] - short["busy_us"]) / num_steps / 1e3,
            "kernel_ms_per_step": sum(per_step.values()),
            "category_ms_per_step": dict(categories.most_common()),
            "kernels_per_step": (sum(long["per_name_count"].values())
                                 - sum(short["per_name_count"].values())) / num_steps,
            "top_kernels": [{"name": name, "ms_per_step": ms,
                             "calls_per_step": (long["per_name_count"][name]
                                                - short["per_name_count"].get(name, 0))
                             / num_steps} for name, ms in kernels],
            "runtime_calls_per_step": dict(sorted(runtime.items(), key=lambda kv: -kv[1])[:8])}


def kernel_category(name: str) -> str:
    lowered = name.lower()
    if any(k in lowered for k in ("nvjet", "gemm", "cutlass", "xmma", "matmul")):
        return "GEMM"
    if "attention" in lowered or "flash" in lowered:
        return "attention"
    if "memcpy" in lowered or "memset" in lowered:
        return "memcpy/memset"
    return "other (norms, rope, activations, copies, sampling)"


def short_kernel_name(name: str) -> str:
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "c10::", "std::"):
        name = name.replace(noise, "")
    return name


def format_profile(result: dict) -> str:
    lines = [f" decode step at batch {result['batch']} ".center(78, "="),
             f"wall per step (unprofiled)   {result['wall_ms_per_step']:9.3f} ms",
             f"wall per step (profiled)     {result['profiled_wall_ms_per_step']:9.3f} ms",
             (f"GPU busy per step            {result['gpu_busy_ms_per_step']:9.3f} ms "
              f"({result['gpu_busy_fraction']:.0%} of wall)"),
             f"GPU idle = CPU/Python gap    {result['cpu_gap_ms_per_step']:9.3f} ms",
             f"kernels per step             {result['kernels_per_step']:9.1f}"]
    for category, ms in result["category_ms_per_step"].items():
        lines.append(f"  {category:<52}{ms:>10.3f} ms")
    lines.append(f"{'top kernels':<58}{'ms/step':>10}{'calls':>8}")
    for k in result["top_kernels"]:
        lines.append(f"  {short_kernel_name(k['name'])[:56]:<56}{k['ms_per_step']:>10.3f}"
                     f"{k['calls_per_step']:>8.1f}")
    calls = ", ".join(f"{n} {c:g}" for n, c in result["runtime_calls_per_step"].items())
    lines.append(f"CUDA runtime calls per step: {calls or '-'}")
    return "\n".join(lines + ["=" * 78])


def _keep_trace(session: Session, path: Path, batch: int) -> None:
    if session.out_dir is None:
        return
    target = session.out_dir / f"profile_b{batch}_trace.json.gz"
    with open(path, "rb") as src, gzip.open(target, "wb", compresslevel=6) as dst:
        dst.write(src.read())
    size = target.stat().st_size
    if size > _TRACE_LIMIT_BYTES:
        target.unlink()
        session.log(f"trace not kept: {size / 2**20:.1f} MB gzipped, over the 16 MB limit")
    else:
        session.log(f"trace kept: {target.name} ({size / 2**20:.1f} MB)")


# ---- summary ----

def summary_table(session: Session) -> str:
    r = session.results
    rows = []
    floor = r.get("floor", {})
    if "floor_tok_s" in floor:
        rows += [("copy bandwidth, read + write (GB/s)", f"{floor['copy_bw_gbs']:.0f}", ""),
                 ("weight bytes (GB)", f"{floor['weight_bytes'] / 1e9:.2f}", ""),
                 ("bandwidth floor, batch 1 (tok/s)", f"{floor['floor_tok_s']:.1f}", "")]
    lat, hf, tput = r.get("latency", {}), r.get("hf", {}), r.get("throughput", {})
    shape = "{}/{}".format(*session.plan.latency_shape)
    if "output_tokens_per_s" in lat:
        note = f"{lat['of_floor']:.1%} of floor" if "of_floor" in lat else ""
        if session.plan.latency_goal:
            note += f"; goal >= {session.plan.latency_goal:g}"
        rows.append((f"tllm latency b1 {shape} (tok/s)", f"{lat['output_tokens_per_s']:.1f}",
                     note))
    if "batch1" in hf:
        ratio = (f"tllm/HF {lat['output_tokens_per_s'] / hf['batch1']['output_tokens_per_s']:.2f}x"
                 if "output_tokens_per_s" in lat else "")
        rows.append((f"HF b1 {hf['batch1']['isl']}/{hf['batch1']['osl']} (tok/s)",
                     f"{hf['batch1']['output_tokens_per_s']:.1f}", ratio))
    key = f"batch{session.plan.hf_batch}"
    shape = "{}/{}".format(*session.plan.throughput_shape)
    if key in tput:
        rows.append((f"tllm b{session.plan.hf_batch} {shape} (tok/s)",
                     f"{tput[key]['output_tokens_per_s']:.1f}", ""))
    if key in hf:
        ratio = (f"tllm/HF {tput[key]['output_tokens_per_s'] / hf[key]['output_tokens_per_s']:.2f}x"
                 if key in tput else "")
        rows.append((f"HF b{session.plan.hf_batch} {hf[key]['isl']}/{hf[key]['osl']} (tok/s)",
                     f"{hf[key]['output_tokens_per_s']:.1f}", ratio))
    for name, res in (("throughput", tput.get("max_load", {})), ("long", r.get("long", {}))):
        if "output_tokens_per_s" in res:
            work = res["workload"]
            note = f"{res['num_completed']}/{res['num_requests']} req"
            if res["is_truncated"]:
                note += ", TRUNCATED"
            if name == "long" and res["num_requests"] < session.plan.long_requests:
                note += f", fewer than {session.plan.long_requests} (time)"
            if name == "throughput" and session.plan.throughput_goal:
                note += f"; goal >= {session.plan.throughput_goal:g}"
            rows.append((f"tllm throughput {work['isl']}/{work['osl']} max load (tok/s)",
                         f"{res['output_tokens_per_s']:.0f}", note))
    prof = r.get("profile", {})
    if "wall_ms_per_step" in prof:
        rows += [(f"decode step b{prof['batch']}: wall (ms)", f"{prof['wall_ms_per_step']:.2f}",
                  ""),
                 ("  GPU busy (ms)", f"{prof['gpu_busy_ms_per_step']:.2f}",
                  f"{prof['gpu_busy_fraction']:.0%} of wall"),
                 ("  CPU/Python gap (ms)", f"{prof['cpu_gap_ms_per_step']:.2f}", "")]
        rows += [(f"  {category[:40]} (ms)", f"{ms:.2f}", "")
                 for category, ms in prof["category_ms_per_step"].items()]
    failed = [name for name in PARTS if "error" in r.get(name, {})]
    skipped = [name for name in PARTS if "skipped" in r.get(name, {})]
    meta = r["meta"]
    lines = [f" gpu_fastpath summary: {meta['device']}, {meta['date']} ".center(78, "=")]
    lines += [f"{name:<44}{value:>12}  {note}" for name, value, note in rows]
    if failed:
        lines.append(f"FAILED parts: {', '.join(failed)} (see the JSON / log)")
    if skipped:
        lines.append(f"skipped (out of time): {', '.join(skipped)}")
    lines.append(f"total {time.perf_counter() - session.start:.0f} s; "
                 "floor convention: read+write copy bytes / weight bytes")
    return "\n".join(lines + ["=" * 78])


# ---- plumbing ----

def _meta(plan: Plan, budget_s: float, extra: dict) -> dict:
    device = (torch.cuda.get_device_name() if plan.device == "cuda" and torch.cuda.is_available()
              else "cpu")
    versions = {"torch": torch.__version__}
    for name in ("triton", "transformers"):
        with contextlib.suppress(ImportError):
            versions[name] = __import__(name).__version__
    commit = None
    with contextlib.suppress(Exception):
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5, check=False).stdout.strip() or None
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": device, "versions": versions, "commit": commit, "argv": sys.argv,
            "model": plan.model, "dtype": plan.dtype, "budget_s": budget_s,
            "extra_llm_api_options": extra, "floor_convention": FLOOR_CONVENTION}


def _say_truncated(session: Session, result: dict) -> None:
    if result["is_truncated"]:
        session.log(f"NOTE: the time limit cut this run: {result['num_completed']} of "
                    f"{result['num_requests']} requests completed; tokens/s counts the "
                    "tokens generated until then")


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _smoke_model(directory: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def _check_trace_analysis() -> None:
    """The smoke run has no GPU kernels to parse: check the analysis on a made-up trace."""
    events = [{"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 10},
              {"ph": "X", "cat": "kernel", "name": "b", "ts": 5, "dur": 10},
              {"ph": "X", "cat": "gpu_memcpy", "name": "m", "ts": 30, "dur": 5},
              {"ph": "X", "cat": "cpu_op", "name": "c", "ts": 0, "dur": 100},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 1}]
    summary = trace_summary(events)
    assert summary["busy_us"] == 20 and summary["per_name_us"]["b"] == 10
    step = diff_summaries(summary, trace_summary([]), 2)
    assert step["gpu_busy_ms_per_step"] == 0.01 and step["kernels_per_step"] == 1.5
    assert step["runtime_calls_per_step"] == {"cudaLaunchKernel": 0.5}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {','.join(PARTS)} (default: all)")
    parser.add_argument("--budget", type=float, help="seconds for everything (default 480; "
                        "60 with --smoke)")
    parser.add_argument("--model", help=f"default {FULL.model}")
    parser.add_argument("--max-batch-size", type=int, help="default 256")
    parser.add_argument("--extra-llm-api-options", metavar="YAML",
                        help="more LLM(...) arguments for every tllm engine built here")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny random Llama, tiny sizes: checks the plumbing")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {','.join(PARTS)}")
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        log = open(out_dir / "fastpath.log", "w")  # noqa: SIM115 (open for the whole run)
        sys.stdout = Tee(sys.__stdout__, log)
        sys.stderr = Tee(sys.__stderr__, log)
    with tempfile.TemporaryDirectory() as tmp:
        plan = SMOKE if args.smoke else FULL
        if args.smoke:
            plan = replace(plan, model=_smoke_model(Path(tmp)))
            _check_trace_analysis()
        elif not torch.cuda.is_available():
            parser.error("no CUDA device: run with --smoke on a CPU")
        if args.model:
            plan = replace(plan, model=args.model)
        if args.max_batch_size:
            plan = replace(plan, max_batch_size=args.max_batch_size,
                           profile_batch=min(plan.profile_batch, args.max_batch_size))
        budget = args.budget or (60.0 if args.smoke else 480.0)
        session = Session(plan, budget, out_dir, load_extra_options(args.extra_llm_api_options))
        session.log(f"{plan.model} {plan.dtype} on {session.results['meta']['device']}, "
                    f"parts {','.join(parts)}, budget {budget:.0f} s, "
                    f"versions {session.results['meta']['versions']}")
        start_watchdog(session, summary_table)
        run_parts(session, parts)
        print(summary_table(session), flush=True)
        session.save()
    failed = any("error" in session.results.get(name, {}) for name in parts)
    return 1 if failed else 0


def run_parts(session: Session, parts: list[str]) -> None:
    for name, fn in (("floor", part_floor), ("hf", part_hf), ("latency", part_latency)):
        if name in parts:
            session.run_part(name, fn)
    if {"throughput", "profile"} & set(parts) and session.remaining() > 20:
        isl, osl = session.plan.throughput_shape
        if "profile" in parts:  # the profiled runs' OSL must fit the engine too
            osl = max(osl, session.plan.profile_osls[1])
        try:
            llm = session.llm(session.plan.max_batch_size, isl, osl)
        except Exception as exc:
            traceback.print_exc()
            for name in ("throughput", "profile"):
                if name in parts:
                    session.results[name] = {"error": f"engine build: {exc!r}"}
        else:
            with llm:
                for name, fn in (("throughput", part_throughput), ("profile", part_profile)):
                    if name in parts:
                        session.run_part(name, fn, llm)
            _free_memory()
    if "long" in parts:
        session.run_part("long", part_long)


if __name__ == "__main__":
    sys.exit(main())
