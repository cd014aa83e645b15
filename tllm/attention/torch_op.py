"""The torch backend's paged attention as a torch custom op
(`torch.ops.tllm.torch_paged_attention`), so that torch.compile traces a CPU decode step
around it (tllm/runner/cpu_compiled.py).

Traced as plain code, the batched path reads the step's host-side lengths (`seq_lens_cpu`),
which Dynamo would bake into the graph as constants: a new compile every step. As an op it
is opaque: the graph passes the step's tensors in, and the op rebuilds the host lists from
them (CPU tensors, so no device sync) and runs the eager batched path, cache write
included. Importing this module registers the op."""
from __future__ import annotations

import threading
from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from tllm.attention.interface import AttentionMetadata
from tllm.attention.torch_ref import (AttentionGroup, GatherBuffers, _kv_bytes,
                                     paged_attention_batched, plan_attention)
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
    options = (sliding_window, q.dtype, _kv_bytes(kv_cache), q.shape[1], q.shape[2], causal,
               chunk_size)
    metadata, groups = _STEP.plan(positions, slot_mapping, query_start_loc, seq_lens,
                                  block_tables, tokens_per_block, options)
    return paged_attention_batched(q, kv_cache, metadata, scale, sliding_window, kv_scales,
                                   groups, buffers=_STEP.buffers,
                                   logits_soft_cap=logits_soft_cap, sinks=sinks)


class _StepPlan(threading.local):
    """The last attention plan and gather buffers, per thread (engines in one process run
    on threads of their own). Every layer of a step asks with the same tensors: the plan is
    built once a step (what the eager backend does per metadata object), and found again
    by comparing the lengths and tables it was built from (a few microseconds)."""

    def __init__(self) -> None:
        self.buffers = GatherBuffers()
        self._inputs: tuple[Tensor, ...] = ()
        self._options: tuple = ()
        self._plan: tuple[AttentionMetadata, list[AttentionGroup]] | None = None

    def plan(self, positions: Tensor, slot_mapping: Tensor, query_start_loc: Tensor,
             seq_lens: Tensor, block_tables: Tensor, tokens_per_block: int,
             options: tuple) -> tuple[AttentionMetadata, list[AttentionGroup]]:
        inputs = (query_start_loc, seq_lens, block_tables)
        if (self._plan is None or options != self._options
                or any(a.shape != b.shape or not torch.equal(a, b)
                       for a, b in zip(inputs, self._inputs))):
            self._plan = _plan(positions, slot_mapping, *inputs, tokens_per_block, options)
            self._inputs = tuple(t.clone() for t in inputs)
            self._options = options
        return self._plan  # its metadata's positions and slots may be an earlier step's:
        # the batched path reads only the groups


def _plan(positions, slot_mapping, query_start_loc, seq_lens, block_tables, tokens_per_block,
          options) -> tuple[AttentionMetadata, list[AttentionGroup]]:
    sliding_window, dtype, kv_bytes, num_heads, head_dim, causal, chunk_size = options
    query_lens = torch.diff(query_start_loc).tolist()
    metadata = AttentionMetadata(
        positions=positions, slot_mapping=slot_mapping, query_start_loc=query_start_loc,
        seq_lens=seq_lens, block_tables=block_tables, max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()), tokens_per_block=tokens_per_block,
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens.tolist())
    return metadata, plan_attention(metadata, sliding_window, dtype, kv_bytes, num_heads,
                                    head_dim, causal=causal, chunk_size=chunk_size)


_STEP = _StepPlan()


@torch_paged_attention.register_fake
def _(q, k, v, k_cache, v_cache, positions, slot_mapping, query_start_loc, seq_lens,
      block_tables, tokens_per_block, scale, sliding_window=None, k_scale=1.0, v_scale=1.0,
      logits_soft_cap=None, sinks=None, causal=True, chunk_size=None) -> Tensor:
    return torch.empty_like(q)
