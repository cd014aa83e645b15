"""The step's tokens grouped by adapter slot (`LoraBatch`), which every layer's batched LoRA
op reads (tllm.kernels.lora), and the launch settings of its Triton kernels.

The grouping is computed once per step on the host, where the slots are known, into tiles of
at most LORA_BLOCK_T tokens of one slot, held in static device buffers: a captured CUDA
graph reads them too, and its kernels' grids depend only on the number of tokens."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

LORA_BLOCK_T = 16  # tokens of a tile: tl.dot's minimum M


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class LoraKernelConfig:
    """Launch settings of the Triton kernels (the benchmark sweeps them)."""

    shrink_block_k: int = 128
    shrink_programs_per_sm: int = 2   # split K until the shrink has about this many
    expand_block_n: int = 128
    num_warps: int = 4


class LoraBatch:
    """A step's tokens grouped by adapter slot, in static device buffers that every layer
    (and a captured graph) reads: `tile_slots` [max_tiles] each tile's slot (-1: unused),
    `tile_tokens` [max_tiles, LORA_BLOCK_T] its token ids (-1: no token), and `indices`
    [max_tokens] each token's slot (-1: none; the references read it, first `num_tokens`)."""

    def __init__(self, max_tokens: int, max_loras: int, device: torch.device) -> None:
        self.max_tokens, self.max_loras = max_tokens, max_loras
        self.max_tiles = _cdiv(max_tokens, LORA_BLOCK_T) + max_loras
        self.num_tokens = 0
        self.has_adapters = False
        # one buffer, so that a step's table goes over in one copy
        self._table = torch.full((self.max_tiles * (1 + LORA_BLOCK_T),), -1,
                                 dtype=torch.int32, device=device)
        self.tile_slots = self._table[:self.max_tiles]
        self.tile_tokens = self._table[self.max_tiles:].view(self.max_tiles, LORA_BLOCK_T)
        self.indices = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)

    def tile_bound(self, num_tokens: int) -> int:
        """Programs along the tile axis for a step of `num_tokens` rows (graph-static): at
        most one partly filled tile per slot beyond the full ones."""
        return min(self.max_tiles, _cdiv(num_tokens, LORA_BLOCK_T) + self.max_loras)

    def fill(self, per_token) -> None:
        """This step's grouping from each token's slot (host ints: a list, array or CPU
        tensor)."""
        per_token = np.asarray(per_token, dtype=np.int32)
        n = per_token.shape[0]
        if n > self.max_tokens:
            raise RuntimeError(f"a step of {n} tokens is larger than LoRA's token buffer "
                               f"({self.max_tokens})")
        slots, tokens = group_tokens(per_token, self.max_tiles)
        packed = np.concatenate([slots, tokens.ravel()])  # rows past `tokens` stay unread
        self._table[:packed.shape[0]].copy_(torch.from_numpy(packed), non_blocking=True)
        self.indices[:n].copy_(torch.from_numpy(per_token), non_blocking=True)
        self.num_tokens = n
        self.has_adapters = tokens.shape[0] > 0


def group_tokens(per_token, max_tiles: int, block_t: int = LORA_BLOCK_T
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(tile slots [max_tiles] int32, -1 past the used tiles; tile tokens [used, block_t]
    int32, -1 padded): the tokens with a slot, grouped by slot into tiles of one slot.
    numpy: this runs on the host every step, and torch's small CPU ops cost far more."""
    per_token = np.asarray(per_token, dtype=np.int64)
    order = np.argsort(per_token, kind="stable")
    order = order[int((per_token < 0).sum()):]
    sorted_slots = per_token[order]
    seg_start = np.flatnonzero(np.diff(sorted_slots, prepend=-2))   # each slot's first
    counts = np.diff(np.append(seg_start, order.shape[0]))
    tiles_per_slot = (counts + block_t - 1) // block_t
    seg = np.repeat(np.arange(seg_start.shape[0]), tiles_per_slot)
    first_tile = np.cumsum(tiles_per_slot) - tiles_per_slot
    offset = (np.arange(seg.shape[0]) - first_tile[seg]) * block_t  # within the slot
    lanes = np.arange(block_t)
    has_token = lanes[None, :] < (counts[seg] - offset)[:, None]
    positions = np.minimum((seg_start[seg] + offset)[:, None] + lanes[None, :],
                           max(order.shape[0] - 1, 0))
    tokens = np.where(has_token, order[positions] if order.size else positions, -1)
    tile_slots = np.full(max_tiles, -1, dtype=np.int32)
    tile_slots[:seg.shape[0]] = sorted_slots[seg_start[seg]]
    return tile_slots, tokens.astype(np.int32)
