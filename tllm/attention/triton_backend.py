"""Attention with Triton kernels over the paged cache: the CUDA path. Decode-only steps use the
GQA-grouped split-K decode kernel; any step with a longer query (prefill, chunked prefill,
mixed prefill + decode) uses the paged context kernel (a mixed step's leading decodes go to
the decode kernel), except that steps whose queries are
all short (speculative verification: the last token plus up to 7 drafts) stay on the decode
kernel, whose grid does not depend on the query lengths, so a CUDA graph captured at the
longest verify query replays any shorter mix. An fp8 cache stores k / k_scale and
v / v_scale (the layer's per-tensor scales, fixed after loading: plain float kernel arguments,
so captured CUDA graphs keep them). torch_ref.py is the reference."""
from __future__ import annotations

import functools

import torch

from tllm.attention.causal_limits import attend_with_limits
from tllm.attention.interface import NO_KV_SCALES, AttentionBackend, AttentionMetadata, KVCache
from tllm.kernels.triton.context_attention import paged_context_attention
from tllm.kernels.triton.decode_attention import MAX_DECODE_QUERIES, paged_decode_attention
from tllm.kernels.triton.kv_cache import (GEMMA_NORM, LLAMA_NORM, QkNorm, rope_and_write_kv,
                                          write_kv)
from tllm.layers.norm import GemmaRMSNorm, RMSNorm

_MAX_HEAD_DIM = 256


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, causal: bool = True,
                 attention_chunk_size: int | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window,
                         logits_soft_cap, causal, attention_chunk_size)
        # A non-causal window (ModernBERT's local layers, both sides) is not in the
        # kernels: such a layer attends on the torch path, which has it.
        self._windowed_encoder = None
        if not causal and sliding_window is not None:
            from tllm.attention.torch_ref import TorchAttentionBackend
            self._windowed_encoder = TorchAttentionBackend(
                num_heads, num_kv_heads, head_dim, scale, sliding_window, logits_soft_cap,
                causal=False)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        if not 0 < head_dim <= _MAX_HEAD_DIM:
            raise ValueError(f"triton attention supports head_dim up to {_MAX_HEAD_DIM}, "
                             f"got {head_dim}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata,
                kv_scales: tuple[float, float] = NO_KV_SCALES,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if metadata.capture is not None:  # piecewise capture: runs between the pieces
            return metadata.capture.defer(self.forward, q, k, v, kv_cache, metadata,
                                          kv_scales, sinks)
        if self._windowed_encoder is not None:
            return self._windowed_encoder.forward(q, k, v, kv_cache, metadata, kv_scales)
        scales = _cache_scales(kv_cache, kv_scales)
        if torch.compiler.is_compiling():
            return self._compiled(q, k, v, kv_cache, metadata, None, scales, sinks)
        write_kv(k, v, kv_cache[0], kv_cache[1], metadata.slot_mapping, *scales)
        return self._attend(q, kv_cache, metadata, scales, sinks)

    def forward_with_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          kv_cache: KVCache, metadata: AttentionMetadata, rotary,
                          kv_scales: tuple[float, float] = NO_KV_SCALES,
                          sinks: torch.Tensor | None = None,
                          qk_norm: tuple | None = None) -> torch.Tensor:
        """One kernel normalises q and k per head (`qk_norm`, where the norms are RMSNorm
        or GemmaRMSNorm modules), rotates them and writes k and v into the cache (a rotary
        that covers only part of each head, as GPT-NeoX's, rotates first and writes after)."""
        if metadata.capture is not None:  # piecewise capture: runs between the pieces
            return metadata.capture.defer(self.forward_with_rope, q, k, v, kv_cache, metadata,
                                          rotary, kv_scales, sinks, qk_norm)
        partial = getattr(rotary, "rotary_dim", self.head_dim) != self.head_dim
        compiling = torch.compiler.is_compiling()
        # (not traced: the compiled path's custom op takes no norms, and the cache lookup
        # would break Dynamo's graph)
        fused_norm = None if compiling or partial else fusable_qk_norm(qk_norm, q.dtype)
        if qk_norm is not None and fused_norm is None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        if partial:
            return super().forward_with_rope(q, k, v, kv_cache, metadata, rotary, kv_scales,
                                             sinks)
        scales = _cache_scales(kv_cache, kv_scales)
        if compiling:
            return self._compiled(q, k, v, kv_cache, metadata, rotary, scales, sinks)
        q = rope_and_write_kv(metadata.positions, q, k, v, rotary.cos, rotary.sin,
                              kv_cache[0], kv_cache[1], metadata.slot_mapping,
                              k_scale=scales[0], v_scale=scales[1], qk_norm=fused_norm)
        return self._attend(q, kv_cache, metadata, scales, sinks)

    def _compiled(self, q, k, v, kv_cache: KVCache, metadata: AttentionMetadata, rotary,
                  scales: tuple[float, float], sinks: torch.Tensor | None) -> torch.Tensor:
        """Under torch.compile (decode graphs): the kernels as opaque custom ops, which
        Inductor keeps whole (tracing their Triton launchers fails on their specialization
        hints); a decode step has short queries only."""
        from tllm.kernels import custom_ops
        if metadata.max_query_len > MAX_DECODE_QUERIES:
            raise ValueError("compiled attention serves decode and verify steps only")
        k_cache, v_cache = kv_cache
        if rotary is None:
            custom_ops.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping, *scales)
        else:
            q = custom_ops.rope_and_write_kv(metadata.positions, q, k, v, rotary.cos,
                                             rotary.sin, k_cache, v_cache,
                                             metadata.slot_mapping, *scales)
        return custom_ops.paged_decode_attention(
            q, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc,
            metadata.seq_lens, metadata.max_seq_len, self.scale, metadata.max_query_len,
            self.sliding_window, scales[0], scales[1], self.logits_soft_cap, sinks,
            self.attention_chunk_size)

    def _attend(self, q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                scales: tuple[float, float], sinks: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty_like(q)
        if metadata.num_tokens == 0:
            return out
        if metadata.causal_limits is not None:  # images attending within themselves
            return attend_with_limits(q, kv_cache, metadata, self.scale, self.sliding_window,
                                      scales, self.logits_soft_cap, sinks)
        tables, starts, seq_lens = (metadata.block_tables, metadata.query_start_loc,
                                    metadata.seq_lens)
        if not self.causal:  # (the decode kernel masks causally)
            return self._context(q, kv_cache, tables, starts, seq_lens,
                                 metadata.max_query_len, out, scales, sinks)
        if metadata.max_query_len <= MAX_DECODE_QUERIES:
            return self._decode(q, kv_cache, tables, starts, seq_lens, metadata.max_seq_len,
                                metadata.max_query_len, out, scales, sinks)
        split = metadata.decode_prefix()
        if split is None:
            return self._context(q, kv_cache, tables, starts, seq_lens,
                                 metadata.max_query_len, out, scales, sinks)
        # A mixed step: the context kernel would give each decode a tile of BLOCK_M query
        # rows (one used), the decode kernel splits its context over the SMs instead.
        d = split.num_seqs
        self._decode(q[:d], kv_cache, tables[:d], starts[:d + 1], seq_lens[:d],
                     split.max_seq_len, 1, out[:d], scales, sinks)
        self._context(q[d:], kv_cache, tables[d:], split.rest_query_start_loc, seq_lens[d:],
                      split.rest_max_query_len, out[d:], scales, sinks)
        return out

    def _decode(self, q, kv_cache, tables, starts, seq_lens, max_seq_len, max_query_len, out,
                scales, sinks):
        return paged_decode_attention(q, *kv_cache, tables, starts, seq_lens,
                                      max_seq_len=max_seq_len, scale=self.scale,
                                      max_query_len=max_query_len,
                                      sliding_window=self.sliding_window, out=out,
                                      k_scale=scales[0], v_scale=scales[1],
                                      logits_soft_cap=self.logits_soft_cap, sinks=sinks,
                                      attention_chunk_size=self.attention_chunk_size)

    def _context(self, q, kv_cache, tables, starts, seq_lens, max_query_len, out, scales,
                 sinks):
        return paged_context_attention(q, *kv_cache, tables, starts, seq_lens,
                                       max_query_len=max_query_len, scale=self.scale,
                                       sliding_window=self.sliding_window, out=out,
                                       k_scale=scales[0], v_scale=scales[1],
                                       logits_soft_cap=self.logits_soft_cap, sinks=sinks,
                                       causal=self.causal,
                                       attention_chunk_size=self.attention_chunk_size)


def _cache_scales(kv_cache: KVCache, kv_scales: tuple[float, float]) -> tuple[float, float]:
    """The scales apply to an fp8 cache only (as in the torch backend)."""
    if kv_cache[0].dtype != torch.float8_e4m3fn:
        return NO_KV_SCALES
    return float(kv_scales[0]), float(kv_scales[1])


def fusable_qk_norm(qk_norm: tuple | None, dtype: torch.dtype) -> QkNorm | None:
    """The kernel's form of (q_norm, k_norm) when both are plain RMSNorm (or both
    GemmaRMSNorm) modules of one eps with weights in the activations' dtype (the modules'
    output dtype); else None (the modules run unfused). Made once per layer and weights:
    an eager step asks every layer."""
    if qk_norm is None:
        return None
    q_norm, k_norm = qk_norm
    return _fusable(q_norm, k_norm, q_norm.weight, k_norm.weight, dtype)


@functools.lru_cache(maxsize=1024)
def _fusable(q_norm, k_norm, q_weight, k_weight, dtype) -> QkNorm | None:
    kinds = {RMSNorm: LLAMA_NORM, GemmaRMSNorm: GEMMA_NORM}
    kind = kinds.get(type(q_norm))
    if (kind is None or type(k_norm) is not type(q_norm) or q_norm.eps != k_norm.eps
            or q_weight.dtype != dtype or k_weight.dtype != dtype):
        return None
    return QkNorm(q_weight, k_weight, q_norm.eps, kind)
