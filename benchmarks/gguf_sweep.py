"""The GGUF kernels' launch sweep for benchmarks/gpu_gguf.py: on the layer shapes of the e2e
model (a Llama-3.2-1B-shaped Q4_K_M file: its qkv is Q8_0 when kept, o and gate_up Q4_K,
down and the LM head Q6_K) and an 8B layer, each GEMV tile (rows, groups a step, warps) at
three K splits, then fused-GEMM tiles at 32 rows; every candidate's output is checked against
the torch reference (one that fails or does not compile is recorded, never chosen). The best
of each (type, N, K, rows) goes to tllm.kernels.triton.gguf_configs.TUNED (so the e2e run
after it uses them) and to $OUT/gguf_configs_<device>.json, the file gguf_configs loads for
that device when it is copied to tllm/kernels/triton/configs/."""
from __future__ import annotations

import math
import time

import torch

# the e2e model's layers, most bytes first (a sweep cut short by its deadline keeps these)
GEMV_SHAPES = [("gate_up", 16384, 2048, "Q4_K"), ("down", 2048, 8192, "Q6_K"),
               ("head", 32000, 2048, "Q6_K"), ("qkv", 3072, 2048, "Q8_0"),
               ("o", 2048, 2048, "Q4_K"), ("8b qkv", 6144, 4096, "Q4_K")]
GEMV_TILES = [(4, 16, 1), (8, 32, 2), (8, 16, 2), (4, 32, 2), (2, 16, 1), (16, 64, 4)]
FUSED_ROWS = 32
FUSED_SHAPES = GEMV_SHAPES[:2] + GEMV_SHAPES[3:4]
FUSED_TILES = [(64, 4, 4, 2, True), (128, 4, 8, 2, True), (64, 8, 4, 2, True),
               (64, 2, 4, 3, False), (128, 2, 4, 3, False)]


def _splits(rule: int, steps: int) -> list[int]:
    return sorted({max(1, rule // 2), rule, min(max(1, steps // 2), max(2, 2 * rule))})


def _measure(fn_of_planes, planes, ref, time_calls, rel) -> float | str:
    try:
        err = rel(fn_of_planes(planes[0]), ref)
        if not err < 1e-2:
            return f"wrong: rel err {err:.1e}"
        return time_calls([lambda p=p: fn_of_planes(p) for p in planes])
    except Exception as exc:  # a tile that does not fit: recorded, not fatal
        return f"error: {str(exc).splitlines()[0][:100]}"


def sweep(results: dict, deadline: float, make_planes, time_calls, rel) -> dict:
    """Fills results["sweep"]; returns the TUNED entries it found best."""
    from tllm.kernels.gguf import gguf_mm_ref
    from tllm.kernels.triton import gguf_configs as cfgs
    from tllm.kernels.triton.gguf_gemm import gguf_fused_mm, gguf_gemv
    out = results["sweep"] = {"gemv": {}, "fused": {}}
    best: dict = {}
    for rows, shapes in ((1, GEMV_SHAPES), (FUSED_ROWS, FUSED_SHAPES)):
        for label, n, k, qtype in shapes:
            if time.perf_counter() > deadline:
                out["stopped"] = f"out of time before {label} M={rows}"
                return best
            planes = make_planes(qtype, n, k)
            device = planes[0].device
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            ref = gguf_mm_ref(x, planes[0])
            if rows == 1:
                default = cfgs.gemv_config(qtype, n, k, device)
                candidates = [cfgs.GemvConfig(bn, bg, split, w)
                              for bn, bg, w in GEMV_TILES
                              for split in _splits(_rule_gemv(cfgs, qtype, n, k, bn, bg, w, device),
                                                   k // 32 // bg)]
                run = lambda cfg: (lambda p: gguf_gemv(x, p, cfg))  # noqa: E731
            else:
                default = cfgs.fused_mm_config(qtype, rows, n, k, device)
                candidates = [cfgs.FusedMmConfig(FUSED_ROWS, bn, bg, split, w, st, tile=tile)
                              for bn, bg, w, st, tile in FUSED_TILES
                              for split in _splits(default.split_k, k // 32 // bg)[1:]]
                run = lambda cfg: (lambda p: gguf_fused_mm(x, p, cfg))  # noqa: E731
            times = {}
            for cfg in [default, *[c for c in candidates if c != default]]:
                if time.perf_counter() > deadline:
                    break
                times[cfg] = _measure(run(cfg), planes, ref, time_calls, rel)
            timed = {c: t for c, t in times.items() if isinstance(t, float)}
            entry = out["gemv" if rows == 1 else "fused"][f"{label} {qtype} {n}x{k}"] = {
                "qtype": qtype, "default": str(default), "default_us": times.get(default),
                "all": {str(c): t for c, t in times.items()}}
            if timed:
                winner = min(timed, key=timed.get)
                entry.update(best=str(winner), best_us=timed[winner])
                best[(qtype, n, k, 1 if rows == 1 else cfgs.rows_bucket(rows))] = winner
            del planes
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out["tile_ranking"] = tile_ranking(out["gemv"])
    return best


def _rule_gemv(cfgs, qtype, n, k, block_n, block_g, warps, device) -> int:
    """The default rule's K split for this tile."""
    steps = -(-(k // 32) // block_g)
    return cfgs.split_for(-(-n // block_n), steps, max(1, cfgs.GEMV_WARPS_PER_SM // warps),
                          device, 2)


def tile_ranking(gemv: dict) -> dict:
    """Per type, GEMV tiles (rows, groups, warps) by the geometric mean over its shapes of
    their best split's time / the shape's best time: the type's default tile to keep."""
    return {qtype: _ranking([e for e in gemv.values() if e["qtype"] == qtype])
            for qtype in sorted({e["qtype"] for e in gemv.values()})}


def _ranking(entries: list) -> list:
    ratios: dict = {}
    for entry in entries:
        timed = {c: t for c, t in entry["all"].items() if isinstance(t, float)}
        if not timed:
            continue
        fastest = min(timed.values())
        per_tile: dict = {}
        for label, t in timed.items():
            tile = _tile_of(label)
            per_tile[tile] = min(per_tile.get(tile, math.inf), t / fastest)
        for tile, ratio in per_tile.items():
            ratios.setdefault(tile, []).append(ratio)
    ranked = [(tile, math.exp(sum(map(math.log, r)) / len(r)), len(r))
              for tile, r in ratios.items()]
    return sorted(ranked, key=lambda item: item[1])


def _tile_of(label: str) -> str:
    fields = dict(part.split("=") for part in label[label.index("(") + 1:-1].split(", "))
    return f"block_n={fields['block_n']} block_g={fields['block_g']} warps={fields['num_warps']}"
