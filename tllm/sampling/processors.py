"""Batched logits processors: every function takes [rows, vocab] logits and per-row
parameter tensors, so one call serves a batch with mixed settings. Their rules follow
HF transformers' logits processors (the reference in tests) and OpenAI's penalty definition."""
from __future__ import annotations

import torch


def token_mask(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[rows, vocab] bool, True where the row's list holds the token."""
    counts = token_counts(token_lists, vocab_size, device)
    return counts > 0


def token_counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[rows, vocab] float, how often each token occurs in the row's list."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), max(width, 1)), vocab_size, dtype=torch.long)
    for row, tokens in enumerate(token_lists):
        padded[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones_like(padded, dtype=counts.dtype,
                                                               device=device))
    return counts[:, :vocab_size]


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor,
                             penalty: torch.Tensor) -> torch.Tensor:
    """HF's rule on every token seen in prompt or output: negative logits are multiplied by
    the penalty, positive ones divided by it."""
    p = penalty[:, None]
    penalised = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency_penalty(logits: torch.Tensor, output_counts: torch.Tensor,
                                     presence: torch.Tensor,
                                     frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI's rule over the generated tokens: logit -= count * frequency + (count > 0) *
    presence."""
    return (logits - frequency[:, None] * output_counts
            - presence[:, None] * (output_counts > 0).to(logits.dtype))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep logits >= the k-th largest (ties kept, as HF does); top_k >= vocab keeps all."""
    k = top_k.clamp(1, logits.shape[-1])
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the most likely tokens whose mass first reaches top_p (always at least one)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p[:, None])
    remove_sorted[:, -1] = False
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))
