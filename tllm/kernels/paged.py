"""Plain-torch helpers over the paged KV layout ([num_blocks, tokens_per_block, kv_heads,
head_dim]) shared by the torch attention backend and the kernels' references."""
from __future__ import annotations

import torch


def gather_kv(kv_cache: tuple[torch.Tensor, torch.Tensor], block_table: torch.Tensor, seq_len: int,
              tokens_per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one sequence, [seq_len, kv_heads, head_dim]."""
    num_blocks = -(-seq_len // tokens_per_block)
    blocks = block_table[:num_blocks]
    k_cache, v_cache = kv_cache
    k = k_cache[blocks].flatten(0, 1)[:seq_len]
    v = v_cache[blocks].flatten(0, 1)[:seq_len]
    return k, v


def causal_mask(query_len: int, seq_len: int, sliding_window: int | None,
                device: torch.device) -> torch.Tensor:
    """True where query i (at position seq_len - query_len + i) may attend key j."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask
