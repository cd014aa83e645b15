"""An engine double of a pooling model (FakePoolingLLM), for tests of the pooling routes that
need no model: deterministic vectors from the token ids, the engine's pooling API and its
ValueErrors."""
from __future__ import annotations

import asyncio
import math

from tllm.outputs import PoolingRequestOutput
from tllm.pooling_params import PoolingParams
from tllm.serve.testing import FakeLLM

POOLING_TASKS = ("embed", "score", "classify")


class FakePoolingLLM(FakeLLM):
    """A pooling model over FakeLLM's byte tokenizer. embed: a unit vector of
    `embedding_size` cosines of the token ids (truncated to `dimensions`, then normalised
    again); score (a cross-encoder): the share of the query's distinct bytes the document
    holds, so a document that repeats the query scores 1; classify: two probabilities
    (`labels` their names; None: a model that names none).
    `max_in_flight` counts the most encode calls that were running at once; with `delay_s`,
    each takes that long, and `num_cancelled` counts those cancelled meanwhile."""

    def __init__(self, task: str = "embed", embedding_size: int = 8, max_seq_len: int = 512,
                 vocab_size: int = 256, delay_s: float = 0.0,
                 labels: tuple[str, ...] | None = ("no", "yes")) -> None:
        if task not in POOLING_TASKS:
            raise ValueError(f"task: one of {POOLING_TASKS}, got {task!r}")
        super().__init__(max_seq_len=max_seq_len)
        self.task = task
        self.vocab_size = vocab_size
        self.pooling_info = {"embedding_size": embedding_size if task == "embed" else None,
                             "labels": (list(labels) if task == "classify" and labels
                                        else None)}
        self.delay_s = delay_s
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.num_cancelled = 0
        self._num_requests = 0

    def generate_async(self, inputs: dict, params, streaming: bool = False):
        raise ValueError(f"task: this model runs {self.task!r}; it does not generate")

    async def encode_async(self, prompt, params: PoolingParams,
                           request_id: str | None = None) -> PoolingRequestOutput:
        if params.task != self.task:
            raise ValueError(f"task: this model runs {self.task!r}, not {params.task!r}")
        token_ids = self._token_ids(prompt)
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            await asyncio.sleep(self.delay_s)   # the others of a batch come in meanwhile
            data = self._pooled(prompt, token_ids, params)
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise
        finally:
            self.num_in_flight -= 1
        self._num_requests += 1
        return PoolingRequestOutput(request_id or f"pool-{self._num_requests}", token_ids, data)

    async def score_async(self, query: str, documents: list[str]) -> list[PoolingRequestOutput]:
        if self.task not in ("score", "embed"):
            raise ValueError(f"task: this model runs {self.task!r}, not 'score'")
        if self.task == "embed":
            params = PoolingParams(task="embed")
            first, *others = await asyncio.gather(
                *(self.encode_async(text, params) for text in [query, *documents]))
            return [PoolingRequestOutput(other.request_id,
                                         first.prompt_token_ids + other.prompt_token_ids,
                                         [_dot(first.data, other.data)]) for other in others]
        params = PoolingParams(task="score")
        return list(await asyncio.gather(
            *(self.encode_async((query, doc), params) for doc in documents)))

    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, tuple):
            return self.tokenizer.encode(prompt[0]) + self.tokenizer.encode(prompt[1])
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)
        if not token_ids or min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"inputs: token ids must be in [0, {self.vocab_size})")
        if len(token_ids) > self.max_seq_len:
            raise ValueError(f"inputs: {len(token_ids)} tokens, more than max_seq_len")
        return token_ids

    def _pooled(self, prompt, token_ids: list[int], params: PoolingParams) -> list[float]:
        if params.task == "score":
            query, document = (set(text.encode()) for text in prompt)
            return [len(query & document) / max(1, len(query))]
        if params.task == "classify":
            yes = (sum(token_ids) % 100) / 100
            return [1 - yes, yes]
        size = self.pooling_info["embedding_size"]
        dimensions = size if params.dimensions is None else params.dimensions
        if not 1 <= dimensions <= size:
            raise ValueError(f"dimensions: must be in [1, {size}], got {dimensions}")
        vector = fake_embedding(token_ids, size)[:dimensions]
        return vector if params.normalize is False else _unit(vector)


def fake_embedding(token_ids: list[int], size: int) -> list[float]:
    """The fake's unit vector of some token ids (tests compare the server's answers to it)."""
    return _unit([sum(math.cos((t + 1) * (j + 1)) for t in token_ids) for j in range(size)])


def _unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))
