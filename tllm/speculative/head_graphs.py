"""CUDA graphs of a draft head's forward (EAGLE-3's one-layer head, DeepSeek's MTP module).

A head drafts token by token: after each verify step a catch-up forward over the tokens the
target just confirmed (1 .. max_draft_len + 1 a request), then one-token chain steps. Eagerly
each is a few dozen small launches plus the host's module calls, which at batch 1 cost more
than the target's replayed verify step. Here the head's forward, its LM head on each
request's last row and that row's pre-norm state are captured per batch size at
`query_len` = max_draft_len + 1 tokens a request (the verify graphs' layout: the rows of all
requests packed at the front, `query_start_loc` rewritten before each replay; padding rows
write no KV, padding requests have no keys), in a memory pool of their own. A forward with
a longer feed (the first catch-up over a whole prompt) or more requests runs eagerly.
"""
from __future__ import annotations

import bisect
import logging

import torch
from torch import nn

from tllm.attention.interface import AttentionMetadata
from tllm.device import capture_cuda_graph
from tllm.kv_cache.manager import KVCacheManager, cdiv

logger = logging.getLogger(__name__)


class HeadGraphs:
    def __init__(self, head: nn.Module, kv_cache: KVCacheManager, batch_sizes: list[int],
                 query_len: int, max_seq_len: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.head, self.kv_cache = head, kv_cache
        self.batch_sizes = sorted(set(batch_sizes))
        self.query_len, self.max_seq_len = query_len, max_seq_len
        self.device = device
        max_bs = self.batch_sizes[-1]
        max_tokens = max_bs * query_len
        self.width = cdiv(max_seq_len, kv_cache.tokens_per_block)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.hidden = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, self.width, dtype=torch.int32, device=device)
        self.last_rows = torch.zeros(max_bs, dtype=torch.long, device=device)
        # batch size -> (graph, logits of each request's last row, that row's pre-norm state)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = None

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        n = batch_size * self.query_len
        return AttentionMetadata(
            positions=self.positions[:n], slot_mapping=self.slot_mapping[:n],
            query_start_loc=self.query_start_loc[:batch_size + 1],
            seq_lens=self.seq_lens[:batch_size], block_tables=self.block_tables[:batch_size],
            max_query_len=self.query_len, max_seq_len=self.max_seq_len,
            tokens_per_block=self.kv_cache.tokens_per_block,
            query_lens_cpu=[self.query_len] * batch_size,
            seq_lens_cpu=[self.query_len] * batch_size)

    def _forward(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = batch_size * self.query_len
        normed, prenorm = self.head(self.input_ids[:n], self.hidden[:n],
                                    self.kv_cache.kv_caches, self._metadata(batch_size))
        rows = self.last_rows[:batch_size]
        return self.head.compute_logits(normed[rows]), prenorm[rows]

    @torch.inference_mode()
    def capture(self) -> None:
        """Every batch size, largest first, in one pool of their own (slots -1: the warm-ups
        and the capture write no KV)."""
        q = self.query_len
        self.seq_lens.fill_(q)
        self.query_start_loc.copy_(torch.arange(0, q * len(self.query_start_loc), q,
                                                dtype=torch.int32, device=self.device))
        self.last_rows.copy_(torch.arange(q - 1, q * len(self.last_rows), q,
                                          device=self.device))
        pool = self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for batch_size in reversed(self.batch_sizes):
            graph, (logits, prenorm) = capture_cuda_graph(
                lambda size=batch_size: self._forward(size), pool, stream)
            self.graphs[batch_size] = (graph, logits, prenorm)
        self.seq_lens.zero_()
        torch.cuda.synchronize(self.device)
        logger.info("captured draft-head CUDA graphs for batch sizes %s (%d tokens a request)",
                    self.batch_sizes, q)

    def release(self) -> None:
        """Drop the graphs (sleep: they name the released draft KV cache and weights)."""
        self.graphs.clear()
        self.pool = None

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return (bool(self.graphs) and metadata.num_seqs <= self.batch_sizes[-1]
                and metadata.max_query_len <= self.query_len
                and metadata.block_tables.shape[1] <= self.width)

    def run(self, input_ids: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata,
            last_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, draft vocab], pre-norm states [B, H]) of each request's last row:
        views of the graph's outputs, which the next replay rewrites."""
        n, num_seqs = input_ids.shape[0], metadata.num_seqs
        padded = self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]
        rows = padded * self.query_len
        self.input_ids[:n].copy_(input_ids)
        self.hidden[:n].copy_(hidden)
        self.positions[:n].copy_(metadata.positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.slot_mapping[n:rows].fill_(-1)
        self.seq_lens[:num_seqs].copy_(metadata.seq_lens)
        self.seq_lens[num_seqs:padded].fill_(0)
        self.query_start_loc[:num_seqs + 1].copy_(metadata.query_start_loc)
        self.query_start_loc[num_seqs + 1:padded + 1].fill_(n)
        width = metadata.block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(metadata.block_tables)
        self.last_rows[:num_seqs].copy_(last_rows)
        self.last_rows[num_seqs:padded].fill_(0)
        graph, logits, prenorm = self.graphs[padded]
        graph.replay()
        return logits[:num_seqs], prenorm[:num_seqs]


def build_head_graphs(head: nn.Module, kv_cache: KVCacheManager, target_parts,
                      max_draft_len: int, hidden_size: int) -> HeadGraphs | None:
    """The head's graphs where the target runs CUDA graphs (the verify graphs' batch sizes);
    None on the CPU, without graphs, or when the capture fails (the head then runs
    eagerly, as it would anyway)."""
    # the target's CUDA graph runner (a CPU build has none, or a compiled CPU decode step)
    target_graphs = getattr(target_parts, "graphs", None)
    if getattr(target_graphs, "verify_batch_sizes", None) is None:
        return None
    from tllm.kernels.triton.decode_attention import MAX_DECODE_QUERIES
    query_len = max_draft_len + 1
    sizes = target_graphs.verify_batch_sizes or target_graphs.batch_sizes[:1]
    if query_len > MAX_DECODE_QUERIES:
        return None
    graphs = HeadGraphs(head, kv_cache, sizes, query_len,
                        target_parts.max_seq_len + query_len, hidden_size, target_parts.dtype,
                        target_parts.device)
    try:
        graphs.capture()
    except RuntimeError as exc:
        torch.cuda.synchronize(target_parts.device)
        logger.warning("draft-head CUDA graphs off (%s)", str(exc).splitlines()[0][:200])
        return None
    finally:
        torch.cuda.empty_cache()
    return graphs
