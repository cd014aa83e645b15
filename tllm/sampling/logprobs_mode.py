"""Which distribution a request's logprobs report (SamplingParams.logprobs_mode): the
model's raw one, the tempered one (processors and temperature), or the processed one the
token was drawn from (the top-k / top-p / min-p filters too). A trainer computing the
importance ratio of its rollouts needs the last; vLLM's names."""
from __future__ import annotations

import numpy as np
import torch

from tllm.request import Request
from tllm.sampling import processors as P
from tllm.sampling.rows import SamplingRows


def filtered_logits(logits: torch.Tensor, rows: SamplingRows, index: torch.Tensor | None,
                    temperature: torch.Tensor | None = None,
                    filters: bool = True) -> torch.Tensor:
    """Temperature, then (with `filters`) top-k, top-p and min-p, on `logits` (the rows
    `index` of the call; None: all). `temperature`: in place of the rows' own."""
    def pick(values: torch.Tensor | None) -> torch.Tensor | None:
        return values if values is None or index is None else values[index]
    logits = logits / (pick(rows.temperature) if temperature is None else temperature)[:, None]
    if not filters:
        return logits
    if rows.top_k is not None:
        logits = P.apply_top_k(logits, pick(rows.top_k))
    if rows.top_p is not None:
        logits = P.apply_top_p(logits, pick(rows.top_p))
    if rows.min_p is not None:
        logits = P.apply_min_p(logits, pick(rows.min_p))
    return logits


def reported_logprobs(raw: torch.Tensor, processed: torch.Tensor, rows: SamplingRows,
                      requests: list[Request]) -> torch.Tensor:
    """The logprobs each row reports: `raw` (the model's log_softmax) where the request's
    mode is raw_logprobs, else recomputed from `processed` (the logits after bias,
    penalties and masks) with its temperature (1 for greedy rows) and, for
    processed_logprobs, its filters."""
    modes = [r.sampling_params.logprobs_mode for r in requests]
    if all(m == "raw_logprobs" for m in modes):
        return raw
    out = raw.clone()
    temperature = torch.where(torch.from_numpy(rows.greedy).to(raw.device), 1.0,
                              rows.temperature)
    for mode, filters in (("tempered_logprobs", False), ("processed_logprobs", True)):
        chosen = np.flatnonzero([m == mode for m in modes])
        if not len(chosen):
            continue
        index = torch.from_numpy(chosen).to(raw.device)
        logits = filtered_logits(processed[index], rows, index, temperature[index], filters)
        out[index] = logits.log_softmax(dim=-1)
    return out
