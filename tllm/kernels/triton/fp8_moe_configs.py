"""Tile configurations of the FP8 experts (tllm.kernels.triton.fp8_fused_moe), by the average
(token, expert) pairs an expert gets and the weights' scale scheme.

Not the bf16 table of tllm.kernels.triton.fused_moe: an fp8 K tile carries half the bytes of a
bf16 one, Hopper's fp8 tensor cores want K >= 128 per dot, and the W8A8 form promotes each K
tile's partial product to the fp32 accumulator (per-channel: max_num_imprecise_acc; block
scales: the per-tile scale product), which holds a second accumulator in registers; gate_up,
gated, holds two of each. So the large tiles are half as wide in N as bf16's at the same
register use. Block scales clamp block_k to the scale block's bk (128 in checkpoints).

UNTUNED: the values below are reasoned guesses (2026-12-06), not measurements. The per-GEMM
sweep `benchmarks/gpu_fp8_moe_sweep.py` prints the replacement for `FP8_CONFIGS`; paste it
here with the device and date."""
from __future__ import annotations

from tllm.kernels.triton.fused_moe import GemmTile, MoeConfig, config_by_load

SCHEMES = ("channel", "block")
W8A8_MIN_BLOCK_M = 32  # smaller tiles (decode) take the weight-only form (W8A16)

_GUESS = (
    # decode: 16-row tiles, W8A16; block_k 256 keeps a bf16 K tile's bytes in flight
    (1, MoeConfig(16, GemmTile(32, 256, 4, 4), GemmTile(64, 256, 4, 4))),
    (8, MoeConfig(16, GemmTile(32, 256, 4, 4), GemmTile(64, 256, 4, 4))),
    # W8A8: fp8 dots of K 128; gate_up's gated tile is 2 x block_n weight rows
    (32, MoeConfig(32, GemmTile(64, 128, 4, 4), GemmTile(128, 128, 4, 4), group_m=8)),
    (96, MoeConfig(64, GemmTile(64, 128, 4, 4), GemmTile(128, 128, 4, 4), group_m=8)),
    (float("inf"), MoeConfig(128, GemmTile(64, 128, 8, 4), GemmTile(128, 128, 8, 4),
                             group_m=16)),
)

# (largest average pairs per expert, config) per scale scheme
FP8_CONFIGS: dict[str, tuple[tuple[float, MoeConfig], ...]] = {
    "channel": _GUESS,
    "block": _GUESS,
}


def fp8_moe_config(num_tokens: int, top_k: int, num_experts: int,
                   scheme: str = "channel") -> MoeConfig:
    """The tile configuration of a step's FP8 experts; scheme "channel" (per-channel or
    per-tensor weight scales) or "block" (block scales)."""
    if scheme not in FP8_CONFIGS:
        raise ValueError(f"scheme must be one of {sorted(FP8_CONFIGS)}, got {scheme!r}")
    return config_by_load(FP8_CONFIGS[scheme], num_tokens, top_k, num_experts)


def is_w8a8(config: MoeConfig) -> bool:
    """The form a configuration runs: W8A8 at tiles of W8A8_MIN_BLOCK_M rows and up."""
    return config.block_m >= W8A8_MIN_BLOCK_M
