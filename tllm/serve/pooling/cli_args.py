"""`tllm serve`'s pooling flags: the task to serve the model for, and the cap on one
request's inputs."""
from __future__ import annotations

import argparse
from typing import Any

from tllm.cli_types import non_negative_int

TASKS = ("generate", "embed", "score", "classify")


def add_pooling_args(group) -> None:
    group.add_argument("--task", choices=TASKS,
                       help="what the server answers: generate (/v1/completions, chat, "
                            "responses), embed (/v1/embeddings; /v1/score and /v1/rerank by "
                            "cosine), score (a cross-encoder: /v1/score, /v1/rerank) or "
                            "classify; other routes answer 400 (default: the model's own)")
    group.add_argument("--max-pooling-inputs", type=non_negative_int, default=2048,
                       help="answer 400 to an embeddings, score or rerank request of more "
                            "inputs or documents than this (default 2048, as OpenAI's; 0 "
                            "means no limit)")


def pooling_llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The LLM argument --task sets (none unless given: the model decides)."""
    task = getattr(args, "task", None)
    return {} if task is None else {"task": task}


def max_pooling_inputs(args: argparse.Namespace) -> int | None:
    return getattr(args, "max_pooling_inputs", 2048) or None
