"""CUDA graphs for decode and verify steps: the model's forward (and the vocabulary
projection) is captured once per batch size and replayed from static input buffers, which
removes the per-kernel launch cost that dominates small batches.

Decode graphs take one token per request. Verify graphs (speculative decoding) take up to
`verify_query_len` = 1 + max_draft_len tokens per request: the tokens of all requests lie
packed at the front of a buffer of batch_size x verify_query_len rows, and
`query_start_loc` (a static buffer, rewritten before each replay) says where each request's
start. The decode attention kernel's grid depends only on the batch size and the static
maximum sequence length, so one capture serves any mix of query lengths 1..verify_query_len
(requests with fewer drafts, or none). A batch is padded up to the next captured size;
padding rows (slot -1) write nothing to the KV cache, padding requests have sequence length 0
and no queries, and their outputs are dropped. A vision-language model's decode steps replay
too (they carry no image tokens), with its M-RoPE positions in a static buffer of their own
(as its piecewise graphs have for prompt steps without image tokens).

A drafter that reads the target's hidden states (EAGLE-3, MTP) has the runner hook the layers
it names; `collect_hidden` then puts their concatenation inside every graph, and a replay
leaves it in `replayed_hidden` beside the logits."""
from __future__ import annotations

import bisect
import logging
from typing import Callable

import torch
from torch import nn

from tllm.attention.interface import AttentionMetadata
from tllm.device import capture_cuda_graph
from tllm.kv_cache.manager import KVCacheManager, cdiv
from tllm.runner.piecewise import copy_mrope_positions

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256,
                       320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)
# Speculation pays at small batches; each verify graph keeps logits for batch x (1 + k)
# rows (1,280 x 128K at 256 x 5), so larger verify batches run eagerly.
MAX_VERIFY_BATCH_SIZE = 64


# Query lengths of the eager warm-up steps (warm_up_eager): the Triton attention kernels pick
# their tiles by the longest query (the decode kernel's rows: GQA group x queries, up to 8
# queries; the context kernel's: <= 16, <= 64, longer), each pick a compile of its own.
WARM_UP_QUERY_LENS = (2, 4, 8, 16, 64, 128)


class CudaGraphRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCacheManager, batch_sizes: list[int],
                 max_seq_len: int, device: torch.device,
                 verify_query_len: int | None = None, uses_mrope: bool = False) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_seq_len = max_seq_len
        self.device = device
        # None or 1: no verify graphs (no drafter, or drafts too long for the decode kernel)
        self.verify_query_len = verify_query_len if (verify_query_len or 1) > 1 else None
        self.verify_batch_sizes = ([s for s in self.batch_sizes if s <= MAX_VERIFY_BATCH_SIZE]
                                   or self.batch_sizes[:1]) if self.verify_query_len else []
        max_bs = self.batch_sizes[-1]
        max_tokens = max(max_bs, max(self.verify_batch_sizes, default=0)
                         * (self.verify_query_len or 1))
        width = cdiv(max_seq_len, kv_cache.tokens_per_block)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.verify_query_start_loc = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, width, dtype=torch.int32, device=device)
        # KV cache groups 1.. (sliding-window layers) have slots and tables of their own
        self.group_slot_mappings = [torch.full_like(self.slot_mapping, -1)
                                    for _ in range(kv_cache.num_groups - 1)]
        self.group_block_tables = [torch.zeros_like(self.block_tables)
                                   for _ in range(kv_cache.num_groups - 1)]
        # each request's state slot (hybrid models' mixers read it); padding rows take the
        # state cache's scratch row (bind_state_cache)
        self.request_slots = torch.zeros(max_bs, dtype=torch.long, device=device)
        # an M-RoPE model (Qwen2.5-VL): each token's three positions, shifted past an image
        self.mrope_positions = (torch.zeros(3, max_tokens, dtype=torch.long, device=device)
                                if uses_mrope else None)
        self.state_cache = None
        # batch size -> (graph, its logits, its hidden states when collected)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor,
                                     torch.Tensor | None]] = {}
        self.verify_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor,
                                            torch.Tensor | None]] = {}
        self.pool = None  # the graphs' memory pool, once captured
        # a drafter's hidden states (collect_hidden_states): made inside each graph
        self.collect_hidden: Callable[[], torch.Tensor] | None = None
        self.replayed_hidden: torch.Tensor | None = None
        # forward hooks run in the eager model's layers; a torch.compile'd one may not
        self.hooks_run = True

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def bind_state_cache(self, state_cache) -> None:
        """A hybrid model's state cache: padding rows update its scratch row, and a
        replay's new requests get their slots zeroed first (StateCache.reset_new)."""
        self.state_cache = state_cache
        self.request_slots.fill_(state_cache.pad_slot)

    @property
    def _pad_slot(self) -> int:
        return 0 if self.state_cache is None else self.state_cache.pad_slot

    def _metadata(self, batch_size: int, query_len: int,
                  eager: bool = False) -> AttentionMetadata:
        # max_seq_len is the static upper bound: the decode kernel sizes its split-K launch
        # from it, and a replay must work for any sequence length. max_query_len sizes the
        # kernel's tile rows: the longest query a replay may bring. An eager step (the
        # warm-up) has the real lengths, as the engine's eager steps do.
        num_tokens = batch_size * query_len
        query_start_loc = (self.query_start_loc if query_len == 1
                           else self.verify_query_start_loc)
        if eager:
            query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int32,
                                           device=self.device)
        metadata = AttentionMetadata(
            positions=self.positions[:num_tokens], slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc=query_start_loc[:batch_size + 1],
            seq_lens=self.seq_lens[:batch_size], block_tables=self.block_tables[:batch_size],
            max_query_len=query_len, max_seq_len=query_len if eager else self.max_seq_len,
            tokens_per_block=self.kv_cache.tokens_per_block,
            query_lens_cpu=[query_len] * batch_size, seq_lens_cpu=[query_len] * batch_size,
            # a captured step reads the slots on the device only; an eager warm-up's prompt
            # segments are planned on the host
            request_slots_cpu=[self._pad_slot] * batch_size if eager else [],
            request_slots=self.request_slots[:batch_size],
            mrope_positions=(None if self.mrope_positions is None
                             else self.mrope_positions[:, :num_tokens]))
        if self.group_slot_mappings:
            metadata.add_group_views(self.kv_cache.layer_groups, [
                (slots[:num_tokens], tables[:batch_size])
                for slots, tables in zip(self.group_slot_mappings, self.group_block_tables)])
        return metadata

    def _forward(self, batch_size: int, query_len: int) -> torch.Tensor:
        num_tokens = batch_size * query_len
        hidden = self.model(self.input_ids[:num_tokens], self.kv_cache.kv_caches,
                            self._metadata(batch_size, query_len))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def warm_up_eager(self, model: nn.Module) -> None:
        """Run one eager step per tile choice of the attention kernels (WARM_UP_QUERY_LENS,
        one sequence each) so that the first prefills and mixed steps do not stall the
        running decodes behind a Triton compile (seconds each on a fresh machine: a 2 s TTFT
        tail in the first minute of serving on an H200). `model` is the one eager steps run
        (not a torch.compile'd decode model). Slots -1 write no KV; the output is dropped."""
        capacity = self.input_ids.shape[0]
        for query_len in sorted({min(q, capacity) for q in WARM_UP_QUERY_LENS}):
            self.seq_lens[:1].fill_(query_len)
            metadata = self._metadata(1, query_len, eager=True)
            hidden = model(self.input_ids[:query_len], self.kv_cache.kv_caches, metadata)
            model.compute_logits(hidden)
        self.seq_lens.zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first, all sharing one memory pool: decode
        graphs, then verify graphs when a verify query length was given."""
        pool = self.pool = torch.cuda.graph_pool_handle()
        shapes = [(1, self.batch_sizes, self.graphs)]
        if self.verify_query_len is not None:
            shapes.append((self.verify_query_len, self.verify_batch_sizes, self.verify_graphs))
        stream = torch.cuda.Stream(self.device)  # one for every warm-up: a stream's freed
        for query_len, sizes, graphs in shapes:  # memory is cached for that stream alone
            # every request a full query at capture; replays rewrite these
            self.seq_lens.fill_(query_len)
            self.verify_query_start_loc.copy_(torch.arange(
                0, query_len * len(self.verify_query_start_loc), query_len,
                dtype=torch.int32, device=self.device))
            try:
                for batch_size in reversed(sizes):
                    graphs[batch_size] = self._capture_one(batch_size, query_len, pool, stream)
            except RuntimeError as exc:
                if graphs is self.graphs:
                    raise
                # e.g. an attention path planned on the host: verify steps run eagerly
                torch.cuda.synchronize(self.device)
                logger.warning("verify CUDA graphs off (%s)", str(exc).splitlines()[0][:200])
                graphs.clear()
                self.verify_query_len, self.verify_batch_sizes = None, []
        self.seq_lens.zero_()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-ups' memory
        logger.info("captured CUDA graphs for decode batch sizes %s%s", self.batch_sizes,
                    f" and verify batch sizes {self.verify_batch_sizes} "
                    f"({self.verify_query_len} tokens a request)" if self.verify_query_len
                    else "")

    def collect_hidden_states(self, collect: Callable[[], torch.Tensor]) -> bool:
        """Capture the graphs again with `collect()` (the hooked layers' hidden states,
        concatenated) inside each; False where hooks cannot run in the captured forward."""
        if not self.hooks_run:
            return False
        self.collect_hidden = collect
        if self.graphs:
            self.release()
            self.capture()
        return True

    def release(self) -> None:
        """Drop the graphs and their pool (sleep: they name the released KV cache and
        weights); `capture()` makes them again."""
        self.graphs.clear()
        self.verify_graphs.clear()
        self.pool = None

    def _capture_one(self, batch_size: int, query_len: int, pool, stream):
        def forward():
            logits = self._forward(batch_size, query_len)
            return logits, (self.collect_hidden() if self.collect_hidden is not None
                            else None)
        graph, (logits, hidden) = capture_cuda_graph(forward, pool, stream)
        return graph, logits, hidden

    def can_run(self, num_tokens: int, num_seqs: int, max_query_len: int) -> bool:
        """Whether a captured graph fits this step (every row's logits are computed)."""
        if max_query_len == 1:
            return num_seqs <= self.max_batch_size
        return (self.verify_query_len is not None and max_query_len <= self.verify_query_len
                and num_seqs <= self.verify_batch_sizes[-1])

    def run(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Logits [num_tokens, vocab] of a decode or verify step, by graph replay."""
        n, num_seqs = input_ids.shape[0], metadata.num_seqs
        is_decode = metadata.max_query_len == 1
        sizes = self.batch_sizes if is_decode else self.verify_batch_sizes
        padded = sizes[bisect.bisect_left(sizes, num_seqs)]
        rows = padded if is_decode else padded * self.verify_query_len
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(metadata.positions)
        if self.mrope_positions is not None:
            copy_mrope_positions(self.mrope_positions, metadata)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.slot_mapping[n:rows].fill_(-1)
        self.seq_lens[:num_seqs].copy_(metadata.seq_lens)
        self.seq_lens[num_seqs:padded].fill_(0)
        if self.state_cache is not None:
            self.request_slots[:num_seqs].copy_(metadata.request_slots)
            self.request_slots[num_seqs:padded].fill_(self.state_cache.pad_slot)
            self.state_cache.reset_new(metadata)
        if not is_decode:  # padding requests own no rows
            self.verify_query_start_loc[:num_seqs + 1].copy_(metadata.query_start_loc)
            self.verify_query_start_loc[num_seqs + 1:padded + 1].fill_(n)
        width = metadata.block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(metadata.block_tables)
        for slots, tables, view in zip(self.group_slot_mappings, self.group_block_tables,
                                       metadata.group_views):
            slots[:n].copy_(view.slot_mapping)
            slots[n:rows].fill_(-1)
            tables[:num_seqs, :width].copy_(view.block_tables)
        graph, logits, hidden = (self.graphs if is_decode else self.verify_graphs)[padded]
        graph.replay()
        self.replayed_hidden = None if hidden is None else hidden[:n]
        return logits[:n]
