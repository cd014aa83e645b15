"""PoolingParams: what a pooling request (embedding, score, classification) returns instead
of sampled tokens."""
from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "score", "classify")
TASKS = ("generate", *POOLING_TASKS)


@dataclass
class PoolingParams:
    """How one prompt's final hidden states become its output.

    `task`: "embed" (a vector), "score" (one relevance score of a pair, or of a prompt under
    a reranker's rule) or "classify" (one probability per label). `dimensions`: keep the
    first this many values of an embedding (Matryoshka), normalised after the cut.
    `normalize`: L2-normalise the embedding (None: the model's default). Token counts past
    `truncate_prompt_tokens` are cut from the prompt's start (None: no cut)."""

    task: str
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, "
                             f"got {self.task!r}")
        if self.dimensions is not None:
            if not _is_int(self.dimensions) or self.dimensions < 1:
                raise ValueError(f"dimensions must be a positive int, got {self.dimensions!r}")
            if self.task != "embed":
                raise ValueError("dimensions applies to embeddings only (task 'embed')")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool or None, got {self.normalize!r}")
        if self.truncate_prompt_tokens is not None and (
                not _is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < 1):
            raise ValueError("truncate_prompt_tokens must be a positive int, got "
                             f"{self.truncate_prompt_tokens!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


POOLING_TYPES = ("last", "cls", "mean")


@dataclass(frozen=True)
class PoolerConfig:
    """How a model's hidden states become its pooling outputs: which token(s) it pools,
    whether embeddings are L2-normalised by default, whether a score passes a sigmoid.
    From the sentence-transformers layout where the model folder has one, else the
    architecture's defaults."""

    pooling_type: str = "last"
    normalize: bool = True
    score_sigmoid: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling_type!r}")
