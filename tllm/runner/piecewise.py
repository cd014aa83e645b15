"""Piecewise CUDA graphs for steps that carry prompt tokens (prefill, chunked prefill, and
decodes mixed with them): everything but attention is captured, once per token-count
bucket, and attention runs eagerly between the pieces with the step's own metadata (its
launch grids follow the step's query and context lengths, which change every step). A mixed
step then costs a few dozen graph replays and one attention call a layer instead of
hundreds of eager launches (vLLM's piecewise graphs, without a compiler: the forward itself
is cut where it reaches an attention backend, or a state-space mixer's state update:
layers/state_batch.py).

Capture runs the model's forward once per bucket with `AttentionMetadata.capture` set: each
attention call ends the graph being captured, is recorded (its inputs are tensors of the
graph's pool, fixed from then on), gets a fixed output buffer, and the next graph begins. A
replay copies the step's token ids into the static input buffer and alternates graph
replays with the recorded attention calls. A step of T tokens replays the smallest bucket
of at least T: its padding rows compute on stale inputs, write no KV (attention sees only
the step's T rows) and are never read.

Memory: only one step runs at a time, so every bucket (and the decode graphs) share one
pool, and the tensors the eager calls read (q, k, v, the last hidden states) are kept as
non-owning aliases: the pool may hand their memory to the next bucket's capture, as it does
within one graph (vLLM keeps weak references for the same reason). Holding them would keep
32 layers' q, k, v of every bucket: tens of GB for an 8B model. The calls' output buffers
are one per shape, sliced by bucket, shared by every layer (each is read once, by the next
piece's output projection, before the next call writes it)."""
from __future__ import annotations

import bisect
import dataclasses
import gc
import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from tllm.attention.interface import AttentionMetadata
from tllm.kv_cache.manager import KVCacheManager, cdiv

logger = logging.getLogger(__name__)

# Token counts captured, up to max_num_tokens: steps between two buckets pad to the larger.
DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
                         1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168,
                         8192, 10240, 12288, 14336, 16384)


@dataclass
class AttentionCall:
    """One attention call between two pieces: the backend method and its arguments as
    captured (q, k, v live in the graph pool), the metadata view it took (-1: the step's
    own, g: its group view g), and the fixed buffer the next piece reads its output from."""
    method: Callable
    args: tuple
    view: int
    out: torch.Tensor

    def run(self, metadata: AttentionMetadata, num_tokens: int) -> None:
        view = metadata if self.view < 0 else metadata.group_views[self.view]
        q, k, v, *rest = self.args
        out = self.method(q[:num_tokens], k[:num_tokens], v[:num_tokens], rest[0], view,
                          *rest[1:])
        self.out[:num_tokens].copy_(out)


class PiecewiseRecorder:
    """Set on the capture metadata: attention backends hand it their call (`defer`)."""

    def __init__(self, pool, outputs: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.pool = pool
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.calls: list[AttentionCall] = []
        self._views: dict[int, int] = {}
        self._outputs = outputs  # the fixed output buffer for an attention input like q

    def begin(self, metadata: AttentionMetadata) -> None:
        self._views = {id(metadata): -1, **{id(v): g for g, v in
                                           enumerate(metadata.group_views)}}
        self._next_piece()

    def defer(self, method: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              kv_cache, metadata: AttentionMetadata, *rest,
              like: torch.Tensor | None = None) -> torch.Tensor:
        """End the piece being captured at this attention call; its output buffer (shaped
        as q, or as `like`: a state-space mixer's update, layers/state_batch.py)."""
        self.pieces[-1].capture_end()
        out = self._outputs(q if like is None else like)
        self.calls.append(AttentionCall(method, (alias(q), alias(k), alias(v), kv_cache, *rest),
                                        self._views[id(metadata)], out))
        self._next_piece()
        return out

    def end(self) -> None:
        self.pieces[-1].capture_end()

    def abandon(self) -> None:
        """The forward failed mid-capture: end the capture, so the stream can run again."""
        try:
            self.pieces[-1].capture_end()
        except Exception:  # the capture was invalidated: ending it reports that again
            pass

    def _next_piece(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.pieces.append(graph)


@dataclass
class PiecewiseGraph:
    """One bucket: graphs alternating with the attention calls between them."""
    pieces: list[torch.cuda.CUDAGraph]
    calls: list[AttentionCall]
    hidden: torch.Tensor  # the last piece's output, [bucket, hidden]

    def replay(self, metadata: AttentionMetadata, num_tokens: int) -> torch.Tensor:
        for piece, call in zip(self.pieces, self.calls):
            piece.replay()
            call.run(metadata, num_tokens)
        self.pieces[-1].replay()
        return self.hidden[:num_tokens]


class PiecewiseGraphRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCacheManager, buckets: list[int],
                 device: torch.device, pool=None, state_pad_slot: int | None = None,
                 uses_mrope: bool = False) -> None:
        self.model = model
        # a hybrid's warm-ups prefill the state cache's scratch row (None: no state)
        self.state_pad_slot = state_pad_slot
        self.kv_cache = kv_cache
        self.buckets = sorted(set(buckets))
        self.device = device
        self.pool = pool
        max_tokens = self.buckets[-1]
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self._slots = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        # an M-RoPE model rotates q and k inside the pieces: by these (runner/cuda_graph.py)
        self.mrope_positions = (torch.zeros(3, max_tokens, dtype=torch.long, device=device)
                                if uses_mrope else None)
        self.graphs: dict[int, PiecewiseGraph] = {}
        self._outputs: dict[tuple, torch.Tensor] = {}  # attention outputs, by shape

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def can_run(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens and bool(self.graphs)

    def run(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the step, by piecewise replay."""
        n = input_ids.shape[0]
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(metadata.positions)  # for code that reads them outside
        if self.mrope_positions is not None:
            copy_mrope_positions(self.mrope_positions, metadata)
        return self.graphs[bucket].replay(metadata, n)

    def release(self) -> None:
        """Drop the graphs, their pool and output buffers (sleep); set `pool` (the decode
        graphs' new one, or None: a pool of their own) and `capture()` to make them again."""
        self.graphs.clear()
        self._outputs.clear()
        self.pool = None

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket, largest first, in one memory pool."""
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):
                self.graphs[bucket] = self._capture_one(bucket)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info("captured piecewise CUDA graphs for %d token buckets up to %d (%d pieces "
                    "each)", len(self.buckets), self.max_tokens,
                    len(self.graphs[self.max_tokens].pieces))

    def _capture_one(self, bucket: int) -> PiecewiseGraph:
        metadata = self._metadata(bucket)
        for _ in range(2):  # warm-up: compile kernels, settle the allocator
            self.model(self.input_ids[:bucket], self.kv_cache.kv_caches, metadata)
        gc.collect()
        recorder = PiecewiseRecorder(self.pool, self._output_buffer)
        capturing = dataclasses.replace(metadata, capture=recorder)
        capturing.add_group_views(metadata.layer_groups, [
            (view.slot_mapping, view.block_tables) for view in metadata.group_views])
        for view in capturing.group_views:
            view.capture = recorder
        recorder.begin(capturing)
        try:
            hidden = self.model(self.input_ids[:bucket], self.kv_cache.kv_caches, capturing)
        except BaseException:
            recorder.abandon()
            raise
        recorder.end()
        return PiecewiseGraph(recorder.pieces, recorder.calls, alias(hidden))

    def _output_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """The fixed buffer an attention call like `like` writes (zeros: rows past a step's
        tokens stay finite), a view of one buffer per shape for every bucket and layer."""
        key = (tuple(like.shape[1:]), like.dtype)
        if key not in self._outputs:  # outside any capture: plain memory, kept
            self._outputs[key] = torch.zeros(self.max_tokens, *like.shape[1:],
                                             dtype=like.dtype, device=like.device)
        return self._outputs[key][:like.shape[0]]

    def _metadata(self, bucket: int) -> AttentionMetadata:
        """One sequence of `bucket` tokens writing no KV: what warm-up and capture see."""
        width = cdiv(bucket, self.kv_cache.tokens_per_block)
        tables = torch.zeros(1, width, dtype=torch.int32, device=self.device)
        metadata = AttentionMetadata(
            positions=self.positions[:bucket], slot_mapping=self._slots[:bucket],
            query_start_loc=torch.tensor([0, bucket], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([bucket], dtype=torch.int32, device=self.device),
            block_tables=tables, max_query_len=bucket, max_seq_len=bucket,
            tokens_per_block=self.kv_cache.tokens_per_block,
            query_lens_cpu=[bucket], seq_lens_cpu=[bucket],
            request_slots_cpu=[] if self.state_pad_slot is None else [self.state_pad_slot],
            mrope_positions=(None if self.mrope_positions is None
                             else self.mrope_positions[:, :bucket]))
        if self.kv_cache.num_groups > 1:
            metadata.add_group_views(self.kv_cache.layer_groups, [
                (self._slots[:bucket], tables) for _ in range(self.kv_cache.num_groups - 1)])
        return metadata


def copy_mrope_positions(buffer: torch.Tensor, metadata: AttentionMetadata) -> None:
    """A step's M-RoPE positions into a graph's buffer [3, tokens] (a step built without
    them: its plain positions, three times)."""
    n = metadata.positions.shape[0]
    buffer[:, :n].copy_(metadata.positions.expand(3, -1) if metadata.mrope_positions is None
                        else metadata.mrope_positions)


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory that does not keep it allocated (see Memory above)."""
    storage = tensor.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device,
                                                         storage.nbytes())
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        weak, tensor.storage_offset(), tensor.shape, tensor.stride())


def token_buckets(max_num_tokens: int, configured: list[int] | None = None) -> list[int]:
    """The buckets up to max_num_tokens (which is always one)."""
    sizes = [b for b in (configured or DEFAULT_TOKEN_BUCKETS) if b < max_num_tokens]
    return sizes + [max_num_tokens]
