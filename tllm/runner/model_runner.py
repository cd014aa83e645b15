"""The model runner (rank 0): turns a ScheduledBatch into a StepPlan, tensors and
AttentionMetadata, runs the model, and returns the logits the sampler needs. With several
ranks it also sends each plan to the workers, which run their shards alongside."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from tllm.distributed import comm
from tllm.request import PLACEHOLDER, Request
from tllm.kv_cache.manager import KVCacheManager
from tllm.runner.cuda_graph import CudaGraphRunner
from tllm.runner.step import StepPlan, plan_tensors, run_plan
from tllm.sampling.last_stage import SamplingPlan, ShadowSpec, logprob_width
from tllm.sampling.sampler import SampledBatch
from tllm.scheduler.scheduler import ScheduledBatch


@dataclass
class StepInputs:
    plan: StepPlan
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
    sample_logits: torch.Tensor | None       # [len(sample_requests), vocab]
    sample_requests: list[Request]
    prompt_logits: torch.Tensor | None       # [len(prompt_targets), vocab]
    prompt_targets: list[tuple[Request, int]]
    # pipeline parallelism: the last stage sampled; its tokens are on their way to rank 0
    sampled: SampledBatch | None = None
    _receive: Callable[[], None] | None = None

    def wait(self) -> StepOutput:
        """Make what the last stage sent usable (on CUDA: order this stream after it)."""
        if self._receive is not None:
            receive, self._receive = self._receive, None
            receive()
        return self


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCacheManager, device: torch.device,
                 cuda_graphs: CudaGraphRunner | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.cuda_graphs = cuda_graphs
        self.parallel = comm.state()  # None on a single rank
        # pipeline parallelism: the last stage samples, keeping a shadow of each request
        self.samples_on_last_stage = self.parallel is not None and \
            self.parallel.mapping.pp_size > 1
        self._shadowed: set[str] = set()
        self._forget: list[str] = []

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, in_flight: SampledBatch | None = None) -> StepOutput:
        """Launch the step. `in_flight` holds last step's sampled tokens, still on the device,
        which feed this step's inputs where the host has only placeholders."""
        inputs = self.prepare_inputs(batch)
        plan = inputs.plan
        graphs = self.cuda_graphs
        # A graph replay computes logits for every row: use it when every row samples.
        plan.use_graph = (graphs is not None and graphs.can_run(plan.num_tokens,
                                                                plan.is_decode_only)
                          and len(inputs.sample_rows) == plan.num_tokens
                          and not inputs.prompt_rows)
        plan.ids_from_driver = bool(inputs.placeholder_rows) and self.parallel is not None
        if self.samples_on_last_stage:
            plan.sampling = self._sampling_plan(inputs.sample_requests)
        if self.parallel is not None:
            comm.broadcast_object(plan)
        input_ids, metadata = plan_tensors(plan, self.device, self.kv_cache.tokens_per_block)
        if inputs.placeholder_rows:
            self._fill_placeholders(input_ids, inputs, in_flight)
        if plan.ids_from_driver:
            comm.tp_broadcast_from_driver(input_ids)
        logits = run_plan(self.model, self.kv_cache.kv_caches, graphs, plan, input_ids,
                          metadata)
        out = StepOutput(None, inputs.sample_requests, None, inputs.prompt_targets)
        if logits is None:  # a later pipeline stage computes (and samples) them
            out._receive = self._post_receives(plan, out)
            return out
        num_sample = len(inputs.sample_requests)
        out.sample_logits = logits[:num_sample]
        out.prompt_logits = logits[num_sample:] if inputs.prompt_rows else None
        return out

    def forget_request(self, request_id: str) -> None:
        """A finished request: the last stage may drop its shadow (told with the next plan)."""
        if request_id in self._shadowed:
            self._shadowed.discard(request_id)
            self._forget.append(request_id)

    def _sampling_plan(self, requests: list[Request]) -> SamplingPlan:
        plan = SamplingPlan([r.request_id for r in requests], forget=self._forget)
        self._forget = []
        for request in requests:
            if request.request_id not in self._shadowed:
                self._shadowed.add(request.request_id)
                plan.new_requests.append(ShadowSpec.of(request))
        return plan

    def _post_receives(self, plan: StepPlan, out: StepOutput) -> Callable[[], None]:
        """Post the receives of what the last stage sends for this step, in its order:
        tokens, logprob tensors (when asked), prompt-logprob logits; returns the wait."""
        n = len(out.sample_requests)
        shapes: list[tuple[tuple[int, ...], torch.dtype]] = [((n,), torch.long)] if n else []
        width = logprob_width(out.sample_requests)
        if n and width is not None:
            shapes += [((n,), torch.float32), ((n,), torch.long), ((n, width), torch.float32),
                       ((n, width), torch.long)]
        num_prompt = len(plan.logit_rows) - n
        if num_prompt:
            shapes.append(((num_prompt, self.model.config.vocab_size),
                           next(self.model.parameters()).dtype))
        received = [comm.recv_from_last_stage(shape, dtype) for shape, dtype in shapes]

        def receive() -> None:
            for _, work in received:
                work.wait()
            tensors = [t for t, _ in received]
            token_ids = tensors[0] if n else torch.empty(0, dtype=torch.long,
                                                          device=self.device)
            out.sampled = SampledBatch(out.sample_requests, token_ids,
                                       tuple(tensors[1:5]) if n and width is not None else None)
            out.prompt_logits = tensors[-1] if num_prompt else None
        return receive

    def _fill_placeholders(self, input_ids: torch.Tensor, inputs: StepInputs,
                           in_flight: SampledBatch | None) -> None:
        if in_flight is None:
            raise RuntimeError("placeholder tokens without a step in flight")
        row_of = {id(r): i for i, r in enumerate(in_flight.requests)}
        src = torch.tensor([row_of[id(r)] for r in inputs.placeholder_requests],
                           device=self.device)
        dst = torch.tensor(inputs.placeholder_rows, device=self.device)
        input_ids[dst] = in_flight.token_ids[src]

    def prepare_inputs(self, batch: ScheduledBatch) -> StepInputs:
        bs = self.kv_cache.tokens_per_block
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        inputs = StepInputs(None)  # type: ignore[arg-type]
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
        # one padded table: a tensor per request costs ~5 us each at batch 256
        max_blocks = max(len(r.block_ids) for r in batch.requests)
        tables = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in batch.requests]
        inputs.plan = StepPlan(ids, positions, slots, query_lens, seq_lens, tables,
                               inputs.sample_rows + inputs.prompt_rows)
        return inputs

