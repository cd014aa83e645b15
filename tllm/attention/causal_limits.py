"""Attention where each query token sees the keys up to its own limit position instead of
its own position: Gemma 3's image tokens attend bidirectionally within their image (the
limit of an image token is the image's last position in the step), every other token
causally (its limit is its position). One masked SDPA per sequence over its gathered
context: steps with images only, so the plain batched paths stay as they are."""
from __future__ import annotations

import torch

from tllm.attention.interface import NO_KV_SCALES, AttentionMetadata, KVCache
from tllm.kernels.paged import from_cache, gather_kv, soft_capped_attention


def attend_with_limits(q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                       scale: float, sliding_window: int | None = None,
                       kv_scales: tuple[float, float] = NO_KV_SCALES,
                       logits_soft_cap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_tokens, heads, d], keys and values already in the cache; query t sees key
    position j when j <= metadata.causal_limits[t] and, under a window, j > its position
    minus the window (transformers' AND(window, OR(causal, image block)))."""
    out = torch.empty_like(q)
    limits, positions = metadata.causal_limits, metadata.positions
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
        rows = slice(start, start + query_len)
        start += query_len
        if query_len == 0:
            continue
        k, v = gather_kv(kv_cache, metadata.block_tables[i], seq_len, metadata.tokens_per_block)
        k, v = from_cache(k, kv_scales[0], q.dtype), from_cache(v, kv_scales[1], q.dtype)
        allowed = _allowed(positions[rows], limits[rows], seq_len, sliding_window)
        # a key no query sees (a block the window dropped) may hold anything; 0 * NaN = NaN
        v = v.masked_fill(~allowed.any(0)[:, None, None], 0)
        out[rows] = _attend(q[rows].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                            allowed, scale, logits_soft_cap, sinks).transpose(0, 1)
    return out


def _allowed(positions: torch.Tensor, limits: torch.Tensor, seq_len: int,
             sliding_window: int | None) -> torch.Tensor:
    """[q, seq_len] True where the query may see the key."""
    keys = torch.arange(seq_len, device=positions.device)[None, :]
    allowed = keys <= limits[:, None]
    if sliding_window is not None:
        allowed &= keys > positions[:, None] - sliding_window
    return allowed


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
            scale: float, logits_soft_cap: float | None,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """q [heads, q, d] over k, v [kv_heads, seq, d] under the boolean mask."""
    if logits_soft_cap is not None or sinks is not None:
        return soft_capped_attention(q, k, v, allowed, scale, logits_soft_cap,
                                     None if sinks is None else sinks.view(-1, 1, 1))
    group = q.shape[0] // k.shape[0]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                                            scale=scale)
