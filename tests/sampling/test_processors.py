"""The batched logits processors against HF transformers' logits processors (and OpenAI's
presence/frequency penalty written out by hand). Each batch mixes per-row parameters; every
row must equal the reference applied to that row alone."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tllm.sampling import processors as P

VOCAB = 257


def random_logits(seed: int, rows: int = 4, vocab: int = VOCAB, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def random_token_lists(seed: int, lengths: list[int], vocab: int = VOCAB) -> list[list[int]]:
    """Token lists with repeats (small id range) so counts above one occur."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab // 4, (n,), generator=g).tolist() for n in lengths]


def hf_row(processor, row: torch.Tensor, input_ids: list[int] | None = None) -> torch.Tensor:
    ids = torch.tensor([input_ids if input_ids is not None else [0]], dtype=torch.long)
    return processor(ids, row[None, :].clone())[0]


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal filtered positions (-inf) and equal surviving values."""
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


# ---- token bookkeeping ------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_token_counts_and_mask(seed):
    lists = random_token_lists(seed, [0, 1, 9, 40])
    counts = P.token_counts(lists, VOCAB, "cpu")
    mask = P.token_mask(lists, VOCAB, "cpu")
    assert counts.shape == mask.shape == (4, VOCAB)
    for row, tokens in enumerate(lists):
        expected = torch.zeros(VOCAB)
        for token, count in Counter(tokens).items():
            expected[token] = count
        assert torch.equal(counts[row], expected)
        assert torch.equal(mask[row], expected > 0)


# ---- repetition penalty -----------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_repetition_penalty_matches_hf(seed):
    logits = random_logits(seed)
    penalties = [0.5, 1.0, 1.3, 2.0]
    prompts = random_token_lists(seed + 10, [7, 1, 12, 30])
    outputs = random_token_lists(seed + 20, [5, 0, 3, 20])
    token_lists = [p + o for p, o in zip(prompts, outputs)]
    seen = P.token_mask(token_lists, VOCAB, "cpu")
    out = P.apply_repetition_penalty(logits, seen, torch.tensor(penalties))
    for row, (penalty, ids) in enumerate(zip(penalties, token_lists)):
        expected = hf_row(RepetitionPenaltyLogitsProcessor(penalty), logits[row], ids)
        assert_same(out[row], expected)
    # Both signs of logit were penalised somewhere, so both branches of the rule ran.
    touched = seen & (out != logits)
    assert (logits[touched] > 0).any() and (logits[touched] < 0).any()


# ---- presence / frequency penalty -------------------------------------------------------


def openai_penalty(row: torch.Tensor, output_ids: list[int], presence: float,
                   frequency: float) -> torch.Tensor:
    """logit[j] - c[j] * frequency - (c[j] > 0) * presence, c = counts in the output."""
    expected = row.clone()
    for token, count in Counter(output_ids).items():
        expected[token] = row[token] - count * frequency - float(count > 0) * presence
    return expected


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_presence_frequency_penalty_matches_openai_formula(seed):
    logits = random_logits(seed)
    presence = [0.0, 0.7, -1.5, 2.0]
    frequency = [0.4, 0.0, 1.1, -2.0]
    outputs = random_token_lists(seed + 30, [6, 15, 0, 40])
    counts = P.token_counts(outputs, VOCAB, "cpu")
    out = P.apply_presence_frequency_penalty(logits, counts, torch.tensor(presence),
                                             torch.tensor(frequency))
    for row in range(4):
        expected = openai_penalty(logits[row], outputs[row], presence[row], frequency[row])
        torch.testing.assert_close(out[row], expected, rtol=0, atol=1e-5)


# ---- temperature ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_temperature_matches_hf(seed):
    logits = random_logits(seed)
    temperatures = [0.05, 0.7, 1.0, 2.5]
    # The sampler applies temperature as one batched division by a per-row tensor.
    out = logits / torch.tensor(temperatures)[:, None]
    for row, t in enumerate(temperatures):
        assert_same(out[row], hf_row(TemperatureLogitsWarper(t), logits[row]))


# ---- top-k ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("top_ks", [[1, 5, 50, VOCAB], [2, 2, 2, 2], [VOCAB - 1, 17, 3, 400]])
def test_top_k_matches_hf(seed, top_ks):
    logits = random_logits(seed)
    out = P.apply_top_k(logits, torch.tensor(top_ks))
    for row, k in enumerate(top_ks):
        assert_same(out[row], hf_row(TopKLogitsWarper(k), logits[row]))
        assert int((~out[row].isinf()).sum()) == min(k, VOCAB)


def test_top_k_keeps_ties_like_hf():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 16, generator=g).repeat(1, 8)  # every value occurs 8 times
    top_ks = [1, 3, 9, 20]
    out = P.apply_top_k(logits, torch.tensor(top_ks))
    for row, k in enumerate(top_ks):
        assert_same(out[row], hf_row(TopKLogitsWarper(k), logits[row]))
        assert int((~out[row].isinf()).sum()) % 8 == 0  # a tie group is never split


# ---- top-p ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("top_ps", [[0.05, 0.5, 0.9, 1.0], [0.3, 0.3, 0.3, 0.3],
                                    [0.999, 0.75, 0.2, 0.62]])
def test_top_p_matches_hf(seed, top_ps):
    logits = random_logits(seed)
    out = P.apply_top_p(logits, torch.tensor(top_ps))
    for row, p in enumerate(top_ps):
        assert_same(out[row], hf_row(TopPLogitsWarper(p), logits[row]))
        assert not out[row].isinf().all()


def test_top_p_one_keeps_everything_and_tiny_keeps_the_top_token():
    logits = random_logits(5)
    top_ps = [1.0, 1.0, 1e-6, 1e-9]  # 1 - 1e-9 rounds to 1.0: only the keep-one rule saves
    out = P.apply_top_p(logits, torch.tensor(top_ps))
    assert torch.equal(out[:2], logits[:2])
    for row in (2, 3):
        kept = (~out[row].isinf()).nonzero().flatten().tolist()
        assert kept == [int(logits[row].argmax())]
        assert_same(out[row], hf_row(TopPLogitsWarper(top_ps[row]), logits[row]))


def test_top_p_matches_hf_on_peaked_logits():
    """Probabilities that underflow to exactly 0 and a top token holding exactly 1.0 hit the
    boundaries of the rule: the `<=` comparison and the keep-at-least-one guard."""
    logits = random_logits(6, scale=100.0)
    top_ps = [1.0, 1e-9, 0.5, 0.999999]
    assert (logits.softmax(dim=-1) == 0).any(dim=-1).all()
    out = P.apply_top_p(logits, torch.tensor(top_ps))
    for row, p in enumerate(top_ps):
        assert_same(out[row], hf_row(TopPLogitsWarper(p), logits[row]))
        assert not out[row].isinf().all()


# ---- min-p ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("min_ps", [[0.0, 0.05, 0.3, 1.0], [0.1, 0.1, 0.1, 0.1],
                                    [0.9, 0.02, 0.5, 0.2]])
def test_min_p_matches_hf(seed, min_ps):
    logits = random_logits(seed)
    out = P.apply_min_p(logits, torch.tensor(min_ps))
    for row, p in enumerate(min_ps):
        assert_same(out[row], hf_row(MinPLogitsWarper(p), logits[row]))


def test_min_p_keeps_ties_like_hf():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 32, generator=g).repeat(1, 4)
    min_ps = [0.05, 0.2, 0.6, 1.0]
    out = P.apply_min_p(logits, torch.tensor(min_ps))
    for row, p in enumerate(min_ps):
        assert_same(out[row], hf_row(MinPLogitsWarper(p), logits[row]))


# ---- the warper chain -------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chain_matches_hf_warpers_in_order(seed):
    """temperature -> top_k -> top_p -> min_p, in one batch with per-row settings."""
    logits = random_logits(seed, rows=5)
    temperatures = [0.6, 1.0, 1.7, 0.9, 1.2]
    top_ks = [VOCAB, 20, 60, 5, VOCAB]  # VOCAB = disabled
    top_ps = [0.9, 1.0, 0.8, 0.95, 1.0]
    min_ps = [0.05, 0.1, 0.0, 0.0, 0.0]
    out = logits / torch.tensor(temperatures)[:, None]
    out = P.apply_top_k(out, torch.tensor(top_ks))
    out = P.apply_top_p(out, torch.tensor(top_ps))
    out = P.apply_min_p(out, torch.tensor(min_ps))
    for row in range(5):
        expected = logits[row][None, :].clone()
        ids = torch.zeros(1, 1, dtype=torch.long)
        for proc in (TemperatureLogitsWarper(temperatures[row]), TopKLogitsWarper(top_ks[row]),
                     TopPLogitsWarper(top_ps[row]), MinPLogitsWarper(min_ps[row])):
            expected = proc(ids, expected)
        assert_same(out[row], expected[0])
