"""Decode steps on the CPU through a torch.compile'd forward (`LlmArgs.torch_compile_config`):
Inductor's CPU backend fuses the plain-PyTorch code of a decode step (norms, rotary,
activations, residuals) into a few C++ kernels, so that the step runs tens of top-level ops
instead of thousands; attention stays the eager batched path, and so does the int8 GGUF
product, each handed to the compiler as a custom op (tllm/attention/torch_op.py,
tllm/kernels/int8_cpu.py). Steps with prompt tokens run eagerly.

Shapes: the batch dimension is dynamic, so one trace serves every batch size from 2 (batch
1 has its own); block tables are padded to the longest a request may have, so a growing
context never retraces. Batch 1 and 2 are compiled at start (`warm_up`); Inductor's on-disk
caches (FX graphs, AOT autograd) make a later start with the same model faster (Dynamo
still traces). If compiling fails (no C++ compiler, say), decode runs eagerly, with one log
line. Speed: benchmarks/RESULTS.md (2026-12-06, the compiled CPU decode step)."""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from tllm.attention.interface import AttentionMetadata
from tllm.kv_cache.block_table import cdiv
from tllm.kv_cache.manager import KVCacheManager

logger = logging.getLogger(__name__)


class CompiledCpuDecode:
    """Runs decode steps (every request one new token) through the compiled model, in the
    place of a CudaGraphRunner: `can_run`, then `run` gives every row's logits."""

    def __init__(self, model: nn.Module, kv_cache: KVCacheManager, max_batch_size: int,
                 max_seq_len: int) -> None:
        from tllm.attention import torch_op  # noqa: F401  (registers the attention op)
        # Dynamo's cache keys on the code and its inputs, not on the engine: an earlier
        # engine's traces in this process must not be replayed for this one
        torch._dynamo.reset()
        self.model = model
        self.kv_cache = kv_cache
        self.max_batch_size = max_batch_size
        width = cdiv(max_seq_len, kv_cache.tokens_per_block) + 1  # + a block for drafts
        self._tables = [torch.zeros(max_batch_size, width, dtype=torch.int32)
                        for _ in range(kv_cache.num_groups)]
        # no guards on the model's modules (their parameters, attributes): checking them
        # took ~0.8 ms a call at SmolLM2's 30 layers; the weights change only in place
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        self._forward = torch.compile(model.forward, dynamic=True, options=options)
        self._logits = torch.compile(model.compute_logits, dynamic=True, options=options)
        self.graphs: dict = {}        # what the engine's summary lists: none are captured
        self.batch_sizes: list[int] = []
        self.pool = None
        self.is_active = True

    def can_run(self, num_tokens: int, num_seqs: int, max_query_len: int) -> bool:
        return self.is_active and max_query_len == 1 and num_seqs <= self.max_batch_size

    def run(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Logits [num_tokens, vocab] of a decode step (eagerly, if a new trace fails to
        compile: a step's KV writes are the same either way)."""
        if self.is_active:
            try:
                return self._compiled(input_ids, self._padded_tables(metadata))
            except Exception as exc:  # noqa: BLE001 (any compiler failure)
                self._give_up(exc)
        hidden = self.model(input_ids, self.kv_cache.kv_caches, metadata)
        return self.model.compute_logits(hidden)

    def _compiled(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self._forward(input_ids, self.kv_cache.kv_caches, metadata)
        return self._logits(hidden)

    def _give_up(self, exc: Exception) -> None:
        self.is_active = False
        message = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        logger.warning("torch_compile_config: compiling the CPU decode step failed (%s: %s); "
                       "decode steps run eagerly", type(exc).__name__, message)

    def _padded_tables(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """The step's metadata with block tables as wide as the longest request's (the
        width of a step's tables follows its longest context: a new shape every block)."""
        views = [metadata, *metadata.group_views]
        tables = []
        for view, buffer in zip(views, self._tables):
            n, width = view.block_tables.shape
            buffer[:n, :width].copy_(view.block_tables)
            tables.append(buffer[:n])
        padded = dataclasses.replace(metadata, block_tables=tables[0], group_views=[])
        if metadata.group_views:
            padded.group_views = [dataclasses.replace(view, block_tables=table)
                                  for view, table in zip(metadata.group_views, tables[1:])]
        return padded

    @torch.inference_mode()
    def warm_up(self, batch_sizes: list[int]) -> bool:
        """Compile for these batch sizes now (a dummy step each, its KV rows zeroed after);
        False, with one log line, if compiling failed: decode then runs eagerly."""
        try:
            for batch_size in batch_sizes:
                if self.is_active:
                    self.run(*self._dummy_step(batch_size))
        finally:
            self._clear_dummy_rows(max(batch_sizes))
        return self.is_active

    def _dummy_step(self, batch_size: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """One token per request, each in its own KV slot of the first blocks."""
        rows = torch.arange(batch_size)
        bs = self.kv_cache.tokens_per_block
        tables = (rows // bs).to(torch.int32)[:, None]
        metadata = AttentionMetadata(
            positions=torch.zeros(batch_size, dtype=torch.long), slot_mapping=rows.clone(),
            query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32),
            seq_lens=torch.ones(batch_size, dtype=torch.int32), block_tables=tables,
            max_query_len=1, max_seq_len=1, tokens_per_block=bs,
            query_lens_cpu=[1] * batch_size, seq_lens_cpu=[1] * batch_size)
        if self.kv_cache.num_groups > 1:
            metadata.add_group_views(self.kv_cache.layer_groups,
                                     [(rows.clone(), tables)] * (self.kv_cache.num_groups - 1))
        return torch.zeros(batch_size, dtype=torch.long), metadata

    def _clear_dummy_rows(self, batch_size: int) -> None:
        num_blocks = cdiv(batch_size, self.kv_cache.tokens_per_block)
        for cache in self.kv_cache.kv_caches:
            for tensor in cache:
                tensor[:num_blocks].zero_()

    def release(self) -> None:
        """Nothing to free (CudaGraphRunner's interface: weights are about to change; a
        changed weight fails Dynamo's guards and retraces on the next step)."""
