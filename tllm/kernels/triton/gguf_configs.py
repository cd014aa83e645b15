"""Launch configurations of the GGUF kernels (tllm.kernels.triton.gguf_gemm): a tile per type
from measurements, a K split computed from the SM count, and tuned entries that override both
for an exact (type, N, K, rows) where a sweep found better (benchmarks/gpu_gguf.py measures
them and writes a JSON; `load_tuned` reads one; `TUNED` holds them in the process).

Evidence behind the defaults (H200, benchmarks/gpu_gguf.py, the first kernels, 6144 x 4096):
at one row 8 weight rows x 512 values a step on 2 warps (21.7 us Q4_K, 19.6 us Q8_0) beat 16
rows on 4 warps split twice (24.0 / 24.8 us): more small programs in flight hid more of the
memory latency. The GEMV now keeps one float32 a (row, group) instead of a 16-value tile, so
programs are smaller still in registers."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tllm.kernels.triton.launch import cdiv, next_pow2, num_sms

GROUP = 32


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_g: int        # groups of 32 values a K step
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    fold: bool = True   # split K: the last program of an N tile sums the partials (no 2nd kernel)


@dataclass(frozen=True)
class FusedMmConfig:
    block_m: int
    block_n: int
    block_g: int        # groups a K step (each half-group one tl.dot of depth 16)
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    fold: bool = True
    tile: bool = False  # the first kernel: a [BLOCK_N, 16 BLOCK_G] tile decoded, transposed


# (block_n, block_g, num_warps) at one row, by type
GEMV_TILES = {"Q4_0": (8, 16, 2), "Q4_1": (8, 16, 2), "Q5_0": (8, 16, 2), "Q5_1": (8, 16, 2),
              "Q8_0": (8, 16, 2), "Q4_K": (8, 16, 2), "Q5_K": (8, 16, 2), "Q6_K": (8, 16, 2)}
GEMV_PROGRAMS_PER_SM = 8     # split K until about this many programs run on each SM
FUSED_PROGRAMS_PER_SM = 2
# (qtype, n, k, rows bucket) -> config, from a sweep; rows bucket: 1, or the fused block_m
TUNED: dict[tuple[str, int, int, int], GemvConfig | FusedMmConfig] = {}


def _split(tiles: int, steps: int, per_sm: int, device: torch.device, min_steps: int) -> int:
    target = per_sm * num_sms(device)
    if tiles >= target:
        return 1
    return max(1, min(cdiv(target, tiles), steps // min_steps))


def gemv_config(qtype: str, n: int, k: int, device: torch.device) -> GemvConfig:
    tuned = TUNED.get((qtype, n, k, 1))
    if isinstance(tuned, GemvConfig):
        return tuned
    block_n, block_g, warps = GEMV_TILES.get(qtype, (8, 16, 2))
    groups = k // GROUP
    block_g = min(block_g, next_pow2(groups))
    split = _split(cdiv(n, block_n), cdiv(groups, block_g), GEMV_PROGRAMS_PER_SM, device, 2)
    return GemvConfig(block_n, block_g, split, warps)


def rows_bucket(m: int) -> int:
    return min(64, max(16, next_pow2(m)))


def fused_mm_config(qtype: str, m: int, n: int, k: int, device: torch.device) -> FusedMmConfig:
    block_m = rows_bucket(m)
    tuned = TUNED.get((qtype, n, k, block_m))
    if isinstance(tuned, FusedMmConfig):
        return tuned
    groups = k // GROUP
    block_n, block_g = 64, min(2, next_pow2(groups))
    tiles = cdiv(n, block_n) * cdiv(m, block_m)
    split = _split(tiles, cdiv(groups, block_g), FUSED_PROGRAMS_PER_SM, device, 4)
    return FusedMmConfig(block_m, block_n, block_g, split)


def tuned_to_json(table: dict) -> str:
    rows = [{"qtype": q, "n": n, "k": k, "rows": m, "kind": type(c).__name__, **asdict(c)}
            for (q, n, k, m), c in sorted(table.items())]
    return json.dumps(rows, indent=1)


def load_tuned(path: str | Path) -> int:
    """Add a sweep's JSON (tuned_to_json) to TUNED; returns the entries read."""
    kinds = {"GemvConfig": GemvConfig, "FusedMmConfig": FusedMmConfig}
    rows = json.loads(Path(path).read_text())
    for row in rows:
        key = (row.pop("qtype"), row.pop("n"), row.pop("k"), row.pop("rows"))
        TUNED[key] = kinds[row.pop("kind")](**row)
    return len(rows)
