"""Issue 17's fused-MoE kernel figures on one H200: tllm.kernels.triton.fused_moe against the
per-expert loop of torch matmuls (tllm.kernels.moe.fused_experts_ref), same process, same
inputs, in the expert shapes of Mixtral-8x7B (H 4096, I 14336, 8 experts, top-2) and
Qwen3-30B-A3B (H 2048, I 768, 128 experts, top-8), bf16, at 1, 8, 64, 256, 1024 tokens.

  tests   (--tests) the fused-MoE kernel tests compiled on the GPU (pytest), first
  bench   per shape: the max abs diff of fused vs the loop (and both vs a float32 loop);
          times: fused as a CUDA graph of back-to-back calls (device time), fused eager and
          the loop eager (CUDA events around calls, median of repeats; the loop syncs on
          the host for its per-expert counts, as a loop over experts must); each call
          takes the next of several routings so the experts read differ call to call.
          Weight bytes = distinct experts hit x an expert's bytes; GB/s = those bytes /
          graph time, against the device-to-device copy bandwidth measured in the run.
  sweep   (--sweep) per shape, tiles of each GEMM timed alone (graphs) for the candidate
          block_m: the best against the default table (moe_config)

    python benchmarks/gpu_moe_kernel.py --out $OUT/moe.json [--tests] [--sweep] [--budget 240]
    python benchmarks/gpu_moe_kernel.py --cpu-smoke --out /tmp/moe.json   # plumbing, CPU
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--cpu-smoke" in sys.argv:  # before any kernel module is imported
    os.environ["TRITON_INTERPRET"] = "1"
from gpu_common import Tee, start_watchdog  # noqa: E402
from gpu_fp8 import copy_bandwidth, time_calls  # noqa: E402
from tllm.bench.offline_cli import no_nan  # noqa: E402


@dataclass(frozen=True)
class MoeShape:
    hidden: int
    inter: int
    experts: int
    top_k: int

    @property
    def expert_bytes(self) -> int:  # bf16 gate, up and down
        return 3 * self.hidden * self.inter * 2


FULL_SHAPES = {"mixtral-8x7b": MoeShape(4096, 14336, 8, 2),
               "qwen3-30b-a3b": MoeShape(2048, 768, 128, 8)}
SMOKE_SHAPES = {"tiny-8e": MoeShape(64, 48, 8, 2), "tiny-16e": MoeShape(32, 16, 16, 4)}
FULL_BATCHES = (1, 8, 64, 256, 1024)
SMOKE_BATCHES = (1, 5)
ROUTINGS = 4          # routings cycled between calls
GOAL_BATCH, GOAL_SPEEDUP = 64, 3.0


class Session:
    """Time budget, results, the JSON file (the watchdog of gpu_common needs these)."""

    def __init__(self, args) -> None:
        self.start = time.perf_counter()
        self.end = self.start + args.budget
        self.out = Path(args.out) if args.out else None
        self.results: dict = {"meta": meta(args)}

    def remaining(self) -> float:
        return self.end - time.perf_counter()

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f} s] {message}", flush=True)

    def save(self) -> None:
        if self.out is not None:
            self.out.write_text(json.dumps(no_nan(self.results), indent=1, default=str))


# ---- tests ----

def section_tests(session: Session, cuda: bool) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/kernels/test_fused_moe.py"]
    if cuda:
        cmd += ["-n", "4"]
    timeout = max(10.0, min(60.0, session.remaining() - 60))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        return {"passed": None, "timed_out_s": timeout}
    tail = (proc.stdout + proc.stderr)[-3000:]
    session.log(tail.strip().splitlines()[-1] if tail.strip() else "no pytest output")
    return {"passed": proc.returncode == 0, "tail": tail}


# ---- inputs ----

def make_experts(shape: MoeShape, device, dtype):
    import torch
    w13 = torch.randn(shape.experts, 2 * shape.inter, shape.hidden, device=device, dtype=dtype)
    w2 = torch.randn(shape.experts, shape.hidden, shape.inter, device=device, dtype=dtype)
    return w13.mul_(shape.hidden ** -0.5), w2.mul_(shape.inter ** -0.5)


def make_inputs(shape: MoeShape, num_tokens: int, device, dtype, seed: int):
    """hidden [T, H] and a softmax top-k routing (renormalised), on random logits."""
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(num_tokens, shape.hidden, device=device, dtype=dtype, generator=gen)
    logits = torch.randn(num_tokens, shape.experts, device=device, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(shape.top_k, -1)
    return hidden, (weights / weights.sum(-1, keepdim=True)).float(), ids


def time_eager(fns: list, device, repeats: int = 7) -> float:
    """Microseconds per call of the fns run back to back as Python calls (launch and host
    work included), median over repeats."""
    import torch
    for fn in fns:
        fn()
    if device.type != "cuda":
        started = time.perf_counter()
        for fn in fns:
            fn()
        return (time.perf_counter() - started) / len(fns) * 1e6
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for fn in fns:
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return statistics.median(times)


# ---- bench ----

def bench_shape(session: Session, name: str, shape: MoeShape, w13, w2, w_fp32,
                num_tokens: int, device, rates: dict, config=None,
                loop_us: float | None = None) -> dict:
    """One shape: correctness, then times. config None: the default table's; w_fp32 None:
    no float32 check; loop_us given: the loop is not timed again."""
    from tllm.kernels import moe
    from tllm.kernels.triton import fused_moe
    sets = [make_inputs(shape, num_tokens, device, w13.dtype, seed)
            for seed in range(ROUTINGS)]
    fused = [lambda s=s: fused_moe.fused_experts_triton(s[0], w13, w2, s[1], s[2],
                                                         config=config) for s in sets]
    loop = [lambda s=s: moe.fused_experts_ref(s[0], w13, w2, s[1], s[2]) for s in sets]
    got, want = fused[0]().float(), loop[0]().float()
    cfg = config or fused_moe.moe_config(num_tokens, shape.top_k, shape.experts)
    row = {"num_tokens": num_tokens, "config": asdict(cfg),
           "max_abs_diff_vs_loop": float((got - want).abs().max()),
           "ref_max_abs": float(want.abs().max())}
    if w_fp32 is not None:
        exact = moe.fused_experts_ref(sets[0][0].float(), *w_fp32, *sets[0][1:]).float()
        row.update(rel_err_fused_vs_fp32=rel(got, exact), rel_err_loop_vs_fp32=rel(want, exact))
        del exact
    del got, want
    row["fused_graph_us"], row["fused_graph_timing"] = time_calls(fused, device)
    row["fused_eager_us"] = time_eager(fused, device)
    row["loop_eager_us"] = loop_us or time_eager(loop, device, repeats=5)
    row["speedup_eager"] = row["loop_eager_us"] / row["fused_eager_us"]
    row["speedup_graph"] = row["loop_eager_us"] / row["fused_graph_us"]
    distinct = statistics.mean(int(s[2].unique().numel()) for s in sets)
    row["weight_bytes"] = distinct * shape.expert_bytes
    row["weight_gb_s"] = row["weight_bytes"] / row["fused_graph_us"] / 1e3
    row["of_copy_bw"] = row["weight_gb_s"] * 1e9 / rates["copy_b_s"]
    row["weight_floor_us"] = row["weight_bytes"] / rates["copy_b_s"] * 1e6
    flop = 2 * num_tokens * shape.top_k * 3 * shape.hidden * shape.inter
    row["tflop_s"] = flop / row["fused_graph_us"] / 1e6
    row["compute_floor_us"] = flop / rates["mm_flop_s"] * 1e6
    session.log(f"{name} T={num_tokens}{' tuned' if config else ''}: fused "
                f"{row['fused_graph_us']:.1f} us graph / {row['fused_eager_us']:.1f} eager, "
                f"loop {row['loop_eager_us']:.1f} us, x{row['speedup_eager']:.1f}, "
                f"{row['weight_gb_s']:.0f} GB/s, max|diff| {row['max_abs_diff_vs_loop']:.2e}")
    return row


def rel(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def measure_rates(device) -> dict:
    """Ceilings measured in this run: copy bandwidth, a large bf16 matmul's rate."""
    import torch
    cuda = device.type == "cuda"
    size = 8192 if cuda else 128
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    us, _ = time_calls([lambda: a @ a], device, min_calls=5)
    return {"copy_b_s": copy_bandwidth(device, (2 << 30) if cuda else (16 << 20)),
            "mm_flop_s": 2 * size ** 3 / (us * 1e-6)}


# ---- sweep ----

# (block_n, block_k, warps, stages); small tiles (block_m <= 32) and large ones
GATE_UP_TILES = {"small": ((32, 128, 4, 4), (64, 128, 4, 3), (32, 256, 4, 3), (64, 64, 4, 4),
                           (16, 256, 4, 4)),
                 "large": ((64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3))}
DOWN_TILES = {"small": ((32, 128, 4, 4), (64, 128, 4, 4), (128, 128, 4, 3), (32, 256, 4, 3),
                        (64, 256, 4, 3)),
              "large": ((128, 64, 4, 4), (128, 128, 4, 3), (256, 64, 8, 3), (128, 64, 8, 4))}
GROUP_M = {16: 1, 32: 8, 64: 8, 128: 16}


def candidate_block_ms(shape: MoeShape, num_tokens: int) -> list[int]:
    per_expert = num_tokens * shape.top_k / shape.experts
    return [bm for bm in (16, 32, 64, 128) if bm <= max(16, 2 * per_expert)][-2:]


def sweep_shape(session: Session, shape: MoeShape, w13, w2, num_tokens: int, device,
                deadline: float) -> dict:
    """Each GEMM alone (graph time) over the tiles, for each candidate block_m."""
    from tllm.kernels.triton import fused_moe
    from tllm.kernels.triton.fused_moe import GemmTile
    sets = [make_inputs(shape, num_tokens, device, w13.dtype, seed)
            for seed in range(ROUTINGS)]
    out = {}
    for bm in candidate_block_ms(shape, num_tokens):
        group = GROUP_M[bm]
        blocks = [fused_moe.align_pairs(s[2], shape.experts, bm) for s in sets]
        inters = [fused_moe.expert_gemm(s[0], w13, b, GemmTile(64, 64), rows_per_a=shape.top_k,
                                        gated=True) for s, b in zip(sets, blocks)]
        runs = {"gate_up": [], "down": []}
        size = "small" if bm <= 32 else "large"
        for stage, tiles in (("gate_up", GATE_UP_TILES[size]), ("down", DOWN_TILES[size])):
            for tile in map(lambda t: GemmTile(*t), tiles):
                if time.perf_counter() > deadline:
                    break
                if stage == "gate_up":
                    fns = [lambda s=s, b=b, t=tile: fused_moe.expert_gemm(
                        s[0], w13, b, t, group, shape.top_k, gated=True)
                        for s, b in zip(sets, blocks)]
                else:
                    fns = [lambda s=s, b=b, i=i, t=tile: fused_moe.expert_gemm(
                        i, w2, b, t, group, topk_weights=s[1])
                        for s, b, i in zip(sets, blocks, inters)]
                try:
                    runs[stage].append({"tile": asdict(tile),
                                        "us": time_calls(fns, device)[0]})
                except Exception as exc:  # e.g. out of shared memory: record, go on
                    runs[stage].append({"tile": asdict(tile),
                                        "error": f"{type(exc).__name__}: {exc}"[:200]})
        best = {stage: min((r for r in rs if "us" in r), key=lambda r: r["us"], default=None)
                for stage, rs in runs.items()}
        out[bm] = {"group_m": group, "runs": runs, "best": best}
        if all(best.values()):
            session.log(f"  sweep E={shape.experts} T={num_tokens} block_m={bm}: gate_up "
                        f"{best['gate_up']['us']:.1f} us {tuple(best['gate_up']['tile'].values())}"
                        f", down {best['down']['us']:.1f} us "
                        f"{tuple(best['down']['tile'].values())}")
    return out


# ---- driver ----

def bench_model(session: Session, name: str, shape: MoeShape, weights, batches, device,
                rates: dict) -> None:
    w13, w2 = weights
    w_fp32 = (w13.float(), w2.float())
    rows = session.results["models"][name]["rows"]
    for num_tokens in batches:
        if session.remaining() < 20:
            rows[num_tokens] = {"skipped": "out of time"}
            continue
        try:
            rows[num_tokens] = bench_shape(session, name, shape, w13, w2, w_fp32, num_tokens,
                                           device, rates)
        except Exception as exc:
            traceback.print_exc()
            rows[num_tokens] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        session.save()


SWEEP_ORDER = (64, 1, 1024, 256, 8)  # the goal first, then decode, then prefill
TUNED_RESERVE_S = 45.0  # the sweep stops this long before the end: the tuned pass runs then


def sweep_models(session: Session, shapes: dict, weights: dict, batches, device) -> None:
    """Shapes in SWEEP_ORDER, the models interleaved: what the budget cuts off matters least."""
    order = [t for t in SWEEP_ORDER if t in batches] + [t for t in batches
                                                         if t not in SWEEP_ORDER]
    for num_tokens in order:
        for name, shape in shapes.items():
            deadline = time.perf_counter() + min(25.0, session.remaining() - TUNED_RESERVE_S)
            if deadline < time.perf_counter() + 5:
                return
            sweep = session.results["models"][name]["sweep"]
            try:
                sweep[num_tokens] = sweep_shape(session, shape, *weights[name], num_tokens,
                                                device, deadline)
            except Exception as exc:
                traceback.print_exc()
                sweep[num_tokens] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            session.save()


def best_config(per_block_m: dict):
    """The block_m whose best gate_up + best down is fastest, with those tiles."""
    from tllm.kernels.triton.fused_moe import GemmTile, MoeConfig
    timed = [(s["best"]["gate_up"]["us"] + s["best"]["down"]["us"], bm, s)
             for bm, s in per_block_m.items()
             if isinstance(s, dict) and s.get("best") and all(s["best"].values())]
    if not timed:
        return None
    _, bm, s = min(timed, key=lambda item: item[0])
    return MoeConfig(bm, GemmTile(**s["best"]["gate_up"]["tile"]),
                     GemmTile(**s["best"]["down"]["tile"]), s["group_m"])


def tune_models(session: Session, shapes: dict, weights: dict, device, rates: dict) -> None:
    """The whole fused call again with each swept shape's best tiles (the loop's time is
    the default pass's)."""
    for name, shape in shapes.items():
        model = session.results["models"][name]
        model["tuned"] = {}
        for num_tokens, per_bm in model["sweep"].items():
            cfg = best_config(per_bm)
            default = model["rows"].get(num_tokens, {})
            if cfg is None or "loop_eager_us" not in default or session.remaining() < 5:
                continue
            try:
                model["tuned"][num_tokens] = bench_shape(
                    session, name, shape, *weights[name], None, num_tokens, device, rates,
                    config=cfg, loop_us=default["loop_eager_us"])
            except Exception as exc:
                traceback.print_exc()
                model["tuned"][num_tokens] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            session.save()


def summary(session: Session) -> str:
    rates = session.results.get("rates", {})
    lines = [" fused MoE (Triton) vs per-expert loop, bf16 ".center(124, "="),
             f"copy bandwidth {rates.get('copy_b_s', 0) / 1e9:.0f} GB/s, bf16 mm "
             f"{rates.get('mm_flop_s', 0) / 1e12:.0f} TFLOP/s; tests passed: "
             f"{session.results.get('tests', {}).get('passed', 'not run')}",
             f"{'model':<22}{'T':>6}{'graph us':>10}{'eager us':>10}{'loop us':>10}"
             f"{'x eager':>9}{'x graph':>9}{'GB/s':>8}{'of copy':>9}{'floor us':>10}"
             f"{'TFLOP/s':>9}{'max|diff|':>11}"]
    for name, model in session.results.get("models", {}).items():
        for label, rows in ((name, model["rows"]), (f"{name} tuned", model.get("tuned", {}))):
            lines += [_summary_line(label, t, r) for t, r in rows.items()]
        for t, per_bm in model.get("sweep", {}).items():
            best = best_config(per_bm) if isinstance(per_bm, dict) else None
            lines.append(f"  best tiles {name} T={t}: {best}")
    lines.append(f"goal: fused >= {GOAL_SPEEDUP}x the loop at batch {GOAL_BATCH}")
    return "\n".join(lines)


def _summary_line(label: str, num_tokens, r: dict) -> str:
    if "fused_graph_us" not in r:
        return f"{label:<22}{num_tokens:>6}  {str(r)[:90]}"
    floor = max(r["weight_floor_us"], r["compute_floor_us"])
    return (f"{label:<22}{num_tokens:>6}{r['fused_graph_us']:>10.1f}"
            f"{r['fused_eager_us']:>10.1f}{r['loop_eager_us']:>10.1f}"
            f"{r['speedup_eager']:>9.1f}{r['speedup_graph']:>9.1f}{r['weight_gb_s']:>8.0f}"
            f"{r['of_copy_bw']:>9.0%}{floor:>10.1f}{r['tflop_s']:>9.1f}"
            f"{r['max_abs_diff_vs_loop']:>11.2e}")


def meta(args) -> dict:
    import torch
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "torch": torch.__version__,
            "routings_cycled": ROUTINGS}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available() and not args.cpu_smoke:
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, sms=props.multi_processor_count)
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON results path (log beside it)")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds in all")
    parser.add_argument("--tests", action="store_true", help="pytest the kernel tests first")
    parser.add_argument("--sweep", action="store_true", help="time tile candidates")
    parser.add_argument("--models", default=None, help="comma-separated subset")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpreter")
    args = parser.parse_args()
    if args.out:
        log = open(Path(args.out).with_suffix(".log"), "w")
        sys.stdout = Tee(sys.__stdout__, log)
        sys.stderr = Tee(sys.__stderr__, log)
    import torch
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    shapes = SMOKE_SHAPES if args.cpu_smoke else FULL_SHAPES
    if args.models:
        shapes = {k: v for k, v in shapes.items() if k in args.models.split(",")}
    batches = SMOKE_BATCHES if args.cpu_smoke else FULL_BATCHES
    session = Session(args)
    start_watchdog(session, summary)
    if args.tests:
        session.results["tests"] = section_tests(session, device.type == "cuda")
        session.save()
    session.results["rates"] = rates = measure_rates(device)
    session.log(f"copy {rates['copy_b_s'] / 1e9:.0f} GB/s, bf16 mm "
                f"{rates['mm_flop_s'] / 1e12:.0f} TFLOP/s")
    weights = {name: make_experts(shape, device, torch.bfloat16)
               for name, shape in shapes.items()}
    session.results["models"] = {name: {"shape": asdict(shape), "rows": {}, "sweep": {}}
                                 for name, shape in shapes.items()}
    for name, shape in shapes.items():
        bench_model(session, name, shape, weights[name], batches, device, rates)
    if args.sweep:
        sweep_models(session, shapes, weights, batches, device)
        tune_models(session, shapes, weights, device, rates)
    session.save()
    print(summary(session), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
