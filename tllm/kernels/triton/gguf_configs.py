"""Launch configurations of the GGUF kernels (tllm.kernels.triton.gguf_gemm): a tile per type
from measurements, a K split computed from the SM count, and tuned entries that override both
for an exact (type, N, K, rows) where a sweep found better (benchmarks/gpu_gguf.py measures
them and writes a JSON; `load_tuned` reads one; `TUNED` holds them in the process, and takes
configs/gguf_<device name>.json beside this file, where there is one for the GPU in use).

Evidence behind the defaults: on the H200 (benchmarks/gpu_gguf.py, the first kernels, 6144 x
4096) at one row 8 weight rows x 512 values a step on 2 warps (21.7 us Q4_K, 19.6 us Q8_0)
beat 16 rows on 4 warps split twice (24.0 / 24.8 us): more small programs in flight hid more
of the memory latency. For the present GEMV, compiled for sm_90 without a GPU (instructions
in the K loop a weight value, registers a thread): 4 rows x 16 groups on 1 warp, Q4_K 7.6 /
94, Q6_K 10.0 / 95, Q8_0 6.9 / 94; 8 x 32 on 2 warps 7.1 / 252, 9.4 / 245, 6.5 / 164 (fewer
instructions, a quarter of the programs an SM holds); 8 x 16 on 2 warps, the first sweep's
best, needs x at the tile's full shape, 10.2 for Q4_K. Not yet timed: the sweep's JSON
(configs/) replaces these guesses per shape."""
from __future__ import annotations

import functools
import json
import re
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
GEMV_TILES = {qtype: (4, 16, 1) for qtype in
              ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")}
GEMV_WARPS_PER_SM = 16       # split K until about this many warps run on each SM
FUSED_PROGRAMS_PER_SM = 2
# (qtype, n, k, rows bucket) -> config, from a sweep; rows bucket: 1, or the fused block_m
TUNED: dict[tuple[str, int, int, int], GemvConfig | FusedMmConfig] = {}


CONFIG_DIR = Path(__file__).parent / "configs"


def device_file_name(device_name: str) -> str:
    return "gguf_" + re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"


@functools.lru_cache(maxsize=None)
def _load_device_table(index: int) -> int:
    """Once a process per GPU: its measured table into TUNED (entries already there win)."""
    path = CONFIG_DIR / device_file_name(torch.cuda.get_device_name(index))
    if not path.exists():
        return 0
    before = dict(TUNED)
    count = load_tuned(path)
    TUNED.update(before)
    return count


def _tuned(key: tuple, device: torch.device):
    if device.type == "cuda":
        _load_device_table(device.index if device.index is not None
                           else torch.cuda.current_device())
    return TUNED.get(key)


def split_for(tiles: int, steps: int, per_sm: int, device: torch.device, min_steps: int) -> int:
    """K splits so that about per_sm programs run on each SM, keeping min_steps K steps a
    split."""
    target = per_sm * num_sms(device)
    if tiles >= target:
        return 1
    return max(1, min(cdiv(target, tiles), steps // min_steps))


def gemv_config(qtype: str, n: int, k: int, device: torch.device) -> GemvConfig:
    tuned = _tuned((qtype, n, k, 1), device)
    if isinstance(tuned, GemvConfig):
        return tuned
    block_n, block_g, warps = GEMV_TILES.get(qtype, (4, 16, 1))
    groups = k // GROUP
    block_g = min(block_g, next_pow2(groups))
    split = split_for(cdiv(n, block_n), cdiv(groups, block_g),
                      max(1, GEMV_WARPS_PER_SM // warps), device, 2)
    return GemvConfig(block_n, block_g, split, warps)


def rows_bucket(m: int) -> int:
    return min(64, max(16, next_pow2(m)))


def fused_mm_config(qtype: str, m: int, n: int, k: int, device: torch.device) -> FusedMmConfig:
    block_m = rows_bucket(m)
    tuned = _tuned((qtype, n, k, block_m), device)
    if isinstance(tuned, FusedMmConfig):
        return tuned
    groups = k // GROUP
    block_n, block_g = 64, min(4, next_pow2(groups))
    tiles = cdiv(n, block_n) * cdiv(m, block_m)
    split = split_for(tiles, cdiv(groups, block_g), FUSED_PROGRAMS_PER_SM, device, 4)
    # the tile kernel: 10.3 instructions a weight value in its K loop for Q4_K at 32 x 64 x 4
    # groups (sm_90, compiled here), the per-half-group dots 13 at 2 groups (their operand
    # goes through shared memory each depth-16 dot); the sweep times both
    return FusedMmConfig(block_m, block_n, block_g, split, num_stages=2, tile=True)


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
