"""Attention in plain PyTorch over the paged cache: the CPU path and the reference for the
Triton kernels. Gathers each sequence's keys and values through its block table, then runs
scaled dot-product attention with a causal mask offset by the cached prefix."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tllm.attention.interface import AttentionBackend, AttentionMetadata, KVCache


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                   slot_mapping: torch.Tensor) -> None:
    k_cache, v_cache = kv_cache
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(kv_cache: KVCache, block_table: torch.Tensor, seq_len: int,
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


def paged_attention_ref(q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                        scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Attention of every query token over its sequence's cached context."""
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], kv_cache[0].shape[2]
    group = num_heads // num_kv_heads
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
        k, v = gather_kv(kv_cache, metadata.block_tables[i], seq_len, metadata.tokens_per_block)
        qi = q[start:start + query_len].transpose(0, 1)          # [heads, q, d]
        ki = k.to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
        vi = v.to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
        if query_len == seq_len and sliding_window is None:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        else:
            mask = causal_mask(query_len, seq_len, sliding_window, q.device)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[start:start + query_len] = o.transpose(0, 1)
        start += query_len
    return out


class TorchAttentionBackend(AttentionBackend):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        return paged_attention_ref(q, kv_cache, metadata, self.scale, self.sliding_window)
