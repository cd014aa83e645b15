"""Attention in plain PyTorch over the paged cache: the CPU path and the reference for the
Triton kernels. Gathers each sequence's keys and values through its block table, then runs
scaled dot-product attention with a causal mask offset by the cached prefix."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tllm.attention.interface import NO_KV_SCALES, AttentionBackend, AttentionMetadata, KVCache
from tllm.kernels.paged import causal_mask, from_cache, gather_kv, write_kv_cache


# torch >= 2.5 broadcasts kv heads itself; older versions need them repeated.
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def _expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """[seq, kv_heads, dim] -> [heads or kv_heads, seq, dim] for SDPA."""
    x = x.transpose(0, 1)
    return x if _SDPA_GQA or group == 1 else x.repeat_interleave(group, dim=0)


def paged_attention_ref(q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                        scale: float, sliding_window: int | None = None,
                        kv_scales: tuple[float, float] = NO_KV_SCALES) -> torch.Tensor:
    """Attention of every query token over its sequence's cached context."""
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], kv_cache[0].shape[2]
    group = num_heads // num_kv_heads
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
        k, v = gather_kv(kv_cache, metadata.block_tables[i], seq_len, metadata.tokens_per_block)
        qi = q[start:start + query_len].transpose(0, 1)          # [heads, q, d]
        k, v = from_cache(k, kv_scales[0], q.dtype), from_cache(v, kv_scales[1], q.dtype)
        ki, vi = _expand_kv(k, group), _expand_kv(v, group)
        gqa = {"enable_gqa": True} if _SDPA_GQA and group > 1 else {}
        window_matters = sliding_window is not None and sliding_window < seq_len
        if not window_matters and query_len in (1, seq_len):  # no mask, or a plain causal one
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=query_len > 1,
                                               scale=scale, **gqa)
        else:
            mask = causal_mask(query_len, seq_len, sliding_window, q.device)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, **gqa)
        out[start:start + query_len] = o.transpose(0, 1)
        start += query_len
    return out


class TorchAttentionBackend(AttentionBackend):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata,
                kv_scales: tuple[float, float] = NO_KV_SCALES) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping, kv_scales)
        return paged_attention_ref(q, kv_cache, metadata, self.scale, self.sliding_window,
                                   kv_scales)
