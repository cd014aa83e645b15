"""Expert load statistics (EPLB-style): how many tokens each MoE layer has routed to each
expert since start, to find hot experts and judge an expert-parallel placement (what
DeepSeek's EPLB balances). Off by default (`LlmArgs(moe_load_stats=True)`): it costs one
small index_add per MoE layer and step.

Counting stays on the device and inside CUDA graphs: each MoE layer adds its step's top-k
expert ids into its row of one [layers, experts] counter, masked to the step's real tokens
(`valid_tokens`, set before every forward: a graph's padding rows route stale inputs and
must not count, and warm-ups before the first step count nothing). `snapshot` copies the
counter to the host, so reading it waits for the steps in flight."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn


class ExpertLoad:
    def __init__(self, layers: list[nn.Module], device: torch.device) -> None:
        self.num_experts = [layer.num_experts for layer in layers]
        self.counts = torch.zeros(len(layers), max(self.num_experts), dtype=torch.int64,
                                  device=device)
        self.valid_tokens = torch.zeros((), dtype=torch.int64, device=device)
        for row, layer in enumerate(layers):
            layer.expert_load_hook = partial(self.record, row)

    @classmethod
    def attach(cls, model: nn.Module, device: torch.device) -> "ExpertLoad":
        """Count for every MoE layer of `model`: the modules with `num_experts` and an
        `expert_load_hook` they call with each forward's top-k ids (FusedMoE, Nemotron-H's
        experts). ValueError: it has none."""
        layers = [m for m in model.modules() if hasattr(m, "expert_load_hook")]
        if not layers:
            raise ValueError("moe_load_stats: the model has no mixture-of-experts layers")
        return cls(layers, device)

    def begin_step(self, num_tokens: int) -> None:
        """The next forward's first `num_tokens` rows are the step's (the rest: padding)."""
        self.valid_tokens.fill_(num_tokens)

    def record(self, row: int, topk_ids: torch.Tensor) -> None:
        ids = topk_ids.reshape(topk_ids.shape[0], -1)
        real = torch.arange(ids.shape[0], device=ids.device) < self.valid_tokens
        self.counts[row].index_add_(0, ids.flatten(),
                                    real[:, None].expand_as(ids).flatten().to(torch.int64))

    def snapshot(self) -> dict[str, object]:
        """`moe_expert_load`: tokens routed to each expert, a list per MoE layer;
        `moe_load_balancedness`: the mean over layers of mean / max tokens per expert (1.0:
        perfectly even; EPLB's measure)."""
        counts = [row[:n] for row, n in zip(self.counts.tolist(), self.num_experts)]
        ratios = [sum(row) / len(row) / max(row) for row in counts if max(row) > 0]
        return {"moe_expert_load": counts,
                "moe_load_balancedness": sum(ratios) / len(ratios) if ratios else 1.0}
