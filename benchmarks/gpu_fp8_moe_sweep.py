"""Tile sweep of the FP8 experts (tllm.kernels.triton.fp8_fused_moe) on one GPU, in the expert
shapes of Mixtral-8x7B (H 4096, I 14336, 8 experts, top-2) and Qwen3-30B-A3B (H 2048, I 768,
128 experts, top-8), per-channel and 128x128 block scales, at T = 1 .. 1024 tokens.

Each GEMM (gate_up, down) alone, times from CUDA graphs of back-to-back calls cycling over
routings: <= 8 tiles per (T, block_m), block_m 16 in the W8A16 form and 32+ in W8A8 (the
activations quantized beforehand, not timed), against the bf16 fused kernel's GEMM on the
same pairs (its default table), the fp8 weight-read floor (weight bytes of the experts hit /
the copy bandwidth measured here) and a compute floor (FLOPs / torch._scaled_mm's rate at
8192^3). Then the whole fp8_fused_experts_triton call (quantization and the top-k sum
included) with the bf16 table's tiles (before), the fp8 table's (now) and the best found,
next to the bf16 call. Prints the best per (T, GEMM, scheme) against the tables and a
ready-to-paste FP8_CONFIGS (benchmarks/fp8_moe_table.py); JSON and log to --out.

Triton compiles (~2 s a tile) would take the whole budget one at a time: worker processes
compile every candidate first, in parallel, into a shared Triton cache (--compile-workers).

    python benchmarks/gpu_fp8_moe_sweep.py --out $OUT/fp8_moe_sweep.json [--budget 140]
    python benchmarks/gpu_fp8_moe_sweep.py --cpu-smoke --out /tmp/fp8_sweep.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
if "--cpu-smoke" in sys.argv:  # before any kernel module is imported
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(tempfile.gettempdir(),
                                                        "tllm_fp8_moe_sweep_triton"))
import fp8_moe_table as table  # noqa: E402
from gpu_common import Tee, start_watchdog  # noqa: E402
from gpu_fp8 import copy_bandwidth, time_calls  # noqa: E402
from gpu_moe_kernel import FULL_SHAPES, MoeShape, Session  # noqa: E402

SMOKE_SHAPES = {"tiny-8e": MoeShape(64, 64, 8, 2), "tiny-16e": MoeShape(64, 32, 16, 4)}
FULL_BATCHES = (512, 1024, 256, 64, 1, 16)  # the max-load steps first
SMOKE_BATCHES = (40, 1)
ROUTINGS = 2
WHOLE_RESERVE_S = 15.0  # the per-GEMM sweep stops this long before the end


def schemes(smoke: bool) -> dict:
    return {"channel": None, "block": (32, 32) if smoke else (128, 128)}


# ---- inputs ----

def fp8_weights(shape: MoeShape, num_experts: int, block, device, fill: bool) -> dict:
    """w13 [E, 2I, H], w2 [E, H, I] e4m3 and their scales; `fill` False: uninitialized
    (a compile worker's: values do not change the compiled kernel)."""
    import torch
    fp8 = torch.float8_e4m3fn
    out = {}
    for name, rows, cols in (("w13", 2 * shape.inter, shape.hidden),
                             ("w2", shape.hidden, shape.inter)):
        w = torch.empty(num_experts, rows, cols, dtype=fp8, device=device)
        if fill:
            for e in range(num_experts):  # one expert at a time: no 16-bit stack
                w[e] = torch.randn(rows, cols, device=device).mul_(0.05).to(fp8)
        scale = ((num_experts, rows, 1) if block is None
                 else (num_experts, -(-rows // block[0]), -(-cols // block[1])))
        out[name], out[name + "_scale"] = w, torch.full(scale, 0.02, device=device)
    return out


def bf16_weights(shape: MoeShape, num_experts: int, device, fill: bool) -> dict:
    import torch
    make = torch.randn if fill else torch.empty
    return {"w13": make(num_experts, 2 * shape.inter, shape.hidden, device=device,
                        dtype=torch.bfloat16).mul_(0.02 if fill else 1),
            "w2": make(num_experts, shape.hidden, shape.inter, device=device,
                       dtype=torch.bfloat16).mul_(0.02 if fill else 1)}


def routings(shape: MoeShape, num_tokens: int, num_experts: int, device) -> list:
    """ROUTINGS (hidden [T, H] bf16, weights [T, k] float32, ids [T, k]) on random logits,
    and a random intermediate [T * k, I] for down."""
    import torch
    sets = []
    for seed in range(ROUTINGS):
        gen = torch.Generator(device=device).manual_seed(seed)
        hidden = torch.randn(num_tokens, shape.hidden, device=device, generator=gen)
        logits = torch.randn(num_tokens, num_experts, device=device, generator=gen)
        weights, ids = torch.softmax(logits, -1).topk(shape.top_k, -1)
        inter = torch.randn(num_tokens * shape.top_k, shape.inter, device=device,
                            generator=gen)
        sets.append({"hidden": hidden.bfloat16(), "inter": inter.bfloat16(),
                     "weights": (weights / weights.sum(-1, keepdim=True)).contiguous(),
                     "ids": ids.int()})  # int32, as the routing kernel gives
    return sets


def gemm_calls(gemm: str, block_m: int, tile, block, w: dict, sets: list, top_k: int,
               num_experts: int, fast_accum: bool = False) -> list:
    """One callable per routing: the fp8 GEMM alone on pre-sorted pairs and pre-quantized
    activations (W8A8 at block_m >= 32, else the unquantized rows)."""
    import torch

    from tllm.kernels.triton.fp8_fused_moe import _quantize, fp8_expert_gemm
    from tllm.kernels.triton.fp8_moe_configs import W8A8_MIN_BLOCK_M
    from tllm.kernels.triton.fused_moe import GemmTile, align_pairs
    tile = GemmTile(*tile)
    name = "w13" if gemm == "gate_up" else "w2"
    fns = []
    for s in sets:
        blocks = align_pairs(s["ids"], num_experts, block_m)
        x = s["hidden"] if gemm == "gate_up" else s["inter"]
        a, a_scale = _quantize(x, block) if block_m >= W8A8_MIN_BLOCK_M else (x, None)
        kwargs = (dict(rows_per_a=top_k, gated=True) if gemm == "gate_up"
                  else dict(topk_weights=s["weights"]))
        fns.append(lambda a=a, a_s=a_scale, b=blocks, kw=kwargs: fp8_expert_gemm(
            a, a_s, w[name], w[name + "_scale"], block, b, tile, torch.bfloat16,
            table.GROUP_M[block_m], fast_accum=fast_accum, **kw))
    return fns


def bf16_calls(gemm: str, cfg, w: dict, sets: list, top_k: int, num_experts: int) -> list:
    from tllm.kernels.triton.fused_moe import align_pairs, expert_gemm
    fns = []
    for s in sets:
        blocks = align_pairs(s["ids"], num_experts, cfg.block_m)
        if gemm == "gate_up":
            fns.append(lambda s=s, b=blocks: expert_gemm(s["hidden"], w["w13"], b, cfg.gate_up,
                                                         cfg.group_m, top_k, gated=True))
        else:
            fns.append(lambda s=s, b=blocks: expert_gemm(s["inter"], w["w2"], b, cfg.down,
                                                         cfg.group_m,
                                                         topk_weights=s["weights"]))
    return fns


# ---- the jobs: (model, T, scheme, block_m, gemm, tile) in timing order ----

def current_tiles(shape: MoeShape, num_tokens: int, scheme: str) -> dict:
    """{"bf16_table": cfg, "fp8_table": cfg}: what the FP8 kernel ran before (the bf16 table)
    and runs now."""
    from tllm.kernels.triton.fp8_moe_configs import fp8_moe_config
    from tllm.kernels.triton.fused_moe import moe_config
    return {"bf16_table": moe_config(num_tokens, shape.top_k, shape.experts),
            "fp8_table": fp8_moe_config(num_tokens, shape.top_k, shape.experts, scheme)}


def jobs(shapes: dict, batches, smoke: bool) -> list[tuple]:
    out = []
    for num_tokens in batches:
        for name, shape in shapes.items():
            per_expert = num_tokens * shape.top_k / shape.experts
            for scheme, block in schemes(smoke).items():
                cur = current_tiles(shape, num_tokens, scheme)
                bms = table.candidate_block_ms(per_expert)
                bms += [c.block_m for c in cur.values() if c.block_m not in bms]
                for bm in bms:
                    for gemm in ("gate_up", "down"):
                        extra = [astuple(getattr(c, gemm)) for c in cur.values()
                                 if c.block_m == bm]
                        for tile in table.tiles_to_time(bm, gemm, extra,
                                                        block and block[1], smoke):
                            out.append((name, num_tokens, scheme, bm, gemm, tile))
    return out


FAST_ACCUM_BATCHES = (512, 1024, SMOKE_BATCHES[0])  # the smoke run: its larger T


def fast_accum_jobs(shapes: dict, batches) -> list[tuple]:
    """(model, T, block_m, gemm, tile): the tables' per-channel W8A8 tiles at the largest T,
    to time once more without the per-K-tile promotion (its cost)."""
    out = []
    for num_tokens in (t for t in batches if t in FAST_ACCUM_BATCHES):
        for name, shape in shapes.items():
            for cfg in dict.fromkeys(current_tiles(shape, num_tokens, "channel").values()):
                for gemm in ("gate_up", "down"):
                    out.append((name, num_tokens, cfg.block_m, gemm,
                                astuple(getattr(cfg, gemm))))
    return out


def astuple(tile) -> tuple:
    return (tile.block_n, tile.block_k, tile.num_warps, tile.num_stages)


# ---- compile workers ----

def compile_keys(shapes: dict, batches, smoke: bool) -> list[tuple]:
    """What the timing pass compiles, one entry per distinct kernel: ("fp8", model, scheme,
    block_m, gemm, tile), ("bf16", model, config), ("sort", model, T, block_m) (the pair
    sort and the top-k sum specialize on T and the expert count; the GEMMs do not)."""
    from tllm.kernels.triton.fused_moe import moe_config
    keys = {}
    for name, t, scheme, bm, gemm, tile in jobs(shapes, batches, smoke):
        keys["fp8", name, scheme, bm, gemm, tile] = None
        keys["sort", name, t, bm] = None
    for name, shape in shapes.items():
        for t in batches:
            keys["bf16", name, moe_config(t, shape.top_k, shape.experts)] = None
    for name, _, bm, gemm, tile in fast_accum_jobs(shapes, batches):
        keys["fast", name, "channel", bm, gemm, tile] = None
    return list(keys)  # in timing order: what the workers leave undone is timed last


def compile_worker(args, index: int, count: int) -> int:
    """One call of each compile key that falls to this worker (round robin), the GEMMs on
    uninitialized weights of top_k experts (values and the expert count do not change the
    compiled kernel)."""
    import torch
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    shapes, batches = plan(args)
    done = failed = 0
    weights = {}
    for key in compile_keys(shapes, batches, args.cpu_smoke)[index::count]:
        kind, name, shape = key[0], key[1], shapes[key[1]]
        k = shape.top_k
        sets = routings(shape, 16, k, device)[:1]
        try:
            if kind == "sort":
                sort_and_sum(shape, key[2], key[3], device)
            elif kind == "bf16":
                if name not in weights:
                    weights[name] = bf16_weights(shape, k, device, False)
                w = weights[name]
                for part in ("gate_up", "down"):
                    bf16_calls(part, key[2], w, sets, k, k)[0]()
            else:
                _, _, scheme, bm, gemm, tile = key
                block = schemes(args.cpu_smoke)[scheme]
                if (name, scheme) not in weights:
                    weights[name, scheme] = fp8_weights(shape, k, block, device, False)
                w = weights[name, scheme]
                gemm_calls(gemm, bm, tile, block, w, sets, k, k, kind == "fast")[0]()
            done += 1
        except Exception as exc:  # the timing pass records it
            failed += 1
            print(f"compile {key}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"worker {index}/{count}: {done} compiled, {failed} failed", flush=True)
    return 0


def sort_and_sum(shape: MoeShape, num_tokens: int, block_m: int, device) -> None:
    import torch

    from tllm.kernels.triton.fused_moe import align_pairs, sum_top_k
    ids = routings(shape, num_tokens, shape.experts, device)[0]["ids"]
    align_pairs(ids, shape.experts, block_m)
    pair_out = torch.zeros(num_tokens * shape.top_k, shape.hidden, device=device,
                           dtype=torch.bfloat16)
    sum_top_k(pair_out, ids, shape.experts)


def start_workers(args, count: int) -> list:
    if count <= 0:
        return []
    base = [sys.executable, __file__, "--models", ",".join(plan(args)[0])]
    if args.cpu_smoke:
        base.append("--cpu-smoke")
    log_dir = Path(args.out).parent if args.out else Path(tempfile.gettempdir())
    log = open(log_dir / "fp8_moe_sweep_workers.log", "w")
    return [subprocess.Popen(base + ["--compile-worker", f"{i}/{count}"], cwd=ROOT,
                             stdout=log, stderr=subprocess.STDOUT) for i in range(count)]


def wait_workers(session: Session, procs: list, deadline: float) -> None:
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()  # what it did not compile compiles in the timing pass
            proc.wait()
    session.results["compile_workers"] = {"count": len(procs),
                                          "exit_codes": [p.returncode for p in procs]}
    session.log(f"compile workers done: exit codes {[p.returncode for p in procs]}")


# ---- the timing pass ----

def measure_rates(device) -> dict:
    """Copy bandwidth (read + write) and torch._scaled_mm's FP8 rate at 8192^3 (row-wise
    scales), measured here."""
    import torch
    cuda = device.type == "cuda"
    size = 8192 if cuda else 128
    rates = {"copy_b_s": copy_bandwidth(device, (2 << 30) if cuda else (16 << 20))}
    a = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
    ones = torch.ones(size, 1, device=device)
    try:
        row = ones.t().contiguous()
        us, _ = time_calls([lambda: torch._scaled_mm(a, a.t(), scale_a=ones, scale_b=row,
                                                     out_dtype=torch.bfloat16)],
                           device, min_calls=5)
        rates["fp8_mm_flop_s"] = 2 * size ** 3 / (us * 1e-6)
    except Exception as exc:  # a CPU without _scaled_mm: a float32 mm's rate instead
        rates["fp8_mm_error"] = f"{type(exc).__name__}: {exc}"[:200]
        b = a.float()
        us, _ = time_calls([lambda: b @ b], device, min_calls=5)
        rates["fp8_mm_flop_s"] = 2 * size ** 3 / (us * 1e-6)
    return rates


def floors(shape: MoeShape, num_tokens: int, sets: list, rates: dict) -> dict:
    """Per GEMM: fp8 weight bytes of the experts hit / copy bandwidth, FLOPs / fp8 mm rate."""
    distinct = statistics.mean(int(s["ids"].unique().numel()) for s in sets)
    pairs = num_tokens * shape.top_k
    out = {}
    for gemm, n in (("gate_up", 2 * shape.inter), ("down", shape.hidden)):
        k = shape.hidden if gemm == "gate_up" else shape.inter
        out[gemm] = {"weight_us": distinct * n * k / rates["copy_b_s"] * 1e6,
                     "compute_us": 2 * pairs * n * k / rates["fp8_mm_flop_s"] * 1e6}
    return out


def timed(fns: list, device) -> float | str:
    try:  # on a CPU (the smoke test) each call once: the interpreter is slow
        return time_calls(fns, device, min_calls=10 if device.type == "cuda" else 1)[0]
    except Exception as exc:  # e.g. out of shared memory: recorded, the sweep goes on
        return f"{type(exc).__name__}: {exc}"[:200]


def sweep_point(session: Session, name: str, shape: MoeShape, num_tokens: int, data: dict,
                device, job_list: list, fast_jobs: list) -> None:
    """Every job of (model, T): the bf16 baseline, the fp8 tiles, then the fast-accumulation
    ones."""
    from tllm.kernels.triton.fused_moe import moe_config
    model = session.results["models"][name]
    sets = routings(shape, num_tokens, shape.experts, device)
    model["floors"][num_tokens] = floors(shape, num_tokens, sets, session.results["rates"])
    cfg = moe_config(num_tokens, shape.top_k, shape.experts)
    model["bf16"][num_tokens] = {"config": asdict(cfg), **{
        gemm: timed(bf16_calls(gemm, cfg, data["bf16"], sets, shape.top_k, shape.experts),
                    device) for gemm in ("gate_up", "down")}}
    sweep = model["sweep"].setdefault(num_tokens, {})
    for _, _, scheme, bm, gemm, tile in job_list:
        if session.remaining() < WHOLE_RESERVE_S:
            return
        block = schemes(session.smoke)[scheme]
        fns = gemm_calls(gemm, bm, tile, block, data[scheme], sets, shape.top_k,
                         shape.experts)
        times = sweep.setdefault(scheme, {}).setdefault(bm, {}).setdefault(gemm, {})
        times[table.tile_key(tile)] = timed(fns, device)
    for _, _, bm, gemm, tile in fast_jobs:
        if session.remaining() < WHOLE_RESERVE_S:
            return
        fns = gemm_calls(gemm, bm, tile, None, data["channel"], sets, shape.top_k,
                         shape.experts, fast_accum=True)
        model["fast_accum"].setdefault(num_tokens, {}).setdefault(gemm, {})[
            f"{bm}|{table.tile_key(tile)}"] = timed(fns, device)


def whole_calls(session: Session, shapes: dict, weights: dict, device) -> None:
    """fp8_fused_experts_triton as a layer calls it: the bf16 table's tiles, the fp8
    table's and the best found; and the bf16 fused call."""
    from tllm.kernels.triton import fused_moe
    from tllm.kernels.triton.fp8_fused_moe import fp8_fused_experts_triton
    for num_tokens in session.batches:
        for name, shape in shapes.items():
            if session.remaining() < 3:
                return
            model, data = session.results["models"][name], weights[name]
            sets = routings(shape, num_tokens, shape.experts, device)
            row = model["whole"].setdefault(num_tokens, {})
            row["bf16"] = timed([lambda s=s: fused_moe.fused_experts_triton(
                s["hidden"], data["bf16"]["w13"], data["bf16"]["w2"], s["weights"], s["ids"])
                for s in sets], device)
            for scheme, block in schemes(session.smoke).items():
                w = data[scheme]
                cfgs = {k: v for k, v in current_tiles(shape, num_tokens, scheme).items()}
                best = table.best_config(model["sweep"].get(num_tokens, {}).get(scheme, {}))
                if best:
                    cfgs["best"] = to_moe_config(best)
                outs = {}
                for label, cfg in cfgs.items():
                    calls = [lambda s=s, c=cfg: fp8_fused_experts_triton(
                        s["hidden"], w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], block,
                        s["weights"], s["ids"], config=c) for s in sets]
                    row[f"{scheme}_{label}"] = timed(calls, device)
                    outs[label] = _output(calls[0])
                row[f"{scheme}_rel_diff_vs_bf16_table"] = {
                    label: _rel(out, outs["bf16_table"]) for label, out in outs.items()
                    if label != "bf16_table"}
            session.save()


def _output(call):
    """The call's output in float32, or None where it fails (its time says why)."""
    try:
        return call().float()
    except Exception:
        return None


def _rel(out, ref) -> float | None:
    """A tile's output against another's: the same math, so ~1e-3 (a different form,
    W8A16 against W8A8, ~4e-2); far more is a bug in a tile."""
    if out is None or ref is None:
        return None
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def to_moe_config(best: dict):
    from tllm.kernels.triton.fused_moe import GemmTile, MoeConfig
    bm = best["block_m"]
    return MoeConfig(bm, GemmTile(*table.parse_tile(best["gate_up"])),
                     GemmTile(*table.parse_tile(best["down"])), table.GROUP_M[bm])


# ---- report ----

def summary(session: Session) -> str:
    def tables(shape: dict, num_tokens: int, scheme: str) -> dict:
        cur = current_tiles(MoeShape(**shape), num_tokens, scheme)
        return {k: asdict(v) for k, v in cur.items()}
    scale_bk = {k: v and v[1] for k, v in schemes(session.smoke).items()}
    return table.report(session.results, tables, scale_bk)


# ---- driver ----

def plan(args) -> tuple[dict, tuple]:
    shapes = SMOKE_SHAPES if args.cpu_smoke else FULL_SHAPES
    if args.models:
        shapes = {k: v for k, v in shapes.items() if k in args.models.split(",")}
    return shapes, SMOKE_BATCHES if args.cpu_smoke else FULL_BATCHES


def make_weights(shapes: dict, device, smoke: bool) -> dict:
    """Per model: fp8 experts (the block scheme shares their bytes, with scales of its own)
    and bf16 ones."""
    import torch
    bn, bk = schemes(smoke)["block"]
    out = {}
    for name, shape in shapes.items():
        channel = fp8_weights(shape, shape.experts, None, device, True)
        e, h, i = shape.experts, shape.hidden, shape.inter
        block = {**channel,
                 "w13_scale": torch.full((e, -(-2 * i // bn), -(-h // bk)), 0.02, device=device),
                 "w2_scale": torch.full((e, -(-h // bn), -(-i // bk)), 0.02, device=device)}
        out[name] = {"channel": channel, "block": block,
                     "bf16": bf16_weights(shape, shape.experts, device, True)}
    return out


def run(args) -> int:
    import torch
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    shapes, batches = plan(args)
    session = Session(args)
    session.smoke, session.batches = args.cpu_smoke, batches
    start_watchdog(session, summary)
    procs = start_workers(args, args.compile_workers)
    session.log(f"{len(procs)} compile workers started (cache {os.environ['TRITON_CACHE_DIR']})")
    weights = make_weights(shapes, device, args.cpu_smoke)
    session.results["models"] = {name: {"shape": asdict(shape), "sweep": {}, "bf16": {},
                                        "floors": {}, "whole": {},
                                        "fast_accum": {}}
                                 for name, shape in shapes.items()}
    wait_workers(session, procs, session.start + args.budget * 0.45)
    session.results["rates"] = measure_rates(device)
    all_jobs = jobs(shapes, batches, args.cpu_smoke)
    fast_jobs = fast_accum_jobs(shapes, batches)
    for num_tokens in batches:
        for name, shape in shapes.items():
            if session.remaining() < WHOLE_RESERVE_S:
                break
            try:
                sweep_point(session, name, shape, num_tokens, weights[name], device,
                            [j for j in all_jobs if j[:2] == (name, num_tokens)],
                            [j for j in fast_jobs if j[:2] == (name, num_tokens)])
            except Exception as exc:
                traceback.print_exc()
                session.results["models"][name]["sweep"][num_tokens] = {
                    "error": f"{type(exc).__name__}: {exc}"[:300]}
            session.log(f"{name} T={num_tokens} swept")
            session.save()
    whole_calls(session, shapes, weights, device)
    session.save()
    print(summary(session), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON results path (log beside it)")
    parser.add_argument("--budget", type=float, default=110.0, help="seconds in all")
    parser.add_argument("--models", default=None, help="comma-separated subset")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpreter")
    parser.add_argument("--compile-workers", type=int, default=None,
                        help="processes compiling ahead (default: CPUs - 2, at most 14)")
    parser.add_argument("--compile-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile_worker:
        index, count = map(int, args.compile_worker.split("/"))
        return compile_worker(args, index, count)
    if args.compile_workers is None:
        args.compile_workers = 1 if args.cpu_smoke else min(14, (os.cpu_count() or 4) - 2)
    if args.out:
        log = open(Path(args.out).with_suffix(".log"), "w")
        sys.stdout = Tee(sys.__stdout__, log)
        sys.stderr = Tee(sys.__stderr__, log)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
