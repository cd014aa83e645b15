"""Sampling on the last pipeline stage (TensorRT-LLM's place for it): the stage that has the
logits samples them and sends rank 0 only the tokens (and logprobs when asked), not
[batch, vocab] logits.

The last stage holds a shadow `Request` per live request, made from what rank 0 puts in the
step plan the first time the request is sampled (prompt, parameters, seed), and keeps its
token history itself, for penalties and min_tokens; rank 0 says when to forget one.

Both ends live here: `LastStageSampler` and the tensors it sends (the last stage),
`LastStageShadows` and `receive_from_last_stage` (rank 0), so their order is written once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from tllm.distributed import comm
from tllm.request import Request
from tllm.sampling.sampler import SampledBatch, Sampler
from tllm.sampling_params import SamplingParams
from tllm.scheduler.interface import ResourceManager


@dataclass
class ShadowSpec:
    """What the last stage needs to sample for a request it has not seen yet."""
    request_id: str
    token_ids: list[int]            # prompt, then any outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    seed: int | None                # the request's own generator seed, if any

    @classmethod
    def of(cls, request: Request) -> ShadowSpec:
        params = request.sampling_params
        seed = None if params.seed is None else params.seed + request.sample_index
        return cls(request.request_id, list(request.token_ids), request.num_prompt_tokens,
                   params, request.max_new_tokens, request.eos_token_ids, seed)

    def to_request(self, device: torch.device) -> Request:
        generator = None
        if self.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
        request = Request(self.request_id, self.token_ids[:self.num_prompt_tokens],
                          self.sampling_params, self.max_new_tokens, self.eos_token_ids,
                          generator=generator)
        request.token_ids = list(self.token_ids)
        return request


@dataclass
class SamplingPlan:
    """Rank 0's part of a step plan for the last stage's sampler."""
    row_request_ids: list[str] = field(default_factory=list)  # one per sampled row
    new_requests: list[ShadowSpec] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)           # finished since the last plan


def logprob_width(requests) -> int | None:
    """Top-k width of the logprob tensors a batch sends (None: nobody asked)."""
    asked = [r.sampling_params.logprobs for r in requests
             if r.sampling_params.logprobs is not None]
    return max(max(asked), 1) if asked else None


class LastStageSampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.sampler = Sampler(seed, device)
        self.device = device
        self.requests: dict[str, Request] = {}
        self._unfilled: SampledBatch | None = None  # last step's tokens, not yet in history

    def sample(self, plan: SamplingPlan, logits: torch.Tensor) -> list[torch.Tensor]:
        """Sample the rows; returns the tensors to send to rank 0, in order: token ids,
        then (chosen logprob, rank, top-k values, top-k ids) when any row asked."""
        self._fill_history()
        for request_id in plan.forget:
            self.requests.pop(request_id, None)
        for spec in plan.new_requests:
            self.requests[spec.request_id] = spec.to_request(self.device)
        requests = [self.requests[r] for r in plan.row_request_ids]
        if not requests:  # a prompt chunk: nothing to sample
            return []
        sampled = self.sampler.sample(logits, requests)
        for request in requests:
            request.mark_sampled()
        self._unfilled = sampled
        return list(sampled.device_tensors)

    def _fill_history(self) -> None:
        # by the next step the previous step's small copy to the host has long finished
        if self._unfilled is not None:
            sampled, self._unfilled = self._unfilled, None
            for request, token in zip(sampled.requests, sampled.host_token_ids()):
                request.receive_token(token)


class LastStageShadows(ResourceManager):
    """Rank 0's record of the shadows the last stage holds: a new request's spec goes with
    the first plan that samples it; a finished one is forgotten with the next plan."""

    def __init__(self) -> None:
        self._shadowed: set[str] = set()
        self._forget: list[str] = []

    def sampling_plan(self, requests: list[Request]) -> SamplingPlan:
        plan = SamplingPlan([r.request_id for r in requests], forget=self._forget)
        self._forget = []
        for request in requests:
            if request.request_id not in self._shadowed:
                self._shadowed.add(request.request_id)
                plan.new_requests.append(ShadowSpec.of(request))
        return plan

    def free(self, request: Request) -> None:
        if request.request_id in self._shadowed:
            self._shadowed.discard(request.request_id)
            self._forget.append(request.request_id)


def receive_from_last_stage(requests: list[Request], num_prompt_rows: int, vocab_size: int,
                            logits_dtype: torch.dtype, device: torch.device
                            ) -> Callable[[], tuple[SampledBatch, torch.Tensor | None]]:
    """Post the receives of what the last stage sends rank 0 for one step, in its order:
    tokens, logprob tensors (when any row asked), prompt-logprob logits; returns the wait,
    which gives (sampled batch, prompt logits or None)."""
    n = len(requests)
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = [((n,), torch.long)] if n else []
    width = logprob_width(requests)
    if n and width is not None:
        shapes += [((n,), torch.float32), ((n,), torch.long), ((n, width), torch.float32),
                   ((n, width), torch.long)]
    if num_prompt_rows:
        shapes.append(((num_prompt_rows, vocab_size), logits_dtype))
    received = [comm.recv_from_last_stage(shape, dtype) for shape, dtype in shapes]

    def wait() -> tuple[SampledBatch, torch.Tensor | None]:
        for _, work in received:
            work.wait()
        tensors = [t for t, _ in received]
        token_ids = tensors[0] if n else torch.empty(0, dtype=torch.long, device=device)
        logprobs = tuple(tensors[1:5]) if n and width is not None else None
        return (SampledBatch(requests, token_ids, logprobs),
                tensors[-1] if num_prompt_rows else None)
    return wait
