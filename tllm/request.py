"""Request: the one object that travels through the executor loop."""
from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from tllm.pooling_params import PoolingParams
from tllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from tllm.kv_cache.transfer import ImportedKV
    from tllm.lora.request import LoRARequest
    from tllm.multimodal.inputs import MultimodalInputs
    from tllm.outputs import PositionLogprobs
    from tllm.sampling.beam import BeamGroup
    from tllm.tokenizer import IncrementalDetokenizer


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    """One sequence to generate. `token_ids` holds the prompt followed by the outputs the host
    knows; `num_in_flight` more were sampled on the device and are on their way (the overlap
    scheduler launches the next step before the host has the last one's tokens: that step
    reads them from the device). `num_computed_tokens` of the `num_tokens` already have their
    keys and values in the KV cache."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    sample_index: int = 0
    # Parallel samples (n > 1) wait until their leader has computed the prompt, then reuse its
    # cached prompt blocks instead of computing them again.
    prefix_leader: Request | None = None
    # Beam search: the beams of one prompt, scheduled, stepped and preempted as one unit
    beam_group: BeamGroup | None = None
    detokenizer: IncrementalDetokenizer | None = None
    generator: torch.Generator | None = None
    on_update: Callable[[Request], None] | None = None
    # False: on_update only once the request has ended (its caller waits for the whole
    # output, as LLM.generate does), not after every step
    stream_outputs: bool = True
    # Mixed into the prefix-cache hash, so only requests with the same salt share blocks.
    cache_salt: str | None = None
    # The LoRA adapter this request runs with (None: the base model); also mixed into the
    # prefix-cache hash: KV computed under one adapter is never reused under another.
    lora_request: LoRARequest | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Under the priority scheduling policy: lower values are admitted first (vLLM's rule).
    priority: int = 0
    # Disaggregated serving: a context-only request's KV blocks outlive it under this id,
    # for a generation server to fetch; a generation-only request starts from KV fetched
    # from a context server, written into its blocks when it is admitted.
    kv_export_id: str | None = None
    kv_import: ImportedKV | None = None
    # Images of a vision-language model's prompt (their placeholders are in the prompt)
    multimodal: MultimodalInputs | None = None
    # A pooling request (embedding, score, classification): it computes its prompt, its
    # final hidden states pooled into `pooled` (on the device), and ends with its last
    # prompt chunk; it samples nothing. `token_type_ids`: a BERT-style pair's segments.
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None
    pooled: torch.Tensor | None = None

    token_ids: list[int] = field(init=False)
    num_in_flight: int = 0
    num_computed_tokens: int = 0
    state: RequestState = RequestState.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    error: Exception | None = None
    # Speculative decoding: the drafts this step verifies after token_ids (the scheduler may
    # shorten them to its budget or drop them), and their draft distribution [K, V] when the
    # drafter sampled them (None: one-hot drafts).
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """Tokens that end the request (once past min_tokens): its stop token ids and, unless
        it ignores EOS, the EOS ids."""
        params = self.sampling_params
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return frozenset(params.stop_token_ids) | eos

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and outputs, those still on the device included."""
        return len(self.token_ids) + self.num_in_flight

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def is_prompt_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    def clear_drafts(self) -> None:
        self.draft_token_ids = []
        self.draft_probs = None

    def append_token(self, token_id: int) -> None:
        """A new output token the host knows (not one announced by mark_sampled)."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.token_ids.append(token_id)

    def mark_sampled(self) -> None:
        """A token was sampled on the device; receive_token brings it to the host."""
        self.num_in_flight += 1

    def receive_token(self, token_id: int) -> None:
        """The host now knows the oldest token sampled on the device."""
        self.num_in_flight -= 1
        self.append_token(token_id)

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.num_in_flight = 0  # sampled, never delivered
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.monotonic()
        # last: another thread that reads the request as finished (a delta's builder) then
        # finds its finish time and reason set
        self.state = RequestState.FINISHED
