"""Attention in plain PyTorch over the paged cache: the CPU path and the reference for the
Triton kernels.

`paged_attention_batched` (what the backend runs) attends the whole batch in a few SDPA calls:
sequences are grouped by shape, each group's blocks are gathered with one index_select and
its queries padded to the group's longest, with a mask for per-sequence lengths, causality
and sliding windows. `paged_attention_ref` (the per-sequence loop it replaced) stays as the
reference the batched path is tested against. Soft-capped scores (Gemma 2) and attention sinks
(GPT-OSS), which SDPA cannot compute, take `soft_capped_attention` with the same masks; the
rest stays on SDPA."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tllm.attention.causal_limits import attend_with_limits
from tllm.attention.interface import NO_KV_SCALES, AttentionBackend, AttentionMetadata, KVCache
from tllm.kernels.paged import (batched_causal_mask, causal_mask, from_cache, gather_blocks,
                                gather_kv, soft_capped_attention, write_kv_cache)


# torch >= 2.5 broadcasts kv heads itself; older versions need them repeated.
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)

# Cost model for grouping sequences, in microseconds, roughly as measured on a 2-core VM
# (benchmarks/cpu_attention.py): a group costs one call (gather, mask, SDPA, scatter) plus,
# per sequence, its padded keys (bytes gathered, then read) and its padded query-key pairs
# (flops). A sequence joins a group when the padding it brings costs less than a call of
# its own. Decode steps were insensitive to _CALL_US from 30 to 1000.
_CALL_US = 60.0
_KEY_BYTE_US = 1 / 10000.0   # ~10 GB/s for gather + read
_PAIR_FLOP_US = 1 / 50000.0  # ~50 GFLOP/s (flash SDPA, fp32)


def _expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """[seq, kv_heads, dim] -> [heads or kv_heads, seq, dim] for SDPA."""
    x = x.transpose(0, 1)
    return x if _SDPA_GQA or group == 1 else x.repeat_interleave(group, dim=0)


def paged_attention_ref(q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                        scale: float, sliding_window: int | None = None,
                        kv_scales: tuple[float, float] = NO_KV_SCALES,
                        logits_soft_cap: float | None = None,
                        sinks: torch.Tensor | None = None,
                        chunk_size: int | None = None) -> torch.Tensor:
    """Attention of every query token over its sequence's cached context, one sequence at a
    time (the reference for the batched path). `sinks`: [num_heads] logits in each head's
    softmax denominator; `chunk_size`: chunked local attention."""
    out = torch.empty_like(q)
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
        k, v = gather_kv(kv_cache, metadata.block_tables[i], seq_len, metadata.tokens_per_block)
        qi = q[start:start + query_len].transpose(0, 1)          # [heads, q, d]
        k, v = from_cache(k, kv_scales[0], q.dtype), from_cache(v, kv_scales[1], q.dtype)
        o = _attend_sequence(qi, k, v, scale, sliding_window, logits_soft_cap, sinks,
                             chunk_size)
        out[start:start + query_len] = o.transpose(0, 1)
        start += query_len
    return out


def _attend_sequence(qi: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     sliding_window: int | None,
                     logits_soft_cap: float | None,
                     sinks: torch.Tensor | None = None,
                     chunk_size: int | None = None) -> torch.Tensor:
    """One sequence's queries [heads, q, d] (the last q of its positions) over its keys and
    values [seq, kv_heads, d]."""
    query_len, seq_len = qi.shape[1], k.shape[0]
    if logits_soft_cap is not None or sinks is not None:
        mask = causal_mask(query_len, seq_len, sliding_window, qi.device, chunk_size)
        return soft_capped_attention(qi, k.transpose(0, 1), v.transpose(0, 1), mask, scale,
                                     logits_soft_cap,
                                     None if sinks is None else sinks.view(-1, 1, 1))
    group = qi.shape[0] // k.shape[1]
    ki, vi = _expand_kv(k, group), _expand_kv(v, group)
    gqa = {"enable_gqa": True} if _SDPA_GQA and group > 1 else {}
    window_matters = (sliding_window is not None and sliding_window < seq_len
                      or chunk_size is not None and chunk_size < seq_len)
    if not window_matters and query_len in (1, seq_len):  # no mask, or a plain causal one
        return F.scaled_dot_product_attention(qi, ki, vi, is_causal=query_len > 1,
                                              scale=scale, **gqa)
    mask = causal_mask(query_len, seq_len, sliding_window, qi.device, chunk_size)
    return F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, **gqa)


@dataclass
class AttentionGroup:
    """Sequences attended by one SDPA call, padded to the group's longest query and span."""

    num_seqs: int
    max_query_len: int
    num_keys: int                     # key columns per sequence: whole blocks
    blocks: torch.Tensor              # [num_seqs * num_keys // tokens_per_block], seq-major
    q_rows: torch.Tensor | None       # [num_seqs * max_query_len] rows of q; None: q as is
    out_rows: torch.Tensor | None     # output rows the group's real queries fill; None: all
    real_rows: torch.Tensor | None    # which padded rows are real queries; None: all
    mask: torch.Tensor | None         # additive, [num_seqs, 1, 1 | max_query_len, num_keys]
    is_causal: bool                   # fresh prefills: SDPA's own causal mask is exact
    # gathered key rows past each sequence's end, zeroed after the gather: slots never
    # written (or left by a freed request) may hold NaN or inf, and a masked-out key still
    # enters P @ V as 0 * value; None: no such rows
    pad_keys: torch.Tensor | None = None


@dataclass
class _Member:
    index: int
    query_len: int
    seq_len: int
    first_block: int  # the first block any of its queries attends (sliding windows skip some)
    num_blocks: int


def plan_attention(metadata: AttentionMetadata, sliding_window: int | None, dtype: torch.dtype,
                   kv_bytes_per_token: int, num_heads: int, head_dim: int,
                   call_us: float = _CALL_US, causal: bool = True,
                   chunk_size: int | None = None) -> list[AttentionGroup]:
    """Groups of this step's sequences and each group's gather indices and mask: the same
    for every layer of the step. kv_bytes_per_token: K and V of one token, all kv heads;
    call_us: what a call costs against padding (inf: one padded call for the whole step,
    0: a call per distinct shape); causal False: each query sees its sequence's every key;
    chunk_size: chunked local attention (Llama 4)."""
    bs = metadata.tokens_per_block
    members = []
    for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu,
                                                 metadata.seq_lens_cpu)):
        first_key = 0 if sliding_window is None else max(
            0, seq_len - query_len - sliding_window + 1)
        if chunk_size is not None:  # the first query's chunk starts here
            first_key = max(first_key, (seq_len - query_len) // chunk_size * chunk_size)
        first_block = first_key // bs
        members.append(_Member(i, query_len, seq_len, first_block,
                               -(-seq_len // bs) - first_block))
    key_us = bs * kv_bytes_per_token * _KEY_BYTE_US
    pair_us = bs * num_heads * head_dim * 4 * _PAIR_FLOP_US
    starts = [0]
    for query_len in metadata.query_lens_cpu:
        starts.append(starts[-1] + query_len)
    # in batch order within a group, so a group of the whole batch needs no row indexing
    return [_build_group(sorted(g, key=lambda m: m.index), metadata, starts, sliding_window,
                         dtype, causal, chunk_size)
            for g in _partition(members, key_us, pair_us, call_us)]


def _partition(members: list[_Member], key_us: float, pair_us: float,
               call_us: float) -> list[list[_Member]]:
    """Largest first; a sequence joins the open group while padding it there costs less than
    a call of its own (a greedy choice: one pass over the sorted sequences)."""
    def cost(query_len: int, num_blocks: int) -> float:  # one sequence, padded to this shape
        return num_blocks * (key_us + pair_us * query_len)

    order = sorted(members, key=lambda m: (m.query_len, m.num_blocks), reverse=True)
    groups: list[list[_Member]] = []
    max_q = max_b = 0
    for m in order:
        if groups:
            q, b = max(max_q, m.query_len), max(max_b, m.num_blocks)
            padded = cost(q, b) * (len(groups[-1]) + 1) - cost(max_q, max_b) * len(groups[-1])
            if padded <= call_us + cost(m.query_len, m.num_blocks):
                groups[-1].append(m)
                max_q, max_b = q, b
                continue
        groups.append([m])
        max_q, max_b = m.query_len, m.num_blocks
    return groups


def _build_group(members: list[_Member], metadata: AttentionMetadata, starts: list[int],
                 sliding_window: int | None, dtype: torch.dtype,
                 causal: bool = True, chunk_size: int | None = None) -> AttentionGroup:
    bs, device = metadata.tokens_per_block, metadata.block_tables.device
    n = len(members)
    max_q = max(m.query_len for m in members)
    num_blocks = max(m.num_blocks for m in members)
    num_keys = num_blocks * bs
    index = [m.index for m in members]
    in_order = index == list(range(metadata.num_seqs))

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    # block columns past a table's end are clamped onto its last entry; the mask hides them
    table = metadata.block_tables
    cols = tensor([m.first_block for m in members])[:, None] + torch.arange(num_blocks,
                                                                            device=device)
    rows = tensor(index)
    blocks = table[rows[:, None], cols.clamp_(max=table.shape[1] - 1)].flatten().long()

    q_rows = [starts[m.index] + min(i, m.query_len - 1) for m in members for i in range(max_q)]
    real = [b * max_q + i for b, m in enumerate(members) for i in range(m.query_len)]
    out_rows = [starts[m.index] + i for m in members for i in range(m.query_len)]
    all_real = len(real) == n * max_q
    fresh = all(m.query_len == m.seq_len for m in members)
    window_cuts = any(limit is not None and m.seq_len > limit
                      for limit in (sliding_window, chunk_size) for m in members)
    is_causal = causal and max_q > 1 and fresh and not window_cuts
    mask = None
    needs_mask = window_cuts or any(m.seq_len != num_keys for m in members)
    if not is_causal and (needs_mask or (causal and max_q > 1)):
        seq_lens = tensor([m.seq_len for m in members])
        if causal:
            allowed = batched_causal_mask(
                tensor([m.query_len for m in members]), seq_lens,
                tensor([m.first_block * bs for m in members]), max_q, num_keys,
                sliding_window, chunk_size)
        else:  # every key of the sequence, or those within the window either side
            allowed = _bidirectional_mask(
                tensor([m.query_len for m in members]), seq_lens,
                tensor([m.first_block * bs for m in members]), max_q, num_keys,
                sliding_window)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask = mask.masked_fill_(~allowed, float("-inf"))[:, None]
    whole = in_order and all_real and len(out_rows) == metadata.num_tokens
    return AttentionGroup(
        num_seqs=n, max_query_len=max_q, num_keys=num_keys, blocks=blocks,
        q_rows=None if whole else tensor(q_rows), out_rows=None if whole else tensor(out_rows),
        real_rows=None if all_real else tensor(real), mask=mask, is_causal=is_causal,
        pad_keys=_pad_keys([m.seq_len - m.first_block * bs for m in members], num_keys,
                           tensor))


def _bidirectional_mask(query_lens: torch.Tensor, seq_lens: torch.Tensor,
                        first_keys: torch.Tensor, max_query_len: int, num_keys: int,
                        sliding_window: int | None) -> torch.Tensor:
    """[n, max_query_len, num_keys] bool for a non-causal layer: the keys before seq_len,
    within `sliding_window` positions of the query either side (|q - k| < window)."""
    device = seq_lens.device
    k_pos = first_keys[:, None] + torch.arange(num_keys, device=device)
    allowed = (k_pos < seq_lens[:, None])[:, None, :].expand(-1, max_query_len, -1)
    if sliding_window is None:
        return allowed
    rows = torch.arange(max_query_len, device=device)
    q_pos = torch.minimum((seq_lens - query_lens)[:, None] + rows, seq_lens[:, None] - 1)
    return allowed & ((k_pos[:, None, :] - q_pos[:, :, None]).abs() < sliding_window)


def _pad_keys(valid_keys: list[int], num_keys: int, tensor) -> torch.Tensor | None:
    """Flat indices (sequence-major) of the gathered key rows past each sequence's end."""
    if all(v == num_keys for v in valid_keys):
        return None
    valid = tensor(valid_keys)
    past = torch.arange(num_keys, device=valid.device)[None, :] >= valid[:, None]
    return past.flatten().nonzero().flatten()


class GatherBuffers:
    """What the keys and values are gathered into, reused by every layer and step: a fresh
    tensor of 10 MB or more per layer costs page faults (the gather ran ~1.5x slower on a
    2-core VM). Holds the largest gather seen so far, per cache (K, V)."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def take(self, which: int, cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
        shape = (num_blocks, *cache.shape[1:])
        numel = math.prod(shape)
        buf = self._buffers.get(which)
        if (buf is None or buf.numel() < numel or buf.dtype != cache.dtype
                or buf.device != cache.device):
            # a quarter to spare, so a growing context does not reallocate every block
            buf = torch.empty(numel * 5 // 4, dtype=cache.dtype, device=cache.device)
            self._buffers[which] = buf
        return buf[:numel].view(shape)


def attend_group(q: torch.Tensor, kv_cache: KVCache, group: AttentionGroup, scale: float,
                 kv_scales: tuple[float, float] = NO_KV_SCALES,
                 buffers: GatherBuffers | None = None,
                 logits_soft_cap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The group's real query rows, [rows, num_heads, head_dim], in out_rows order."""
    n, max_q, num_keys = group.num_seqs, group.max_query_len, group.num_keys
    num_kv_heads, head_dim = kv_cache[0].shape[2:]
    num_heads = q.shape[1]
    k, v = (from_cache(_gather(cache, group, buffers, which), s, q.dtype)
            .view(n, num_keys, num_kv_heads, head_dim).transpose(1, 2)
            for which, (cache, s) in enumerate(zip(kv_cache, kv_scales)))
    qg = q if group.q_rows is None else q.index_select(0, group.q_rows)
    if max_q == 1:
        # decode: the query heads of one kv head act as its queries, so each kv head's keys
        # and values are read once, with no repeat and no GQA broadcast
        qg = qg.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if logits_soft_cap is not None or sinks is not None:
            o = soft_capped_attention(
                qg, k, v, group.mask, scale, logits_soft_cap,
                None if sinks is None else sinks.view(num_kv_heads, -1, 1))
        else:
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask, scale=scale)
        return o.reshape(n, num_heads, head_dim)
    qg = qg.view(n, max_q, num_heads, head_dim).transpose(1, 2)
    if logits_soft_cap is not None or sinks is not None:
        mask = group.mask
        if group.is_causal:  # SDPA's is_causal: query i sees keys 0..i
            mask = torch.ones(max_q, num_keys, dtype=torch.bool, device=q.device).tril_()
        o = soft_capped_attention(qg, k, v, mask, scale, logits_soft_cap,
                                  None if sinks is None else sinks.view(num_heads, 1, 1))
        return _real_rows(o, group)
    gqa = {}
    if num_heads != num_kv_heads:
        if _SDPA_GQA:
            gqa = {"enable_gqa": True}
        else:
            group_size = num_heads // num_kv_heads
            k, v = k.repeat_interleave(group_size, 1), v.repeat_interleave(group_size, 1)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask,
                                       is_causal=group.is_causal, scale=scale, **gqa)
    return _real_rows(o, group)


def _real_rows(o: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """[n, heads, max_q, d] padded outputs -> the real query rows, [rows, heads, d]."""
    n, num_heads, max_q, head_dim = o.shape
    o = o.transpose(1, 2).reshape(n * max_q, num_heads, head_dim)
    return o if group.real_rows is None else o.index_select(0, group.real_rows)


def _gather(cache: torch.Tensor, group: AttentionGroup, buffers: GatherBuffers | None,
            which: int) -> torch.Tensor:
    """The group's blocks as stored, the rows past each sequence's end zeroed."""
    out = None if buffers is None else buffers.take(which, cache, group.blocks.shape[0])
    gathered = gather_blocks(cache, group.blocks, out)
    if group.pad_keys is not None:  # zero bits are 0.0 in every cache dtype, fp8 included
        rows = gathered.view(torch.uint8) if gathered.element_size() == 1 else gathered
        rows.view(-1, *cache.shape[2:]).index_fill_(0, group.pad_keys, 0)
    return gathered


def paged_attention_batched(q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                            scale: float, sliding_window: int | None = None,
                            kv_scales: tuple[float, float] = NO_KV_SCALES,
                            groups: list[AttentionGroup] | None = None,
                            out: torch.Tensor | None = None,
                            buffers: GatherBuffers | None = None,
                            logits_soft_cap: float | None = None,
                            sinks: torch.Tensor | None = None,
                            chunk_size: int | None = None) -> torch.Tensor:
    """What `paged_attention_ref` computes, for the whole batch in a few calls. `groups`:
    this step's plan (`plan_attention`), reused across layers; `out`: written in place;
    `buffers`: reused for the gathered keys and values; `logits_soft_cap`: scores -> cap *
    tanh(scores / cap) before the mask; `sinks`: [num_heads] softmax-denominator logits;
    `chunk_size`: chunked local attention."""
    if groups is None:
        groups = plan_attention(metadata, sliding_window, q.dtype, _kv_bytes(kv_cache),
                                q.shape[1], q.shape[2], chunk_size=chunk_size)
    if len(groups) == 1 and groups[0].out_rows is None:
        o = attend_group(q, kv_cache, groups[0], scale, kv_scales, buffers, logits_soft_cap,
                         sinks)
        return o if out is None else out.copy_(o)
    out = torch.empty_like(q) if out is None else out
    for group in groups:
        out.index_copy_(0, group.out_rows, attend_group(q, kv_cache, group, scale, kv_scales,
                                                        buffers, logits_soft_cap, sinks))
    return out


def _kv_bytes(kv_cache: KVCache) -> int:
    k = kv_cache[0]
    return 2 * k.shape[2] * k.shape[3] * k.element_size()


_MAX_PLANS = 8  # plans kept: more than the KV cache groups any model has in one step


class TorchAttentionBackend(AttentionBackend):
    """The plain-PyTorch backend: the batched path, its plan built once per step and KV cache
    group (the model shares one backend object across its layers of one kind)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # this step's plans, one per metadata object: layers of several KV cache groups
        # (Gemma 3's five window groups) share this backend and take turns with their views
        self._plans: list[tuple[AttentionMetadata, torch.dtype, list[AttentionGroup]]] = []
        self._buffers = GatherBuffers()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata,
                kv_scales: tuple[float, float] = NO_KV_SCALES,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # an opaque op: the step's lengths stay out of
            return self._as_op(q, k, v, kv_cache, metadata, kv_scales, sinks)  # the graph
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping, kv_scales)
        if metadata.causal_limits is not None:
            return attend_with_limits(q, kv_cache, metadata, self.scale, self.sliding_window,
                                      kv_scales, self.logits_soft_cap, sinks)
        return paged_attention_batched(q, kv_cache, metadata, self.scale, self.sliding_window,
                                       kv_scales, self._groups(q, kv_cache, metadata),
                                       buffers=self._buffers,
                                       logits_soft_cap=self.logits_soft_cap, sinks=sinks)

    def _as_op(self, q, k, v, kv_cache: KVCache, metadata: AttentionMetadata,
               kv_scales: tuple[float, float], sinks: torch.Tensor | None) -> torch.Tensor:
        # registered by tllm.attention.torch_op, which the compiling runner imports
        return torch.ops.tllm.torch_paged_attention(
            q, k, v, kv_cache[0], kv_cache[1], metadata.positions, metadata.slot_mapping,
            metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
            metadata.tokens_per_block, self.scale, self.sliding_window, *kv_scales,
            self.logits_soft_cap, sinks, self.causal, self.attention_chunk_size)

    def _groups(self, q: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> list[AttentionGroup]:
        for plan_metadata, dtype, groups in self._plans:
            if plan_metadata is metadata and dtype == q.dtype:
                return groups
        groups = plan_attention(metadata, self.sliding_window, q.dtype, _kv_bytes(kv_cache),
                                q.shape[1], q.shape[2], causal=self.causal,
                                chunk_size=self.attention_chunk_size)
        if len(self._plans) == _MAX_PLANS:  # the oldest: an earlier step's
            self._plans.pop(0)
        self._plans.append((metadata, q.dtype, groups))
        return groups
