"""How a pooling request (embed, score, classify) turns the model's hidden states into its
answer, as SamplingParams says how a generation request samples."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    task: str                       # "embed" | "score" | "classify"
    dimensions: int | None = None   # Matryoshka truncation (embed); ValueError naming
                                    # `dimensions` if > the model's embedding size or < 1
    normalize: bool | None = None   # None: the model's default (sentence-transformers Normalize)
    truncate_prompt_tokens: int | None = None
