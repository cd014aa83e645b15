"""Plain-torch helpers over the paged KV layout ([num_blocks, tokens_per_block, kv_heads,
head_dim]) shared by the torch attention backend and the kernels' references."""
from __future__ import annotations

import torch


FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Keys or values as the cache stores them: fp8 caches hold x / scale."""
    if is_fp8(cache):
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)
    return x.to(cache.dtype)


def from_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype) if is_fp8(x) else x.to(dtype)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                   slot_mapping: torch.Tensor,
                   kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    for x, cache, scale in zip((k, v), kv_cache, kv_scales):
        flat = cache.view(-1, *cache.shape[2:])
        if is_fp8(cache):  # index_copy_ has no float8 kernel: copy the bytes
            flat.view(torch.uint8).index_copy_(0, slot_mapping,
                                               to_cache(x, cache, scale).view(torch.uint8))
        else:
            flat.index_copy_(0, slot_mapping, to_cache(x, cache, scale))


def gather_kv(kv_cache: tuple[torch.Tensor, torch.Tensor], block_table: torch.Tensor, seq_len: int,
              tokens_per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one sequence, [seq_len, kv_heads, head_dim], as stored."""
    num_blocks = -(-seq_len // tokens_per_block)
    blocks = block_table[:num_blocks]
    k_cache, v_cache = kv_cache
    if is_fp8(k_cache):  # gather the bytes (no float8 indexing kernel on every device)
        k = k_cache.view(torch.uint8)[blocks].view(k_cache.dtype)
        v = v_cache.view(torch.uint8)[blocks].view(v_cache.dtype)
    else:
        k, v = k_cache[blocks], v_cache[blocks]
    return k.flatten(0, 1)[:seq_len], v.flatten(0, 1)[:seq_len]


def causal_mask(query_len: int, seq_len: int, sliding_window: int | None,
                device: torch.device, chunk_size: int | None = None) -> torch.Tensor:
    """True where query i (at position seq_len - query_len + i) may attend key j.
    `chunk_size`: chunked local attention (Llama 4), keys of the query's own chunk only."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    if chunk_size is not None:
        mask &= k_pos >= q_pos // chunk_size * chunk_size
    return mask


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Whole blocks of one cache, [len(block_ids), tokens_per_block, kv_heads, head_dim], as
    stored: one index_select for a batch of sequences (block_ids holds all their tables).
    `out`: a buffer of that shape and the cache's dtype to gather into."""
    if is_fp8(cache):  # gather the bytes (no float8 indexing kernel on every device)
        bytes_out = None if out is None else out.view(torch.uint8)
        return torch.index_select(cache.view(torch.uint8), 0, block_ids,
                                  out=bytes_out).view(cache.dtype)
    return torch.index_select(cache, 0, block_ids, out=out)


def batched_causal_mask(query_lens: torch.Tensor, seq_lens: torch.Tensor,
                        first_keys: torch.Tensor, max_query_len: int, num_keys: int,
                        sliding_window: int | None,
                        chunk_size: int | None = None) -> torch.Tensor:
    """[n, max_query_len, num_keys] bool: True where query i of sequence b may attend key
    column j, which holds position first_keys[b] + j. Queries sit at the last query_lens[b]
    of seq_lens[b] positions; padding rows (i >= query_lens[b]) repeat the last query, so
    every row attends at least one key; columns at or past seq_lens[b] are never attended.
    `chunk_size`: only keys of the query's own chunk (chunked local attention)."""
    rows = torch.arange(max_query_len, device=seq_lens.device)
    q_pos = torch.minimum((seq_lens - query_lens)[:, None] + rows, seq_lens[:, None] - 1)
    k_pos = first_keys[:, None] + torch.arange(num_keys, device=seq_lens.device)
    mask = k_pos[:, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    if chunk_size is not None:
        mask &= k_pos[:, None, :] >= (q_pos // chunk_size * chunk_size)[:, :, None]
    return mask


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(scores / cap) (Gemma 2's attention and final logits), in HF's order of
    operations; None: the scores as they are."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def soft_capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor | None, scale: float,
                          logits_soft_cap: float | None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(soft_cap(q k^T * scale) + mask) v with the scores computed explicitly, in
    float32 (SDPA can neither cap its scores nor take a sink). q [..., heads, Lq, D]; k, v
    [..., kv_heads, Lk, D] (query heads grouped over kv heads); mask: bool (True: attend) or
    additive, broadcast to [..., heads, Lq, Lk]; None: every key. `sinks`: a learned logit
    per head (GPT-OSS) that joins the softmax's denominator and attends to nothing, shaped
    to broadcast to [..., heads, Lq, 1]. Returns q's shape and dtype."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = soft_cap((q.float() @ k.float().transpose(-1, -2)) * scale, logits_soft_cap)
    if mask is not None:
        scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                  else scores + mask)
    if sinks is None:
        return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return (probs @ v.float()).to(q.dtype)
