"""The model runner: turns a ScheduledBatch into flat input tensors and AttentionMetadata,
runs the model, and returns the logits the sampler needs."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import nn

from tllm.attention.interface import AttentionMetadata
from tllm.executor.request import PLACEHOLDER, Request
from tllm.kv_cache.manager import KVCacheManager
from tllm.runner.cuda_graph import CudaGraphRunner
from tllm.sampling.sampler import SampledBatch
from tllm.scheduler.scheduler import ScheduledBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    metadata: AttentionMetadata
    # rows of the flat token dimension whose logits are needed, in this order:
    sample_rows: list[int] = field(default_factory=list)      # last token of a request
    sample_requests: list[Request] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)      # prompt positions (logprobs)
    prompt_targets: list[tuple[Request, int]] = field(default_factory=list)  # (req, next id)
    # rows whose token was sampled last step and is still only on the device
    placeholder_rows: list[int] = field(default_factory=list)
    placeholder_requests: list[Request] = field(default_factory=list)


@dataclass
class StepOutput:
    sample_logits: torch.Tensor             # [len(sample_requests), vocab]
    sample_requests: list[Request]
    prompt_logits: torch.Tensor | None       # [len(prompt_targets), vocab]
    prompt_targets: list[tuple[Request, int]]


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCacheManager, device: torch.device,
                 cuda_graphs: CudaGraphRunner | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.cuda_graphs = cuda_graphs

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, in_flight: SampledBatch | None = None) -> StepOutput:
        """Launch the step. `in_flight` holds last step's sampled tokens, still on the device,
        which feed this step's inputs where the host has only placeholders."""
        inputs = self.prepare_inputs(batch)
        if inputs.placeholder_rows:
            self._fill_placeholders(inputs, in_flight)
        md = inputs.metadata
        graphs = self.cuda_graphs
        # A graph replay computes logits for every row: use it when every row samples.
        if (graphs is not None and graphs.can_run(md.num_tokens, md.is_decode_only)
                and len(inputs.sample_rows) == md.num_tokens and not inputs.prompt_rows):
            logits = graphs.run(inputs.input_ids, md)
            return StepOutput(logits, inputs.sample_requests, None, [])
        hidden = self.model(inputs.input_ids, self.kv_cache.kv_caches, inputs.metadata)
        rows = torch.tensor(inputs.sample_rows + inputs.prompt_rows, dtype=torch.long,
                            device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        num_sample = len(inputs.sample_rows)
        return StepOutput(logits[:num_sample], inputs.sample_requests,
                          logits[num_sample:] if inputs.prompt_rows else None,
                          inputs.prompt_targets)

    def _fill_placeholders(self, inputs: StepInputs, in_flight: SampledBatch | None) -> None:
        if in_flight is None:
            raise RuntimeError("placeholder tokens without a step in flight")
        row_of = {id(r): i for i, r in enumerate(in_flight.requests)}
        src = torch.tensor([row_of[id(r)] for r in inputs.placeholder_requests],
                           device=self.device)
        dst = torch.tensor(inputs.placeholder_rows, device=self.device)
        inputs.input_ids[dst] = in_flight.token_ids[src]

    def prepare_inputs(self, batch: ScheduledBatch) -> StepInputs:
        bs = self.kv_cache.tokens_per_block
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        inputs = StepInputs(None, None)  # type: ignore[arg-type]
        for request, num_new in zip(batch.requests, batch.num_scheduled_tokens):
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            first_row = len(ids)
            ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            table = request.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            if end == request.num_tokens:
                inputs.sample_rows.append(first_row + num_new - 1)
                inputs.sample_requests.append(request)
                if request.token_ids[-1] == PLACEHOLDER:
                    ids[-1] = 0
                    inputs.placeholder_rows.append(first_row + num_new - 1)
                    inputs.placeholder_requests.append(request)
            if request.wants_prompt_logprobs:
                # after a preemption the prompt is computed again: skip what was recorded
                recorded = max(0, len(request.prompt_logprobs) - 1)
                for p in range(max(start, recorded), min(end, request.num_prompt_tokens - 1)):
                    inputs.prompt_rows.append(first_row + p - start)
                    inputs.prompt_targets.append((request, request.token_ids[p + 1]))
        inputs.input_ids = self._to_device(ids, torch.long)
        inputs.metadata = self._build_metadata(batch, positions, slots, query_lens, seq_lens)
        return inputs

    def _build_metadata(self, batch, positions, slots, query_lens, seq_lens) -> AttentionMetadata:
        # one tensor from padded lists: a tensor per request costs ~5 us each at batch 256
        max_blocks = max(len(r.block_ids) for r in batch.requests)
        tables = torch.tensor([r.block_ids + [0] * (max_blocks - len(r.block_ids))
                               for r in batch.requests], dtype=torch.int32)
        query_start = [0, *itertools.accumulate(query_lens)]
        return AttentionMetadata(
            positions=self._to_device(positions, torch.long),
            slot_mapping=self._to_device(slots, torch.long),
            query_start_loc=self._to_device(query_start, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            block_tables=tables.to(self.device, non_blocking=True),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            tokens_per_block=self.kv_cache.tokens_per_block,
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)

    def _to_device(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)
