"""What the LLM API returns: one RequestOutput per prompt, one CompletionOutput per sample."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token; rank 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence. text and token_ids are cumulative; the *_diff fields hold
    what is new since the previous streamed update."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_diff: str = ""
    token_ids_diff: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result (or a streamed snapshot) of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class CompletionDelta:
    """What is new in one generated sequence since its previous delta.

    The engine builds one per update of a sequence, once (on the executor thread), and hands
    it over unchanged: `GenerationResult.deltas()` yields these as they come, and the cumulative
    RequestOutputs of `await` / `async for` are folded from them on the caller's side. The
    final delta of a sequence has `finish_reason` set (and `error`, if the engine failed it).
    """

    index: int                                    # the sample index within its prompt
    token_ids: list[int]
    text: str
    logprobs: list[PositionLogprobs] | None = None    # None unless logprobs were asked for
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None       # with the final delta, if logprobs asked
    # The prompt's logprobs, once per prompt: with sample 0's first delta after its prompt.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: Exception | None = None
    metrics: dict[str, float] = field(default_factory=dict)    # with the final delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PoolingRequestOutput:
    """The result of one pooling request: an embedding, one probability per label, or a
    score, as plain floats in `data`."""

    request_id: str
    prompt_token_ids: list[int]
    data: list[float]

    @property
    def embedding(self) -> list[float]:
        return self.data

    @property
    def probs(self) -> list[float]:
        return self.data

    @property
    def score(self) -> float:
        return self.data[0]
