"""Batch-invariant attention (deterministic mode): a query token's output is the same bits
whichever step computes it: alone or in a batch, in a prefill chunk of any length, as a
decode, after a prefix reused from the cache.

Keys are cut into chunks of KEY_SPLIT positions aligned to absolute position 0, so a query
meets the same chunks, with the same masked entries, in every layout; the chunks are folded
in position order with an online softmax (a fully masked chunk multiplies by exactly 1 and
adds exactly 0, so a batch padded to longer sequences changes nothing). The products are
float32 batched GEMMs, one matrix per sequence and head, whose query rows are padded to a
multiple of MIN_ROWS (a CPU GEMM row's result changes with other row counts;
tllm.layers.batch_invariant says why); exp
runs on whole rows (`row_tiled`). Sequences of at most MIN_ROWS queries (decodes, short
chunks) are attended together, longer ones together apart from them, so a decode batch is
not padded to a prefill's length. Slower than the grouped SDPA path (torch_ref.py).

On CUDA the step runs as one Triton launch per layer instead
(tllm.kernels.triton.invariant_attention: the same fixed key chunks, per-row bits fixed by
construction); this torch code is its reference and the CPU path."""
from __future__ import annotations

import weakref

import torch

from tllm.attention.interface import NO_KV_SCALES, AttentionBackend, AttentionMetadata, KVCache
from tllm.kernels.paged import from_cache, gather_blocks, is_fp8, write_kv_cache
from tllm.layers.invariant_ops import MIN_ROWS, padded_rows, row_tiled

KEY_SPLIT = 64   # keys per chunk: fixed, so no reduction's order depends on the batch


class BatchInvariantAttentionBackend(AttentionBackend):
    """Sequences in two groups (short and long queries), keys in fixed chunks."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not self.causal:
            raise ValueError("deterministic mode does not cover non-causal (encoder) "
                             "attention yet; load the model with deterministic=False")
        # (metadata, its tile table) of the last step run by the kernel
        self._tile_cache: tuple[weakref.ref, torch.Tensor] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata,
                kv_scales: tuple[float, float] = NO_KV_SCALES,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping, kv_scales)
        if q.is_cuda:
            return self._attend_kernel(q, kv_cache, metadata, kv_scales, sinks)
        return self._attend_torch(q, kv_cache, metadata, kv_scales, sinks)

    def _attend_torch(self, q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                      kv_scales: tuple[float, float],
                      sinks: torch.Tensor | None) -> torch.Tensor:
        """The CPU path, and the kernel's reference."""
        out = torch.empty_like(q)
        query_lens = metadata.query_lens_cpu
        short = [i for i, n in enumerate(query_lens) if n <= MIN_ROWS]
        long = [i for i, n in enumerate(query_lens) if n > MIN_ROWS]
        for members in (short, long):
            if members:
                self._attend_group(q, kv_cache, metadata, members, kv_scales, out, sinks)
        return out

    def _attend_kernel(self, q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                       kv_scales: tuple[float, float],
                       sinks: torch.Tensor | None) -> torch.Tensor:
        """The whole step in one launch (imported here: Triton only where it runs)."""
        from tllm.kernels.triton.invariant_attention import invariant_paged_attention
        # (models with causal_limits, Gemma 3's images, are refused at build: runner/build.py)
        return invariant_paged_attention(
            q, *kv_cache, metadata.block_tables, metadata.query_start_loc, metadata.seq_lens,
            self._tiles(metadata), self.scale, self.sliding_window,
            self.attention_chunk_size, self.logits_soft_cap, sinks,
            *(kv_scales if is_fp8(kv_cache[0]) else NO_KV_SCALES))   # as from_cache does

    def _tiles(self, metadata: AttentionMetadata) -> torch.Tensor:
        """The step's tile table, built once per step (every layer gets the same metadata)."""
        from tllm.kernels.triton.invariant_attention import build_tiles
        if self._tile_cache is not None and self._tile_cache[0]() is metadata:
            return self._tile_cache[1]
        tiles = build_tiles(metadata.query_lens_cpu, metadata.seq_lens_cpu,
                            metadata.block_tables.device)
        self._tile_cache = (weakref.ref(metadata), tiles)
        return tiles

    def _attend_group(self, q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                      members: list[int], kv_scales: tuple[float, float],
                      out: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        starts = _starts(metadata.query_lens_cpu)
        query_lens = [metadata.query_lens_cpu[i] for i in members]
        seq_lens = [metadata.seq_lens_cpu[i] for i in members]
        rows = padded_rows(max(query_lens))
        num_chunks = -(-max(seq_lens) // KEY_SPLIT)
        device = q.device
        # padded query rows repeat the sequence's first query (computed, then dropped)
        q_index = [starts[i] + (r if r < n else 0) for i, n in zip(members, query_lens)
                   for r in range(rows)]
        queries = _heads_first(q.index_select(0, _tensor(q_index, device)).float(),
                               len(members))
        positions = _tensor([s - n + r for s, n in zip(seq_lens, query_lens)
                             for r in range(rows)], device).view(len(members), rows)
        keys, values = (_gathered(cache, scale, metadata, members, seq_lens,
                                  num_chunks * KEY_SPLIT, q.shape[1])
                        for cache, scale in zip(kv_cache, kv_scales))
        result = self._fold_chunks(queries, keys, values, positions, num_chunks, sinks)
        result = result.view(len(members), -1, rows, q.shape[2]).transpose(1, 2)
        real = [b * rows + r for b, n in enumerate(query_lens) for r in range(n)]
        out_index = [starts[i] + r for i, n in zip(members, query_lens) for r in range(n)]
        out.index_copy_(0, _tensor(out_index, device),
                        result.reshape(-1, *q.shape[1:]).index_select(
                            0, _tensor(real, device)).to(q.dtype))

    def _fold_chunks(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     positions: torch.Tensor, num_chunks: int,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Online softmax over the key chunks, in position order. queries [B*H, rows, d],
        keys/values [B*H, chunks * KEY_SPLIT, d], positions [B, rows]; `sinks` [H]: logits
        in each head's denominator (GPT-OSS), added after the last chunk."""
        heads = queries.shape[0] // positions.shape[0]
        best = torch.full(queries.shape[:2], float("-inf"), device=queries.device)
        total = torch.zeros(queries.shape[:2], device=queries.device)
        acc = torch.zeros_like(queries)
        for c in range(num_chunks):
            chunk = slice(c * KEY_SPLIT, (c + 1) * KEY_SPLIT)
            scores = torch.bmm(queries, keys[:, chunk].transpose(1, 2)) * self.scale
            if self.logits_soft_cap is not None:
                cap = self.logits_soft_cap
                scores = _rowwise(torch.tanh, scores / cap) * cap
            allowed = self._allowed(positions, chunk).repeat_interleave(heads, dim=0)
            scores = scores.masked_fill(~allowed, float("-inf"))
            new_best = torch.maximum(best, scores.amax(dim=-1))
            shift = torch.where(new_best == float("-inf"), 0.0, new_best)
            probs = _rowwise(torch.exp, scores - shift[..., None])
            rescale = _rowwise(torch.exp, (best - shift)[..., None])[..., 0]
            total = total * rescale + probs.sum(dim=-1)
            acc = acc * rescale[..., None] + torch.bmm(probs, values[:, chunk])
            best = new_best
        if sinks is not None:
            sink = sinks.float().repeat(positions.shape[0])[:, None]     # [B*H, 1]
            total = total + _rowwise(torch.exp, (sink - best)[..., None])[..., 0]
        return acc / total[..., None]

    def _allowed(self, positions: torch.Tensor, chunk: slice) -> torch.Tensor:
        """[B, rows, KEY_SPLIT] bool: which keys of the chunk each query sees."""
        key_positions = torch.arange(chunk.start, chunk.stop, device=positions.device)
        allowed = key_positions[None, None, :] <= positions[..., None]
        if self.sliding_window is not None:
            allowed &= key_positions[None, None, :] > positions[..., None] - self.sliding_window
        if self.attention_chunk_size is not None:   # Llama 4's chunked local layers
            size = self.attention_chunk_size
            allowed &= key_positions[None, None, :] // size == positions[..., None] // size
        return allowed


def _gathered(cache: torch.Tensor, scale: float, metadata: AttentionMetadata,
              members: list[int], seq_lens: list[int], length: int,
              num_heads: int) -> torch.Tensor:
    """The members' keys (or values) as float32 [B * heads, length, d]: kv heads repeated
    for their query heads, zeros past each sequence's end (a slot never written may hold
    NaN, and a masked key still meets its value as 0 * value)."""
    bs, device = metadata.tokens_per_block, cache.device
    num_blocks = -(-length // bs)
    table = metadata.block_tables
    cols = torch.arange(num_blocks, device=device).clamp_(max=table.shape[1] - 1)
    blocks = table[_tensor(members, device)[:, None], cols[None, :]].flatten().long()
    x = from_cache(gather_blocks(cache, blocks), scale, torch.float32)
    x = x.view(len(members), num_blocks * bs, *cache.shape[2:])[:, :length]
    past = (torch.arange(length, device=device)[None, :]
            >= _tensor(seq_lens, device)[:, None])
    x = x.masked_fill(past[..., None, None], 0.0)
    x = x.transpose(1, 2).repeat_interleave(num_heads // cache.shape[2], dim=1)
    return x.reshape(-1, length, cache.shape[3])


def _heads_first(x: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[B * rows, heads, d] -> [B * heads, rows, d]."""
    rows_total, heads, dim = x.shape
    return (x.view(num_seqs, rows_total // num_seqs, heads, dim).transpose(1, 2)
            .reshape(num_seqs * heads, -1, dim))


def _starts(query_lens: list[int]) -> list[int]:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return starts


def _tensor(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    return row_tiled(fn, x.reshape(-1, x.shape[-1])).view(x.shape)
