"""The model runner (rank 0): turns a ScheduledBatch into a diff of its persistent batch and
the step's inputs (runner/batch_state.py, runner/inputs.py), decides how the step runs (CUDA
graph, ids read from the device, what the last pipeline stage samples), sends the plan to
the other ranks, runs this rank's part (runner/step.py) and returns the logits the sampler
needs, or the wait for what the last stage sends back. It owns the device token table the
sampler writes each step's tokens into and the next step reads."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn

from tllm.distributed import comm
from tllm.kv_cache.manager import KVCacheManager
from tllm.lora.manager import LoraManager
from tllm.request import Request
from tllm.kv_cache.block_table import cdiv
from tllm.runner.batch_state import BatchTables, SlotAssigner
from tllm.runner.cuda_graph import CudaGraphRunner
from tllm.runner.multimodal import MultimodalInputsBuilder, StepMultimodal
from tllm.runner.inputs import StepInputs, build_step_inputs
from tllm.runner.piecewise import PiecewiseGraphRunner
from tllm.runner.pooling import Pooler
from tllm.runner.step import RankModel, StepPlan
from tllm.sampling.last_stage import LastStageShadows, receive_from_last_stage
from tllm.sampling.sampler import SampledBatch
from tllm.scheduler.interface import ResourceManager, ScheduledBatch


@dataclass
class StepOutput:
    sample_logits: torch.Tensor | None       # [len(sample_requests), vocab]
    sample_requests: list[Request]
    prompt_logits: torch.Tensor | None       # [len(prompt_targets), vocab]
    prompt_targets: list[tuple[Request, int]]
    # the sample requests' batch slots (where their sampling parameters are kept)
    sample_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # pipeline parallelism: the last stage sampled; its tokens are on their way to rank 0
    sampled: SampledBatch | None = None
    # speculative decoding: rows per sample request (sample_logits then has sum of them);
    # None: one each
    sample_counts: list[int] | None = None
    # the hidden states of the layers a drafter asked for, [num_tokens, layers * hidden]
    hidden_states: torch.Tensor | None = None
    # pooling requests whose prompt ended in this step: (request, output on the device)
    pooled: list[tuple[Request, torch.Tensor]] = field(default_factory=list)
    _receive: Callable[[], tuple[SampledBatch, torch.Tensor | None]] | None = None

    def wait(self) -> StepOutput:
        """Make what the last stage sent usable (on CUDA: order this stream after it)."""
        if self._receive is not None:
            receive, self._receive = self._receive, None
            self.sampled, self.prompt_logits = receive()
        return self


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCacheManager, device: torch.device,
                 cuda_graphs: CudaGraphRunner | None = None,
                 lora: LoraManager | None = None, *, max_batch_size: int,
                 max_seq_len: int, piecewise: PiecewiseGraphRunner | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.cuda_graphs = cuda_graphs
        self.lora = lora  # adapter slots (with LoRA on): each step's plan carries them
        self.slots = SlotAssigner(max_batch_size, kv_cache)
        tables = batch_tables(max_batch_size, max_seq_len, kv_cache)
        self.piecewise = piecewise
        self.rank = RankModel(model, kv_cache.kv_caches, cuda_graphs, device, tables,
                              lora.model if lora else None, piecewise)
        # the newest sampled token of each slot, written by the sampler's step
        self.token_table = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.parallel = comm.state()  # None on a single rank
        # pipeline parallelism: the last stage samples, keeping a shadow of each request
        is_pipelined = self.parallel is not None and self.parallel.mapping.pp_size > 1
        self.shadows = LastStageShadows() if is_pipelined else None
        self._captured: dict[int, torch.Tensor] = {}
        self.capture_layers: tuple[int, ...] = ()
        self._graphs_collect_hidden = False  # the CUDA graphs hold the captured states
        self.has_drafter = False  # requests may carry drafts (the executor sets it)
        # a vision-language model: image embeddings (encoder cache) and M-RoPE positions
        self.multimodal = (MultimodalInputsBuilder(model, device)
                           if getattr(model, "is_multimodal", False) else None)
        self.pooler: Pooler | None = None  # set by enable_pooling

    def capture_hidden_states(self, layers: tuple[int, ...]) -> None:
        """From now on every step also returns these layers' hidden states (each layer's
        output with its residual added). Decode and verify graphs are captured again with
        them inside; prompt steps run eagerly."""
        def keep(index: int):
            def hook(module, args, output) -> None:
                hidden, residual = output if isinstance(output, tuple) else (output, None)
                self._captured[index] = hidden if residual is None else hidden + residual
            return hook
        for index in layers:
            self.model.layers[index].register_forward_hook(keep(index))
        self.capture_layers = tuple(layers)
        self._graphs_collect_hidden = (self.cuda_graphs is not None and
                                       self.cuda_graphs.collect_hidden_states(
                                           self._collected_hidden))

    def _collected_hidden(self) -> torch.Tensor:
        """The hooked layers' states of the forward just run, concatenated (a layer may be
        named twice: a shallow target's EAGLE-3 default ids coincide)."""
        hidden = torch.cat([self._captured[i] for i in self.capture_layers], dim=-1)
        self._captured.clear()
        return hidden

    def enable_pooling(self, pooler: Pooler) -> None:
        """Serve pooling requests (one rank, or tensor parallelism: rank 0 has every
        token's final hidden state)."""
        self.pooler = pooler

    @property
    def samples_on_last_stage(self) -> bool:
        return self.shadows is not None

    @property
    def resource_managers(self) -> list[ResourceManager]:
        """What the runner keeps per request, for the loop to free with the request."""
        return [m for m in (self.slots, self.shadows, self.lora, self.pooler)
                if m is not None]

    @torch.inference_mode()
    def record_sampled(self, sampled: SampledBatch) -> None:
        """Keep a step's sampled tokens in the device token table, where the next step's
        inputs read them (the host may not have them yet)."""
        if sampled.requests:
            slots = (sampled.slots if sampled.slots is not None
                     else np.array(self.slots.slots_of(sampled.requests), dtype=np.int64))
            self.token_table.index_copy_(
                0, torch.from_numpy(slots).to(self.device, non_blocking=True),
                sampled.token_ids)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Launch the step; tokens sampled by earlier steps and not yet on the host are read
        from the device token table."""
        inputs = build_step_inputs(batch, self.slots, self.rank.tables,
                                   may_have_drafts=self.has_drafter)
        multimodal = (None if self.multimodal is None else
                      self.multimodal.build(batch.requests, inputs.diff, inputs.arrays))
        plan = self._plan(inputs, multimodal)
        if self.lora is not None:
            plan.lora_slots = [self.lora.slot_of(r) for r in batch.requests]
            plan.lora_loads = self.lora.take_loads()
        if self.parallel is not None:
            comm.broadcast_object(plan)
        patch = None
        if len(inputs.device_rows):
            rows = torch.from_numpy(inputs.device_rows)
            slots = torch.from_numpy(inputs.device_slots)

            def patch(input_ids: torch.Tensor) -> None:
                input_ids[rows.to(self.device, non_blocking=True)] = self.token_table[
                    slots.to(self.device, non_blocking=True)]
        out = StepOutput(None, inputs.sample_requests, None, inputs.prompt_targets,
                         inputs.sample_slots, sample_counts=inputs.sample_counts)
        pooling = None
        if inputs.pooling is not None:
            step_pooling = inputs.pooling
            pooling = (step_pooling.token_type_ids,
                       lambda hidden: out.pooled.extend(self.pooler.pool(hidden, step_pooling)))
        logits = self.rank.run(plan, inputs.arrays, inputs.input_ids, patch, multimodal,
                               pooling)
        if logits is None:  # a later pipeline stage computes (and samples) them
            out._receive = receive_from_last_stage(
                inputs.sample_requests, len(inputs.prompt_rows), self.model.config.vocab_size,
                self.model.activation_dtype, self.device)
            return out
        num_sample = len(inputs.sample_rows)
        if plan.use_graph and not _is_every_row(inputs):  # a replay computes every row's
            logits = logits[torch.from_numpy(inputs.logit_rows).to(self.device,
                                                                   non_blocking=True)]
        out.sample_logits = logits[:num_sample]
        if self.capture_layers:  # a replay's are the graph's buffer: the next one rewrites
            out.hidden_states = (self.cuda_graphs.replayed_hidden.clone() if plan.use_graph
                                 else self._collected_hidden())
        out.prompt_logits = logits[num_sample:] if inputs.prompt_rows else None
        return out

    def _plan(self, inputs: StepInputs, multimodal: StepMultimodal | None = None) -> StepPlan:
        """How this step runs, decided once here and carried in the plan to every rank.
        Steps with image tokens run eagerly (graphs know no image embeddings); a
        vision-language model's other steps replay (graphs take M-RoPE positions)."""
        plan = StepPlan(inputs.diff, inputs.logit_rows,
                        layer_groups=self.kv_cache.layer_groups)
        text_only = multimodal is None or multimodal.is_text_only
        graphs = self.cuda_graphs if text_only else None
        num_seqs = len(inputs.diff.slots)
        plan.use_graph = (graphs is not None
                          and (not self.capture_layers or self._graphs_collect_hidden)
                          and inputs.pooling is None
                          and graphs.can_run(plan.num_tokens, num_seqs,
                                             inputs.arrays.max_query_len))
        plan.use_piecewise = (not plan.use_graph and self.piecewise is not None
                              and text_only
                              and not self.capture_layers
                              and self.piecewise.can_run(plan.num_tokens))
        plan.ids_from_driver = self.parallel is not None
        if self.shadows is not None:
            plan.sampling = self.shadows.sampling_plan(inputs.sample_requests)
        return plan


def _is_every_row(inputs: StepInputs) -> bool:
    """Whether the step samples at every row, in order (sample rows only ever increase)."""
    return not inputs.prompt_rows and len(inputs.sample_rows) == inputs.diff.num_tokens


def batch_tables(max_batch_size: int, max_seq_len: int, kv_cache: KVCacheManager) -> BatchTables:
    """Tables for every slot, each as long as the longest request's (plus a block that a
    step's drafts may reach into)."""
    max_blocks = cdiv(max_seq_len, kv_cache.tokens_per_block) + 1
    return BatchTables(max_batch_size, max_blocks, kv_cache.num_groups,
                       kv_cache.tokens_per_block)
