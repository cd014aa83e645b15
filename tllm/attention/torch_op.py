"""The torch backend's paged attention as a torch custom op (`torch.ops.tllm.torch_paged_attention`),
so that torch.compile traces a CPU decode step around it (tllm/runner/cpu_compiled.py).

Traced as plain code, the batched path reads the step's host-side lengths (`seq_lens_cpu`),
which Dynamo would bake into the graph as constants: a new compile every step. As an op it
is opaque: the graph passes the step's tensors in, and the op rebuilds the host lists from
them (CPU tensors, so no device sync) and runs the eager batched path, cache write
included. Importing this module registers the op."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from tllm.attention.interface import AttentionMetadata
from tllm.attention.torch_ref import paged_attention_batched, plan_attention, _kv_bytes
from tllm.kernels.paged import write_kv_cache


@custom_op("tllm::torch_paged_attention", mutates_args=("k_cache", "v_cache"))
def torch_paged_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                          positions: Tensor, slot_mapping: Tensor, query_start_loc: Tensor,
                          seq_lens: Tensor, block_tables: Tensor, tokens_per_block: int,
                          scale: float, sliding_window: Optional[int] = None,
                          k_scale: float = 1.0, v_scale: float = 1.0,
                          logits_soft_cap: Optional[float] = None,
                          sinks: Optional[Tensor] = None, causal: bool = True,
                          chunk_size: Optional[int] = None) -> Tensor:
    """k and v written into the paged cache, then q attended over it: [T, heads, dim]."""
    kv_cache, kv_scales = (k_cache, v_cache), (k_scale, v_scale)
    write_kv_cache(k, v, kv_cache, slot_mapping, kv_scales)
    query_lens = torch.diff(query_start_loc).tolist()
    metadata = AttentionMetadata(
        positions=positions, slot_mapping=slot_mapping, query_start_loc=query_start_loc,
        seq_lens=seq_lens, block_tables=block_tables, max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()), tokens_per_block=tokens_per_block,
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens.tolist())
    groups = plan_attention(metadata, sliding_window, q.dtype, _kv_bytes(kv_cache),
                            q.shape[1], q.shape[2], causal=causal, chunk_size=chunk_size)
    return paged_attention_batched(q, kv_cache, metadata, scale, sliding_window, kv_scales,
                                   groups, logits_soft_cap=logits_soft_cap, sinks=sinks)


@torch_paged_attention.register_fake
def _(q, k, v, k_cache, v_cache, positions, slot_mapping, query_start_loc, seq_lens,
      block_tables, tokens_per_block, scale, sliding_window=None, k_scale=1.0, v_scale=1.0,
      logits_soft_cap=None, sinks=None, causal=True, chunk_size=None) -> Tensor:
    return torch.empty_like(q)
