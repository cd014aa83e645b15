"""The batched LoRA op (many adapters in one batch, the SGMV/BGMV idea), the step's token
grouping it reads, and its torch references. Every token of the batch has an adapter slot
(-1: none); a linear layer's output gets, per token, x @ A[slot].T @ B[slot].T added, in two
steps:

  shrink  h[t, s*R:(s+1)*R] = x[t] @ A[slot_t, s*R:(s+1)*R].T   (float32, per output slice s)
  expand  out[t, n] += h[t, s(n)*R:(s(n)+1)*R] @ B[slot_t, n].T  (n in slice s(n))

`a_stack` [slots, num_slices * R, in] and `b_stack` [slots, out, R] are static stacked buffers
(an adapter's scale is folded into its B; a lower rank is zero-padded to R). A merged layer
(q/k/v, gate/up) has one slice per projection: `bounds` are the slices' output offsets,
[0, q, q + k, q + k + v].

The step's tokens are grouped by slot once per step (`LoraBatch.fill`, on the host, where
the slots are known) into tiles of at most LORA_BLOCK_T tokens of one slot; every layer's
kernels read the same tile table, one program per (tile, column block), so each program
reads one adapter's weights. The table lives in static buffers and the kernels' grids
depend only on the number of tokens, so CUDA graphs capture them (unused tiles exit at once).
On CUDA the Triton kernels of tllm.kernels.triton.lora run; elsewhere the grouped torch
reference below (a matmul per adapter present)."""
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


def lora_shrink_ref(x: torch.Tensor, a_stack: torch.Tensor,
                    indices: torch.Tensor) -> torch.Tensor:
    """h [T, num_slices * R] float32: each token's x times its adapter's A (0 for -1)."""
    h = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    for slot in _slots_present(indices):
        rows = (indices == slot).nonzero().squeeze(1)
        h[rows] = (x[rows].float() @ a_stack[slot].float().T)
    return h


def lora_expand_ref(out: torch.Tensor, h: torch.Tensor, b_stack: torch.Tensor,
                    indices: torch.Tensor, bounds: tuple[int, ...]) -> torch.Tensor:
    """out [T, N] += per slice, h's slice times the token's adapter's B rows (in place)."""
    rank = b_stack.shape[2]
    for slot in _slots_present(indices):
        rows = (indices == slot).nonzero().squeeze(1)
        for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            delta = h[rows, s * rank:(s + 1) * rank] @ b_stack[slot, start:end].float().T
            out[rows, start:end] += delta.to(out.dtype)
    return out


def lora_bmm_ref(out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor,
                 b_stack: torch.Tensor, indices: torch.Tensor,
                 bounds: tuple[int, ...]) -> torch.Tensor:
    """The same as shrink + expand, by gathering each token's A and B and two batched
    matmuls (the plain-torch way on a GPU; no host sync). Returns a new tensor."""
    slots = indices.clamp(min=0).long()
    has = (indices >= 0).to(x.dtype)[:, None]
    h = torch.bmm(a_stack[slots], (x * has)[:, :, None])[:, :, 0]  # [T, S * R]
    rank = b_stack.shape[2]
    deltas = []
    for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        b = b_stack[slots, start:end]                                # [T, n_s, R]
        deltas.append(torch.bmm(b, h[:, s * rank:(s + 1) * rank, None])[:, :, 0])
    return out + torch.cat(deltas, dim=1)


def add_lora(out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
             batch: LoraBatch, bounds: tuple[int, ...],
             config: LoraKernelConfig | None = None) -> torch.Tensor:
    """out += the LoRA deltas of every token (in place; returns out)."""
    if out.is_cuda:
        from tllm.kernels.triton import lora as triton_lora
        h = triton_lora.lora_shrink(x, a_stack, batch, config=config)
        return triton_lora.lora_expand(out, h, b_stack, batch, bounds, config=config)
    indices = batch.indices[:x.shape[0]]
    return lora_expand_ref(out, lora_shrink_ref(x, a_stack, indices), b_stack, indices, bounds)


def _slots_present(indices: torch.Tensor) -> list[int]:
    return [s for s in indices.unique().tolist() if s >= 0]
