"""Torch reference for the paged attention kernels (context and decode), computed in float32
from the same tensors the kernels take."""
from __future__ import annotations

import torch

from tllm.kernels.paged import causal_mask, from_cache, gather_kv, soft_cap


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float,
                        sliding_window: int | None = None,
                        kv_scales: tuple[float, float] = (1.0, 1.0),
                        logits_soft_cap: float | None = None,
                        sinks: torch.Tensor | None = None,
                        chunk_size: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries (the last query_len positions of its
    seq_len-token context) over its cached keys and values; float32 [T, Hq, D]. An fp8
    cache's values are dequantized with `kv_scales` (real = fp8 * scale); with
    `logits_soft_cap` the scores are capped (cap * tanh(scores / cap)) before the mask; `sinks`
    [Hq]: a logit per head in the softmax's denominator (GPT-OSS's attention sinks);
    `chunk_size`: chunked local attention (Llama 4: keys of the query's own chunk only)."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    tokens_per_block = k_cache.shape[1]
    starts = query_start_loc.tolist()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        qi = q[starts[i]:starts[i + 1]].float().transpose(0, 1)             # [Hq, q, D]
        k, v = gather_kv((k_cache, v_cache), block_tables[i], seq_len, tokens_per_block)
        k, v = from_cache(k, kv_scales[0], torch.float32), from_cache(v, kv_scales[1],
                                                                      torch.float32)
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)             # [Hq, s, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        scores = soft_cap((qi @ k.transpose(1, 2)) * scale, logits_soft_cap)
        mask = causal_mask(qi.shape[1], seq_len, sliding_window, q.device, chunk_size)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is None:
            probs = scores.softmax(dim=-1)
        else:
            sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out[starts[i]:starts[i + 1]] = (probs @ v).transpose(0, 1)
    return out
