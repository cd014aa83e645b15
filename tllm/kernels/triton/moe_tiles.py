"""The tile configurations of the fused MoE kernels (tllm.kernels.triton.fused_moe and the
kernels built on it) and their lookup by load; no Triton here, so a table can be read (and
the decode path's module import it) without the kernels."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GemmTile:
    """One GEMM's tile: block_n output columns (for gate_up: of each of gate and up, so a
    program reads 2 * block_n weight rows), block_k of the reduction per step."""
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeConfig:
    block_m: int          # rows of a tile; each expert's pairs padded to a multiple of it
    gate_up: GemmTile
    down: GemmTile
    group_m: int = 1      # m tiles that walk the n tiles together (weight reuse in L2)


def config_by_load(table, num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    """The first config of `table` ((largest average pairs per expert, config), ascending)
    whose bound the step's average pairs per expert does not pass."""
    per_expert = num_tokens * top_k / max(1, num_experts)
    return next(cfg for limit, cfg in table if per_expert <= limit)
