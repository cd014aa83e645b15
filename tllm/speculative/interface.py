"""The drafter interface: what proposes speculative tokens for the target to verify.

A drafter (n-gram lookup, a draft model, an EAGLE-3 head) is a resource manager (its own
per-request state, e.g. a draft model's paged KV cache, lives behind `prepare/update/free`)
that proposes up to `max_draft_len` tokens per request. The loop, each step:

1. `propose(requests, max_draft_lens)` for the running requests that decode next step
   (every known token but the last computed); a draft may be shorter than asked, or empty;
2. the scheduler gives each request 1 + len(draft) tokens, the target scores them in one
   forward (logits at every scheduled position of a speculating request);
3. acceptance (tllm.speculative.acceptance) keeps the longest valid prefix plus one token;
   the scheduler rolls back `num_computed_tokens` (and the KV blocks past it) for the rest;
4. `on_verified(result)` tells the drafter what was accepted, with the target's hidden states
   of `hidden_state_layers` when it asked for any (EAGLE-3), so it can propose again.

Speculation runs the SYNC loop strategy (each step's tokens reach the host before the next is
scheduled). The engine builds the drafter from `LlmArgs.speculative_config`:
NGramDecodingConfig -> `tllm.speculative.ngram.NGramDrafter(config)`;
DraftTargetDecodingConfig -> `tllm.speculative.draft_model.build_drafter(config, parts)` and
EagleDecodingConfig -> `tllm.speculative.eagle3.build_drafter(config, parts)`, where `parts`
is the target's `tllm.runner.build.RankParts` (model, KV cache, device, dtype, source).
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field

import torch
from torch import nn

from tllm.request import Request
from tllm.scheduler.interface import ResourceManager


@dataclass
class Drafts:
    """What `propose` returns, one entry per request in the order asked.

    `token_ids[i]` has at most the asked length for request i (empty: no speculation for it
    this step). `probs`, when the drafter sampled from a distribution, is [N, K, V] float
    (K = the longest draft; rows past a draft's end are ignored); None means one-hot drafts
    (n-gram lookup, greedy draft models), which the rejection-sampling rule also covers."""

    token_ids: list[list[int]]
    probs: torch.Tensor | None = None


@dataclass
class VerifyResult:
    """One verify step as the drafter sees it, after acceptance.

    For each request: the tokens the target computed this step (`num_scheduled` of them,
    starting at `first_position`), how many of its drafts were accepted (`num_accepted`), and
    the tokens it gained (`new_token_ids`: the accepted drafts then the correction or bonus
    token). `hidden_states`, only when the drafter names `hidden_state_layers`: the target's
    hidden states of those layers (each layer's output, residual added, as HF's
    `output_hidden_states` gives them at index layer + 1), concatenated on the last dim in
    the order named, one row per scheduled token: [sum(num_scheduled), len(layers) * H];
    request i's rows start at `row_starts[i]`."""

    requests: list[Request]
    first_positions: list[int]
    num_scheduled: list[int]
    num_accepted: list[int]
    new_token_ids: list[list[int]]
    row_starts: list[int] = field(default_factory=list)
    hidden_states: torch.Tensor | None = None


class Drafter(ResourceManager):
    """Proposes draft tokens for a batch of requests (see the module docstring for when)."""

    def __init__(self, max_draft_len: int) -> None:
        if max_draft_len < 1:
            raise ValueError(f"max_draft_len must be at least 1, got {max_draft_len}")
        self.max_draft_len = max_draft_len

    @property
    def hidden_state_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states `on_verified` receives (none by default: the
        runner then collects nothing)."""
        return ()

    @abstractmethod
    def propose(self, requests: list[Request], max_draft_lens: list[int]) -> Drafts:
        """Up to `max_draft_lens[i]` (>= 1) draft tokens for each request, which follow its
        `token_ids` (all known, no placeholders)."""

    def on_verified(self, result: VerifyResult) -> None:
        """After every step's acceptance, for every request the step computed (prefill
        chunks included, with no drafts; a chunk that does not end the prompt gains no
        tokens)."""

    def free(self, request: Request) -> None:
        """The request has ended: drop any state kept for it."""

    # ---- RL rollouts (tllm.runner.rank_rollout): sleep, wake, new target weights ----

    def own_module(self) -> nn.Module | None:
        """The module whose weights sleep moves with the target's (modules it shares with
        the target are the target's: moved once); None for a drafter without one."""
        return None

    @property
    def kv_cache(self):
        """Its own KVCacheManager, freed on sleep like the target's (None: it has none)."""
        return None

    def takes_target_weight(self, name: str) -> bool:
        """Whether a tensor of the target's checkpoint is also this drafter's own weight
        (DeepSeek's MTP module), which `update_weights` then gets too."""
        return False

    def update_weights(self, tensors: list[tuple[str, torch.Tensor]],
                       dtype: torch.dtype) -> None:
        """New weights for what `takes_target_weight` named (not called otherwise)."""
