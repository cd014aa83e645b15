"""The FP8 expert sweep's candidates and its verdicts (benchmarks/gpu_fp8_moe_sweep.py): which
tiles to time per block_m, the best configuration per (model, scheme, T) from the per-GEMM
times, the report, and the ready-to-paste `FP8_CONFIGS` of
tllm.kernels.triton.fp8_moe_configs. Pure Python on the sweep's JSON (no GPU), so the table
can be made again from a saved run:

    python benchmarks/fp8_moe_table.py RESULTS.json
    python benchmarks/fp8_moe_table.py RESULTS.json --apply tllm/kernels/triton/fp8_moe_configs.py

`--apply` replaces the file's FP8_CONFIGS assignment with the sweep's (so one GPU call can
sweep, apply and measure the models on the tuned table; the file comes back through $OUT).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

MAX_TILES = 8
GROUP_M = {16: 1, 32: 8, 64: 8, 128: 16}
# (block_n, block_k, warps, stages) per block_m and GEMM; block_m 16 runs W8A16 (weights
# widened in registers), 32 and up W8A8. gate_up's block_n is of each of gate and up.
CANDIDATES = {
    16: {"gate_up": ((32, 256, 4, 4), (32, 128, 4, 4), (64, 256, 4, 3), (16, 256, 4, 4),
                     (64, 128, 4, 4), (32, 512, 4, 3)),
         "down": ((64, 256, 4, 4), (64, 128, 4, 4), (128, 256, 4, 3), (32, 256, 4, 4),
                  (128, 128, 4, 3), (32, 512, 4, 3))},
    32: {"gate_up": ((64, 128, 4, 4), (64, 128, 4, 3), (32, 128, 4, 4), (128, 128, 4, 3),
                     (64, 256, 4, 3), (32, 256, 4, 4)),
         "down": ((128, 128, 4, 4), (64, 128, 4, 4), (128, 256, 4, 3), (256, 128, 8, 3),
                  (64, 256, 4, 4), (128, 64, 4, 4))},
    64: {"gate_up": ((64, 128, 4, 4), (64, 128, 8, 4), (128, 128, 8, 3), (32, 128, 4, 4),
                     (64, 256, 4, 3), (128, 128, 4, 3)),
         "down": ((128, 128, 4, 4), (128, 128, 8, 4), (256, 128, 8, 3), (64, 128, 4, 4),
                  (128, 256, 4, 3), (64, 256, 4, 4))},
    128: {"gate_up": ((64, 128, 8, 4), (64, 128, 8, 3), (128, 128, 8, 3), (32, 128, 4, 4),
                      (64, 256, 8, 3), (128, 128, 8, 4)),
          "down": ((128, 128, 8, 4), (128, 128, 8, 3), (256, 128, 8, 3), (64, 128, 4, 4),
                   (128, 256, 8, 3), (256, 128, 8, 4))},
}
SMOKE_CANDIDATES = {bm: {"gate_up": ((16, 32, 4, 1), (32, 64, 4, 1)),
                         "down": ((32, 32, 4, 1), (16, 64, 4, 1))} for bm in GROUP_M}


def candidate_block_ms(per_expert: float) -> list[int]:
    """The two largest block_m of at most twice the average pairs an expert gets."""
    return [bm for bm in GROUP_M if bm <= max(16, 2 * per_expert)][-2:]


def tile_key(tile) -> str:
    """(block_n, block_k, warps, stages) as the JSON key 'n64 k128 w8 s4'."""
    bn, bk, warps, stages = tile
    return f"n{bn} k{bk} w{warps} s{stages}"


def parse_tile(key: str) -> tuple[int, int, int, int]:
    return tuple(int(part[1:]) for part in key.split())


def tiles_to_time(block_m: int, gemm: str, extra: list, scale_bk: int | None,
                  smoke: bool = False) -> list[tuple]:
    """The candidates of one (block_m, GEMM): the given current tiles first, then the list;
    block_k clamped to the scale block (as the kernel does), duplicates dropped, at most
    MAX_TILES."""
    table = SMOKE_CANDIDATES if smoke else CANDIDATES
    tiles = []
    for bn, bk, warps, stages in [*extra, *table[block_m][gemm]]:
        tile = (bn, bk if scale_bk is None else min(bk, scale_bk), warps, stages)
        if tile not in tiles:
            tiles.append(tile)
    return tiles[:MAX_TILES]


def best_of(times: dict) -> tuple[str, float] | None:
    """(tile key, us) of the fastest timed tile in {key: us or error}."""
    timed = [(us, key) for key, us in times.items() if isinstance(us, (int, float))]
    return (min(timed)[1], min(timed)[0]) if timed else None


def best_config(per_bm: dict) -> dict | None:
    """From {block_m: {"gate_up": {key: us}, "down": {key: us}}}: the block_m whose best
    gate_up + best down is fastest -> {"block_m", "gate_up", "down", "us"}."""
    found = []
    for bm, gemms in per_bm.items():
        up, down = best_of(gemms.get("gate_up", {})), best_of(gemms.get("down", {}))
        if up and down:
            found.append((up[1] + down[1], int(bm), up[0], down[0]))
    if not found:
        return None
    us, bm, up, down = min(found)
    return {"block_m": bm, "gate_up": up, "down": down, "us": us}


def _ratio_choice(per_model: list[dict], bm: int, gemm: str) -> tuple[str, float] | None:
    """The tile of (bm, gemm) timed in every model with the least sum of time / that
    model's best: (key, summed ratio)."""
    tables = [m[bm][gemm] for m in per_model]
    keys = set.intersection(*(set(k for k, v in t.items() if isinstance(v, (int, float)))
                              for t in tables))
    if not keys:
        return None
    bests = [best_of(t)[1] for t in tables]
    score = {k: sum(t[k] / b for t, b in zip(tables, bests)) for k in keys}
    key = min(score, key=score.get)
    return key, score[key]


def merged_config(per_model: list[dict]) -> dict | None:
    """One configuration for several models at the same pairs per expert: per block_m the
    tiles with the least summed slowdown; then the block_m with the least (the sum of each
    model's (gate_up + down) time over its own best)."""
    if len(per_model) == 1:
        return best_config(per_model[0])
    bests = [best_config(m) for m in per_model]
    if not all(bests):
        return next((b for b in bests if b), None)
    found = []
    for bm in set.intersection(*(set(m) for m in per_model)):
        up, down = _ratio_choice(per_model, bm, "gate_up"), _ratio_choice(per_model, bm, "down")
        if not (up and down):
            continue
        score = sum((m[bm]["gate_up"][up[0]] + m[bm]["down"][down[0]]) / b["us"]
                    for m, b in zip(per_model, bests))
        found.append((score, int(bm), up[0], down[0]))
    if not found:
        return bests[0]
    score, bm, up, down = min(found)
    return {"block_m": bm, "gate_up": up, "down": down, "score": score}


def config_source(cfg: dict) -> str:
    def tile(key: str) -> str:
        return "GemmTile({}, {}, {}, {})".format(*parse_tile(key))
    bm = cfg["block_m"]
    return f"MoeConfig({bm}, {tile(cfg['gate_up'])}, {tile(cfg['down'])}, group_m={GROUP_M[bm]})"


def table_rows(points: dict[float, list[dict]]) -> list[tuple[float, str]]:
    """{pairs per expert: [per-model sweeps]} -> [(limit, MoeConfig source)]: a row's limit
    is the geometric mean of its point and the next; equal neighbours merge."""
    chosen = [(p, merged_config(ms)) for p, ms in sorted(points.items())]
    chosen = [(p, config_source(c)) for p, c in chosen if c]
    rows: list[tuple[float, str]] = []
    for i, (point, source) in enumerate(chosen):
        limit = (math.sqrt(point * chosen[i + 1][0]) if i + 1 < len(chosen)
                 else math.inf)
        if rows and rows[-1][1] == source:
            rows[-1] = (limit, source)
        else:
            rows.append((limit, source))
    return rows


def python_table(results: dict) -> str:
    """FP8_CONFIGS as Python source, from the sweep's results["models"]."""
    device = results.get("meta", {}).get("device", "?")
    date = results.get("meta", {}).get("date", "?")[:10]
    lines = [f"# from benchmarks/gpu_fp8_moe_sweep.py on {device}, {date}",
             "FP8_CONFIGS: dict[str, tuple[tuple[float, MoeConfig], ...]] = {"]
    for scheme in ("channel", "block"):
        points: dict[float, list[dict]] = {}
        for model in results.get("models", {}).values():
            for t, per_scheme in model.get("sweep", {}).items():
                per_bm = per_scheme.get(scheme)
                if isinstance(per_bm, dict) and per_bm:
                    per_expert = int(t) * model["shape"]["top_k"] / model["shape"]["experts"]
                    points.setdefault(per_expert, []).append(per_bm)
        lines.append(f'    "{scheme}": (')
        for limit, source in table_rows(points):
            bound = 'float("inf")' if limit == math.inf else f"{limit:.3g}"
            lines.append(f"        ({bound}, {source}),")
        lines.append("    ),")
    return "\n".join(lines + ["}"])


def _us(value) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else "-"


def _sci(value) -> str:
    return f"{value:.1e}" if isinstance(value, (int, float)) else "-"


def _lookup(per_bm: dict, cfg: dict, gemm: str, scale_bk):
    tile = (cfg[gemm]["block_n"], cfg[gemm]["block_k"], cfg[gemm]["num_warps"],
            cfg[gemm]["num_stages"])
    if scale_bk:
        tile = (tile[0], min(tile[1], scale_bk), *tile[2:])
    bm = cfg["block_m"]
    return per_bm.get(bm, per_bm.get(str(bm), {})).get(gemm, {}).get(tile_key(tile))


def report(res: dict, tables, scale_bks: dict) -> str:
    """The sweep's table: per (model, scheme, T, GEMM) the bf16 GEMM, the fp8 GEMM at the
    bf16 table's tile (before), at fp8_moe_config's (now) and the best, with the floors;
    the fast-accumulation and whole-call lines; the ready-to-paste FP8_CONFIGS. `tables`
    (shape dict, T, scheme) -> {"bf16_table": cfg dict, "fp8_table": cfg dict}."""
    rates = res.get("rates", {})
    lines = [" FP8 experts: per-GEMM tile sweep (us, CUDA graphs) ".center(132, "="),
             f"copy {rates.get('copy_b_s', 0) / 1e9:.0f} GB/s, fp8 _scaled_mm "
             f"{rates.get('fp8_mm_flop_s', 0) / 1e12:.0f} TFLOP/s; before = the bf16 table's "
             "tile on the fp8 kernel, now = fp8_moe_config's (untuned), best = this sweep's",
             f"{'model':<15}{'scheme':<8}{'T':>5} {'gemm':<8}{'bf16':>8}{'before':>9}"
             f"{'now':>9}{'best':>9}  {'best tile (bm; n k w s)':<26}{'w floor':>8}"
             f"{'c floor':>8}{'floor/best':>11}"]
    for name, model in res.get("models", {}).items():
        for t, per_scheme in model.get("sweep", {}).items():
            for scheme, per_bm in per_scheme.items():
                if scheme not in scale_bks:  # {"error": ...}
                    lines.append(f"{name} T={t}: {str(per_bm)[:100]}")
                    continue
                cur = tables(model["shape"], int(t), scheme)
                for gemm in ("gate_up", "down"):
                    lines.append(_summary_line(name, scheme, t, gemm, model, per_bm, cur,
                                               scale_bks[scheme]))
    for name, model in res.get("models", {}).items():
        lines += _fast_accum_lines(name, model)
    for name, model in res.get("models", {}).items():
        for t, row in model.get("whole", {}).items():
            lines.append(f"whole call {name} T={t} (us): " + ", ".join(
                f"{k} {_us(v)}" for k, v in row.items() if not isinstance(v, dict)))
            lines += [f"  {k}: " + ", ".join(f"{label} {_sci(d)}" for label, d in v.items())
                      for k, v in row.items() if isinstance(v, dict)]
    lines.append(" ready to paste into tllm/kernels/triton/fp8_moe_configs.py ".center(132, "-"))
    lines.append(python_table(res))
    return "\n".join(lines)


def _fast_accum_lines(name: str, model: dict) -> list[str]:
    """Per-channel W8A8 tiles without the per-K-tile promotion, next to the promoted time."""
    lines = []
    for t, per_gemm in model.get("fast_accum", {}).items():
        promoted = model["sweep"].get(t, {}).get("channel", {})
        for gemm, times in per_gemm.items():
            cells = []
            for key, us in times.items():
                bm, tile = key.split("|")
                per_bm = promoted.get(int(bm), promoted.get(bm, {}))
                cells.append(f"bm {bm} {tile}: {_us(us)} (promoted "
                             f"{_us(per_bm.get(gemm, {}).get(tile))})")
            lines.append(f"fast accumulation {name} T={t} {gemm}: " + ", ".join(cells))
    return lines


def _summary_line(name, scheme, t, gemm, model, per_bm, cur, scale_bk) -> str:
    best = best_of({f"{bm}|{k}": v for bm, g in per_bm.items()
                    for k, v in g.get(gemm, {}).items()})
    floor = model.get("floors", {}).get(t, {}).get(gemm, {})
    bound = max(floor.values()) if floor else None
    tile, best_us = (best[0].replace("|", "; "), best[1]) if best else ("-", None)
    ratio = f"{bound / best_us:.0%}" if bound and best_us else "-"
    return (f"{name[:14]:<15}{scheme:<8}{t:>5} {gemm:<8}"
            f"{_us(model.get('bf16', {}).get(t, {}).get(gemm)):>8}"
            f"{_us(_lookup(per_bm, cur['bf16_table'], gemm, scale_bk)):>9}"
            f"{_us(_lookup(per_bm, cur['fp8_table'], gemm, scale_bk)):>9}{_us(best_us):>9}  "
            f"{tile:<26}{_us(floor.get('weight_us')):>8}{_us(floor.get('compute_us')):>8}"
            f"{ratio:>11}")


def apply_table(source: str, table: str) -> str:
    """`source` (fp8_moe_configs.py) with its FP8_CONFIGS assignment (up to the closing
    brace at the start of a line) replaced by `table`; ValueError where there is none."""
    start = source.find("FP8_CONFIGS: dict[")
    end = source.find("\n}\n", start)
    if start < 0 or end < 0:
        raise ValueError("no FP8_CONFIGS assignment found")
    line_start = source.rfind("\n", 0, start) + 1
    return source[:line_start] + table + source[end + 2:]


def main(argv: list[str]) -> int:
    table = python_table(json.loads(Path(argv[0]).read_text()))
    print(table)
    if len(argv) == 3 and argv[1] == "--apply":
        if table.count("float(\"inf\")") != 2:  # a scheme the sweep timed nothing for
            print("nothing to apply: the sweep chose no configuration", file=sys.stderr)
            return 1
        target = Path(argv[2])
        target.write_text(apply_table(target.read_text(), table))
        print(f"applied to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
