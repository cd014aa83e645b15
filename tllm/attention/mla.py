"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache, in the absorbed
form: the cache holds per token one "head" of kv_lora_rank latent dims (after
kv_a_layernorm) followed by the rope part of the key, and no values
(KVCacheSpec.keys_only). The model folds W_UK into the query beforehand (q_nope @ W_UK gives
kv_lora_rank dims, the rope part of q follows), so attention is multi-query attention with
one kv head of kv_lora_rank + rope dims whose values are the first kv_lora_rank dims of the
keys; the model takes the output through W_UV afterwards. Prefill, chunked prefill, prefix
reuse and decode all read the same cache this way.

`MlaAttentionBackend` runs decode-only steps on a GPU with the Triton kernel
(tllm.kernels.triton.mla_decode) and everything else on the plain-PyTorch path (the CPU path
and the kernel's reference): the torch backend's batched plan (sequences grouped, masks) with
each group's blocks gathered once and read as both keys and values."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tllm.attention.interface import NO_KV_SCALES, AttentionMetadata, KVCache
from tllm.attention.torch_ref import (AttentionGroup, GatherBuffers, _gather, _real_rows,
                                      plan_attention)
from tllm.kernels.paged import from_cache, to_cache


def write_latent_cache(entry: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                       scale: float = 1.0) -> None:
    """entry [T, 1, kv_lora_rank + rope] into its slots of the latent cache; a negative slot
    (a padding row of a captured CUDA graph) writes nothing."""
    if entry.is_cuda:   # the paged-KV write kernel skips negative slots; index_copy_ cannot
        from tllm.kernels.triton.kv_cache import write_kv
        write_kv(entry, entry, cache, cache, slot_mapping, scale, scale)
        return
    flat = cache.view(-1, *cache.shape[2:])
    stored = to_cache(entry, cache, scale)
    if stored.element_size() == 1:  # index_copy_ has no float8 kernel: copy the bytes
        flat.view(torch.uint8).index_copy_(0, slot_mapping, stored.view(torch.uint8))
    else:
        flat.index_copy_(0, slot_mapping, stored)


def mla_attend_group(q: torch.Tensor, cache: torch.Tensor, group: AttentionGroup,
                     latent_dim: int, scale: float, kv_scale: float = 1.0,
                     buffers: GatherBuffers | None = None) -> torch.Tensor:
    """The group's real query rows [rows, heads, latent_dim] in out_rows order: q [T, heads,
    latent_dim + rope] against the cached entries, values = their first latent_dim dims."""
    n, max_q, num_keys = group.num_seqs, group.max_query_len, group.num_keys
    num_heads, width = q.shape[1], q.shape[2]
    keys = from_cache(_gather(cache, group, buffers, 0), kv_scale, q.dtype)
    keys = keys.view(n, 1, num_keys, width)
    values = keys[..., :latent_dim]
    qg = q if group.q_rows is None else q.index_select(0, group.q_rows)
    if max_q == 1:  # decode: the heads act as one kv head's queries
        qg = qg.view(n, 1, num_heads, width)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=group.mask,
                                           scale=scale)
        return o.reshape(n, num_heads, latent_dim)
    qg = qg.view(n, max_q, num_heads, width).transpose(1, 2)
    o = F.scaled_dot_product_attention(qg, keys.expand(-1, num_heads, -1, -1),
                                       values.expand(-1, num_heads, -1, -1),
                                       attn_mask=group.mask, is_causal=group.is_causal,
                                       scale=scale)
    return _real_rows(o, group)


def mla_attention_ref(q: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                      latent_dim: int, scale: float, kv_scale: float = 1.0,
                      groups: list[AttentionGroup] | None = None,
                      buffers: GatherBuffers | None = None) -> torch.Tensor:
    """Absorbed-form attention of every query token over its sequence's cached latents:
    q [T, heads, latent_dim + rope] -> [T, heads, latent_dim]."""
    if groups is None:
        groups = plan_attention(metadata, None, q.dtype,
                                cache.shape[2] * cache.shape[3] * cache.element_size(),
                                q.shape[1], q.shape[2])
    out = q.new_empty(q.shape[0], q.shape[1], latent_dim)
    for group in groups:
        o = mla_attend_group(q, cache, group, latent_dim, scale, kv_scale, buffers)
        if group.out_rows is None:
            return o
        out.index_copy_(0, group.out_rows, o)
    return out


_MAX_PLANS = 4  # this step's plan, and a few kept across the layers' turns
# Steps whose queries are this short (decode, speculative verify, a draft head's catch-up)
# take the Triton kernel, a query row at a time (each reads its context once per head
# block); longer prompt chunks take the batched torch path, which reads it once.
MAX_KERNEL_QUERIES = 8


def query_rows_as_sequences(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_tables: torch.Tensor,
                            num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row of a step as a one-token sequence for the decode kernel: row t of
    sequence i (rows query_start_loc[i]:[i+1]) sees the first seq_lens[i] - (end_i - t) + 1
    tokens (causal); rows past the last sequence's (a graph's padding) see none. Device
    ops only (no host sync). Returns (row_seq_lens [T] int32, row_block_tables [T, W])."""
    num_seqs = query_start_loc.shape[0] - 1
    rows = torch.arange(num_tokens, dtype=query_start_loc.dtype,
                        device=query_start_loc.device)
    seq = (torch.searchsorted(query_start_loc, rows, right=True) - 1).clamp_(0, num_seqs - 1)
    ends = query_start_loc[seq + 1]
    lens = seq_lens[seq] - (ends - rows) + 1
    lens = torch.where(rows < query_start_loc[num_seqs], lens, 0).clamp_(min=0)
    return lens.to(torch.int32), block_tables.index_select(0, seq)


class MlaAttentionBackend:
    """Writes each step's latent entries into the layer's cache and attends in the absorbed
    form (module docstring); one object per model, its plan built once per step."""

    def __init__(self, num_heads: int, latent_dim: int, rope_dim: int, scale: float) -> None:
        self.num_heads, self.latent_dim, self.rope_dim = num_heads, latent_dim, rope_dim
        self.head_dim = latent_dim + rope_dim  # of the cache's one head
        self.scale = scale
        self._plans: list[tuple[AttentionMetadata, torch.dtype, list[AttentionGroup]]] = []
        self._buffers = GatherBuffers()
        self._rows: tuple[AttentionMetadata, tuple[torch.Tensor, torch.Tensor]] | None = None

    def forward(self, q: torch.Tensor, entry: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata,
                kv_scales: tuple[float, float] = NO_KV_SCALES) -> torch.Tensor:
        """q [T, heads, latent + rope] (W_UK folded in, rope applied); entry [T, 1, latent +
        rope] (this step's tokens). Returns [T, heads, latent]."""
        if metadata.capture is not None:  # piecewise capture: runs between the pieces
            return metadata.capture.defer(self._deferred, q, entry, entry, kv_cache,
                                          metadata, kv_scales)
        cache = kv_cache[0]
        if (q.is_cuda and metadata.max_query_len <= MAX_KERNEL_QUERIES
                and cache.dtype == q.dtype):
            from tllm.kernels.triton.mla_decode import mla_decode_attention
            write_latent_cache(entry, cache, metadata.slot_mapping)
            if metadata.is_decode_only:  # a row per sequence already
                tables, lens, starts = (metadata.block_tables, metadata.seq_lens,
                                        metadata.query_start_loc)
            else:
                (lens, tables), starts = self._query_rows(metadata, q.shape[0]), None
            return mla_decode_attention(q, cache, tables, lens, self.latent_dim, self.scale,
                                        metadata.max_seq_len, query_start_loc=starts)
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            # the plan is built on the host from this step's lengths: a graph would replay
            # a stale one (the engine turns decode graphs off on this error)
            raise RuntimeError("the torch MLA path cannot be captured in a CUDA graph")
        write_latent_cache(entry, cache, metadata.slot_mapping, kv_scales[0])
        return mla_attention_ref(q, cache, metadata, self.latent_dim, self.scale,
                                 kv_scales[0], self._groups(q, cache, metadata), self._buffers)

    def _query_rows(self, metadata: AttentionMetadata,
                    num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's query rows as one-token sequences (made once per step, on the device,
        so a verify graph captures it): each row's causal context length and its block table
        row."""
        if self._rows is not None and self._rows[0] is metadata:
            return self._rows[1]
        rows = query_rows_as_sequences(metadata.query_start_loc, metadata.seq_lens,
                                       metadata.block_tables, num_tokens)
        self._rows = (metadata, rows)
        return rows

    def _deferred(self, q, entry, _entry, kv_cache, metadata, kv_scales):
        """Run between piecewise graphs, where the output must have q's shape."""
        out = self.forward(q, entry, kv_cache, metadata, kv_scales)
        return F.pad(out, (0, self.rope_dim))

    def _groups(self, q: torch.Tensor, cache: torch.Tensor,
                metadata: AttentionMetadata) -> list[AttentionGroup]:
        for plan_metadata, dtype, groups in self._plans:
            if plan_metadata is metadata and dtype == q.dtype:
                return groups
        groups = plan_attention(metadata, None, q.dtype,
                                cache.shape[2] * cache.shape[3] * cache.element_size(),
                                q.shape[1], q.shape[2])
        if len(self._plans) == _MAX_PLANS:
            self._plans.pop(0)
        self._plans.append((metadata, q.dtype, groups))
        return groups
