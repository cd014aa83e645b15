"""CUDA graphs for decode steps: the model's forward (and the vocabulary projection) for a
batch of one token per request is captured once per batch size and replayed from static input
buffers, which removes the per-kernel launch cost that dominates small decode batches. A batch
is padded up to the next captured size; padding rows write nothing to the KV cache and their
outputs are dropped."""
from __future__ import annotations

import bisect
import logging

import torch
from torch import nn

from tllm.attention.interface import AttentionMetadata
from tllm.kv_cache.manager import KVCacheManager, cdiv

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class CudaGraphRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCacheManager, batch_sizes: list[int],
                 max_seq_len: int, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_seq_len = max_seq_len
        self.device = device
        max_bs = self.batch_sizes[-1]
        width = cdiv(max_seq_len, kv_cache.tokens_per_block)
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, width, dtype=torch.int32, device=device)
        # KV cache groups 1.. (sliding-window layers) have slots and tables of their own
        self.group_slot_mappings = [torch.full_like(self.slot_mapping, -1)
                                    for _ in range(kv_cache.num_groups - 1)]
        self.group_block_tables = [torch.zeros_like(self.block_tables)
                                   for _ in range(kv_cache.num_groups - 1)]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        # max_seq_len is the static upper bound: the decode kernel sizes its split-K launch
        # from it, and a replay must work for any sequence length.
        metadata = AttentionMetadata(
            positions=self.positions[:batch_size], slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[:batch_size + 1],
            seq_lens=self.seq_lens[:batch_size], block_tables=self.block_tables[:batch_size],
            max_query_len=1, max_seq_len=self.max_seq_len,
            tokens_per_block=self.kv_cache.tokens_per_block,
            query_lens_cpu=[1] * batch_size, seq_lens_cpu=[1] * batch_size)
        if self.group_slot_mappings:
            metadata.add_group_views(self.kv_cache.layer_groups, [
                (slots[:batch_size], tables[:batch_size])
                for slots, tables in zip(self.group_slot_mappings, self.group_block_tables)])
        return metadata

    def _forward(self, batch_size: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:batch_size], self.kv_cache.kv_caches,
                            self._metadata(batch_size))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first, all sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        self.seq_lens.fill_(1)
        for batch_size in reversed(self.batch_sizes):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: compile kernels, settle the allocator
                    self._forward(batch_size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(batch_size)
            self.graphs[batch_size] = (graph, logits)
        self.seq_lens.zero_()
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)

    def can_run(self, num_tokens: int, is_decode_only: bool) -> bool:
        return is_decode_only and num_tokens <= self.max_batch_size

    def run(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Logits [num_tokens, vocab] of a decode step, by graph replay."""
        n = input_ids.shape[0]
        padded = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(metadata.positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.slot_mapping[n:padded].fill_(-1)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.seq_lens[n:padded].fill_(0)
        width = metadata.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(metadata.block_tables)
        for slots, tables, view in zip(self.group_slot_mappings, self.group_block_tables,
                                       metadata.group_views):
            slots[:n].copy_(view.slot_mapping)
            slots[n:padded].fill_(-1)
            tables[:n, :width].copy_(view.block_tables)
        graph, logits = self.graphs[padded]
        graph.replay()
        return logits[:n]
