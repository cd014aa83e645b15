"""Launch configurations of the dense small-M GEMV (tllm.kernels.triton.dense_gemv) and the
per-device tables that say, per weight shape, whether it beats cuBLAS there.

A table is a JSON list of rows {"kind": "plain" | "silu_mul", "n", "k", "use", "block_n",
"block_k", "num_warps", "num_stages", ...}; "n" is the weight's row count (2 I for
silu_mul's merged [gate | up]); extra fields (timings) are kept for the reader, not used.
benchmarks/gpu_gemv.py measures and writes them; a device's table lives beside this file as
configs/dense_gemv_<device name>.json, and a path handed in (TLLM_DENSE_GEMV_CONFIGS, read by
tllm.layers.dense_gemv_dispatch) replaces it. No table or no row for a shape: the caller keeps
F.linear (an untested GPU is never assumed faster). No Triton import here, so a CPU-only
process can ask without loading the kernels."""
from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

KINDS = ("plain", "silu_mul")
CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class DenseGemvConfig:
    """One program computes block_n output rows (silu_mul: block_n rows of gate and the same
    of up) over K in steps of block_k columns."""

    block_n: int = 4
    block_k: int = 1024
    num_warps: int = 4
    num_stages: int = 2

    def label(self) -> str:
        return (f"n{self.block_n} k{self.block_k} w{self.num_warps} "
                f"s{self.num_stages}")


# Not timed yet (the sweep's table replaces them). 4 rows x 1024 columns on 4 warps: 32
# weights (four 16-byte loads) a thread an iteration, 768-7168 programs at Llama-3.1-8B's
# shapes; compiled for sm_90 by Triton 3.6 on a CPU: 70 registers, 10 KB of shared memory,
# the loads pipelined (cp.async) at num_stages 2. silu_mul holds two tiles (gate and up):
# 2 rows of each keeps the same bytes and registers (70; 4 rows take 122).
DEFAULT_CONFIG = DenseGemvConfig()
DEFAULT_CONFIGS = {"plain": DEFAULT_CONFIG, "silu_mul": DenseGemvConfig(block_n=2)}


@dataclass(frozen=True)
class TableEntry:
    use: bool
    config: DenseGemvConfig


def device_file_name(device_name: str) -> str:
    return "dense_gemv_" + re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"


def parse_table(rows: list[dict]) -> dict[tuple[str, int, int], TableEntry]:
    table = {}
    for row in rows:
        if row["kind"] not in KINDS:
            raise ValueError(f"dense GEMV table: kind {row['kind']!r} is not one of {KINDS}")
        config = DenseGemvConfig(row["block_n"], row["block_k"], row["num_warps"],
                                 row["num_stages"])
        table[(row["kind"], int(row["n"]), int(row["k"]))] = TableEntry(bool(row["use"]),
                                                                        config)
    return table


@functools.lru_cache(maxsize=None)
def load_table(path: str) -> dict[tuple[str, int, int], TableEntry]:
    """A table file, read once a process per path ({} where there is no file)."""
    file = Path(path)
    return parse_table(json.loads(file.read_text())) if file.exists() else {}


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def table_path(device: torch.device, override: str | None) -> str | None:
    """The table for `device`: `override` where given, else the device's file beside this
    module; None on a CPU."""
    if override:
        return override
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(CONFIG_DIR / device_file_name(_device_name(index)))


def table_entry(kind: str, n: int, k: int, device: torch.device,
                override: str | None = None) -> TableEntry | None:
    path = table_path(device, override)
    return None if path is None else load_table(path).get((kind, n, k))


def table_to_json(rows: dict[tuple[str, int, int], TableEntry], extra: dict | None = None) -> str:
    """A table as JSON; `extra[(kind, n, k)]` adds fields (timings) to a row."""
    out = []
    for key, entry in sorted(rows.items()):
        kind, n, k = key
        out.append({"kind": kind, "n": n, "k": k, "use": entry.use, **asdict(entry.config),
                    **(extra or {}).get(key, {})})
    return json.dumps(out, indent=1)
