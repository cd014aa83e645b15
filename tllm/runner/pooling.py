"""Pooling requests' part of a step (rank 0): which rows of the step's final hidden states
belong to each pooling request, and the pooler that turns them into its output.

A pooling request computes its prompt like any other (in chunks under the token budget,
for a causal model) and samples nothing: its rows are taken out of the step's sample rows.
After the forward, the pooler reads the hidden states of its rows: the last prompt token's
("last"), the first's ("cls") or their mean over every chunk ("mean", summed chunk by
chunk), applies the model's head if it has one (a classifier's, a reranker's), then the
request's rule: Matryoshka cut and L2 norm (embed), softmax (classify), sigmoid (score).
A step without pooling requests never comes here."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tllm.pooling_params import PoolerConfig
from tllm.request import Request
from tllm.scheduler.interface import ResourceManager


@dataclass
class PoolingSegment:
    """One pooling request's rows in this step."""
    request: Request
    first_row: int
    num_rows: int
    first_position: int     # the prompt position of its first row
    is_last_chunk: bool     # its prompt ends in this step: its output is ready after it


@dataclass
class StepPooling:
    segments: list[PoolingSegment]
    # [num_tokens] segment ids of a BERT-style pair, where a request of the step has them
    token_type_ids: np.ndarray | None = None


def pooling_segments(requests: list[Request], is_pooling: np.ndarray, starts: np.ndarray,
                     ends: np.ndarray, first_rows: np.ndarray,
                     num_tokens: int) -> StepPooling:
    """The step's pooling requests (`is_pooling`, per request) and their rows."""
    segments = [PoolingSegment(requests[i], int(first_rows[i]), int(ends[i] - starts[i]),
                               int(starts[i]), int(ends[i]) >= requests[i].num_prompt_tokens)
                for i in np.flatnonzero(is_pooling)]
    types = None
    if any(s.request.token_type_ids is not None for s in segments):
        types = np.zeros(num_tokens, dtype=np.int64)
        for s in segments:
            if s.request.token_type_ids is not None:
                start = s.first_position
                types[s.first_row:s.first_row + s.num_rows] = \
                    s.request.token_type_ids[start:start + s.num_rows]
    return StepPooling(segments, types)


class Pooler(ResourceManager):
    """Pools the hidden states of a step's pooling requests; keeps what a request's earlier
    chunks contributed (its partial sum, its first token's state) until its last."""

    def __init__(self, model: torch.nn.Module, config: PoolerConfig, head=None) -> None:
        self.model = model
        self.config = config
        # pooled states -> scores / label logits (None: embeddings only)
        self.head = head if head is not None else getattr(model, "pooling_head", None)
        self._partial: dict[str, torch.Tensor] = {}

    def pool(self, hidden: torch.Tensor, step: StepPooling) -> list[tuple[Request, torch.Tensor]]:
        """(request, output [D] float32, on the device) for each request whose prompt
        ends in this step."""
        done, states = [], []
        for segment in step.segments:
            state = self._accumulate(hidden, segment)
            if segment.is_last_chunk:
                done.append(segment.request)
                states.append(state)
        if not done:
            return []
        pooled = list(torch.stack(states).float())
        heads = [i for i, r in enumerate(done) if r.pooling_params.task != "embed"]
        if heads:  # a classifier's or reranker's head (embeddings are the states)
            scored = self.head(torch.stack(states)[heads]).float()
            for i, row in zip(heads, scored):
                pooled[i] = row
        return [(r, self._finish(r, row)) for r, row in zip(done, pooled)]

    def _accumulate(self, hidden: torch.Tensor, segment: PoolingSegment) -> torch.Tensor:
        rows = hidden[segment.first_row:segment.first_row + segment.num_rows]
        key = segment.request.request_id
        kind = self.config.pooling_type
        if kind == "last":
            return rows[-1]
        if kind == "cls":
            if segment.first_position == 0:  # (a copy: graphs reuse the hidden buffer)
                self._partial[key] = rows[0].clone()
            return self._partial.pop(key) if segment.is_last_chunk else rows[0]
        total = rows.float().sum(0)  # mean: summed chunk by chunk
        if segment.first_position == 0:  # (again, after a preemption)
            self._partial.pop(key, None)
        if key in self._partial:
            total = total + self._partial.pop(key)
        if not segment.is_last_chunk:
            self._partial[key] = total
            return total
        return (total / segment.request.num_prompt_tokens).to(hidden.dtype)

    def _finish(self, request: Request, values: torch.Tensor) -> torch.Tensor:
        params = request.pooling_params
        if params.task == "classify":
            return torch.sigmoid(values) if values.numel() == 1 else values.softmax(-1)
        if params.task == "score":
            return torch.sigmoid(values[:1]) if self.config.score_sigmoid else values[:1]
        if params.dimensions is not None:
            values = values[:params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        return F.normalize(values, dim=-1) if normalize else values

    def free(self, request: Request) -> None:
        self._partial.pop(request.request_id, None)


class YesNoHead:
    """Qwen3-Reranker's rule for a causal LM: a (templated) pair's score is P("yes") of
    {"yes", "no"} after its last token, sigmoid(logit_yes - logit_no): this head gives
    that difference."""

    def __init__(self, model: torch.nn.Module, yes_id: int, no_id: int) -> None:
        self.model = model
        self.ids = [yes_id, no_id]

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(pooled)[:, self.ids]
        return logits[:, :1] - logits[:, 1:]
