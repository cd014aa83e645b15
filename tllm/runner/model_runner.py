"""The model runner (rank 0): turns a ScheduledBatch into step inputs (runner/inputs.py),
decides how the step runs (CUDA graph, placeholder ids, what the last pipeline stage
samples), sends the plan to the other ranks, runs this rank's part (runner/step.py) and
returns the logits the sampler needs, or the wait for what the last stage sends back."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from tllm.distributed import comm
from tllm.kv_cache.manager import KVCacheManager
from tllm.lora.manager import LoraManager
from tllm.request import Request
from tllm.runner.cuda_graph import CudaGraphRunner
from tllm.runner.inputs import StepInputs, prepare_inputs
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
    # pipeline parallelism: the last stage sampled; its tokens are on their way to rank 0
    sampled: SampledBatch | None = None
    # speculative decoding: rows per sample request (sample_logits then has sum of them);
    # None: one each
    sample_counts: list[int] | None = None
    # the hidden states of the layers a drafter asked for, [num_tokens, layers * hidden]
    hidden_states: torch.Tensor | None = None
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
                 lora: LoraManager | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.cuda_graphs = cuda_graphs
        self.lora = lora  # adapter slots (with LoRA on): each step's plan carries them
        self.rank = RankModel(model, kv_cache.kv_caches, cuda_graphs, device,
                              kv_cache.tokens_per_block, lora.model if lora else None)
        self.parallel = comm.state()  # None on a single rank
        # pipeline parallelism: the last stage samples, keeping a shadow of each request
        is_pipelined = self.parallel is not None and self.parallel.mapping.pp_size > 1
        self.shadows = LastStageShadows() if is_pipelined else None
        self._captured: dict[int, torch.Tensor] = {}
        self.capture_layers: tuple[int, ...] = ()

    def capture_hidden_states(self, layers: tuple[int, ...]) -> None:
        """From now on every step also returns these layers' hidden states (each layer's
        output with its residual added; the steps then run without CUDA graphs)."""
        def keep(index: int):
            def hook(module, args, output) -> None:
                hidden, residual = output if isinstance(output, tuple) else (output, None)
                self._captured[index] = hidden if residual is None else hidden + residual
            return hook
        for index in layers:
            self.model.layers[index].register_forward_hook(keep(index))
        self.capture_layers = tuple(layers)

    @property
    def samples_on_last_stage(self) -> bool:
        return self.shadows is not None

    @property
    def resource_managers(self) -> list[ResourceManager]:
        """What the runner keeps per request, for the loop to free with the request."""
        return [m for m in (self.shadows, self.lora) if m is not None]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, in_flight: SampledBatch | None = None) -> StepOutput:
        """Launch the step. `in_flight` holds last step's sampled tokens, still on the device,
        which feed this step's inputs where the host has only placeholders."""
        kv = self.kv_cache
        inputs = prepare_inputs(batch, kv.block_ids, kv.tokens_per_block,
                                kv.group_block_ids if kv.num_groups > 1 else None)
        plan = self._complete_plan(inputs)
        if self.lora is not None:
            plan.lora_slots = [self.lora.slot_of(r) for r in batch.requests]
            plan.lora_loads = self.lora.take_loads()
        if self.parallel is not None:
            comm.broadcast_object(plan)
        fill = None
        if inputs.placeholder_rows:
            def fill(input_ids: torch.Tensor) -> None:
                self._fill_placeholders(input_ids, inputs, in_flight)
        logits = self.rank.run(plan, fill)
        out = StepOutput(None, inputs.sample_requests, None, inputs.prompt_targets,
                         sample_counts=inputs.sample_counts)
        if logits is None:  # a later pipeline stage computes (and samples) them
            out._receive = receive_from_last_stage(
                inputs.sample_requests, len(inputs.prompt_rows), self.model.config.vocab_size,
                self.model.activation_dtype, self.device)
            return out
        num_sample = len(inputs.sample_rows)
        out.sample_logits = logits[:num_sample]
        if self.capture_layers:
            # a layer may be named twice (a shallow target: EAGLE-3's default ids coincide)
            out.hidden_states = torch.cat([self._captured[i] for i in self.capture_layers],
                                          dim=-1)
            self._captured.clear()
        out.prompt_logits = logits[num_sample:] if inputs.prompt_rows else None
        return out

    def _complete_plan(self, inputs: StepInputs) -> StepPlan:
        """How this step runs, decided once here and carried in the plan to every rank."""
        plan = inputs.plan
        plan.layer_groups = self.kv_cache.layer_groups
        graphs = self.cuda_graphs
        # A graph replay computes logits for every row: use it when every row samples.
        plan.use_graph = (graphs is not None and not self.capture_layers
                          and graphs.can_run(plan.num_tokens, len(plan.query_lens),
                                             max(plan.query_lens))
                          and len(inputs.sample_rows) == plan.num_tokens
                          and not inputs.prompt_rows)
        plan.ids_from_driver = bool(inputs.placeholder_rows) and self.parallel is not None
        if self.shadows is not None:
            plan.sampling = self.shadows.sampling_plan(inputs.sample_requests)
        return plan

    def _fill_placeholders(self, input_ids: torch.Tensor, inputs: StepInputs,
                           in_flight: SampledBatch | None) -> None:
        if in_flight is None:
            raise RuntimeError("placeholder tokens without a step in flight")
        row_of = {id(r): i for i, r in enumerate(in_flight.requests)}
        # torch.tensor(..., device=cuda) would wait for the GPU (a blocking copy), which
        # made the overlapped loop wait for the step in flight before launching the next
        src = torch.tensor([row_of[id(r)] for r in inputs.placeholder_requests])
        dst = torch.tensor(inputs.placeholder_rows)
        input_ids[dst.to(self.device, non_blocking=True)] = in_flight.token_ids[
            src.to(self.device, non_blocking=True)]
