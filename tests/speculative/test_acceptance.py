"""Acceptance of draft tokens: greedy (the longest prefix equal to the target's argmax) and
rejection sampling, whose output must follow the target's distribution exactly.

The statistical tests use fixed seeds and a chi-square goodness-of-fit test: a correct rule
fails each check with probability 1e-3 over seeds (the threshold); the negative controls show
the same test rejects the draft distribution outright."""
from __future__ import annotations

import pytest
import torch

from tllm.speculative.acceptance import PAD_TOKEN, accept_greedy, accept_sampled

VOCAB = 6
NUM_SAMPLES = 50_000
P_VALUE_THRESHOLD = 1e-3


def _logits_with_argmax(argmax_rows: list[list[int]], vocab: int = 8) -> torch.Tensor:
    """Random logits [N, K+1, V] whose argmax at each position is the given token."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(argmax_rows), len(argmax_rows[0]), vocab, generator=generator)
    index = torch.tensor(argmax_rows)[:, :, None]
    return logits.scatter(2, index, 10.0)


def _greedy_reference(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor):
    """Row by row, as the rule reads."""
    target = logits.argmax(dim=-1).tolist()
    outputs, accepted = [], []
    for i, n in enumerate(num_drafts.tolist()):
        a = 0
        while a < n and drafts[i, a].item() == target[i][a]:
            a += 1
        outputs.append(target[i][:a + 1] + [PAD_TOKEN] * (drafts.shape[1] - a))
        accepted.append(a)
    return torch.tensor(outputs), torch.tensor(accepted)


def test_greedy_prefix_then_correction_or_bonus():
    logits = _logits_with_argmax([[3, 5, 1, 7], [3, 5, 1, 7], [3, 5, 1, 7], [3, 5, 1, 7]])
    drafts = torch.tensor([[3, 5, 2], [3, 5, 1], [4, 5, 1], [3, 5, 1]])
    num_drafts = torch.tensor([3, 3, 3, 0])
    output, num_accepted = accept_greedy(logits, drafts, num_drafts)
    assert num_accepted.tolist() == [2, 3, 0, 0]
    assert output.tolist() == [[3, 5, 1, PAD_TOKEN],     # correction at the third draft
                               [3, 5, 1, 7],             # all accepted: the bonus token
                               [3, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN],  # first rejected
                               [3, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN]]  # no drafts


def test_greedy_ignores_padded_drafts():
    logits = _logits_with_argmax([[3, 5, 1, 7], [2, 2, 2, 2]])
    drafts = torch.tensor([[3, 5, 1], [2, -1, -1]])  # row 0 matches past its one draft
    output, num_accepted = accept_greedy(logits, drafts, torch.tensor([1, 1]))
    assert num_accepted.tolist() == [1, 1]
    assert output.tolist() == [[3, 5, PAD_TOKEN, PAD_TOKEN], [2, 2, PAD_TOKEN, PAD_TOKEN]]


def test_greedy_ties_go_to_lowest_id_as_without_speculation():
    logits = torch.zeros(1, 2, 8)
    logits[0, 0, [2, 4]] = 5.0  # tie between 2 and 4: plain greedy decoding picks 2
    logits[0, 1, 6] = 5.0
    output, num_accepted = accept_greedy(logits, torch.tensor([[4]]), torch.tensor([1]))
    assert num_accepted.tolist() == [0] and output.tolist() == [[2, PAD_TOKEN]]
    output, num_accepted = accept_greedy(logits, torch.tensor([[2]]), torch.tensor([1]))
    assert num_accepted.tolist() == [1] and output.tolist() == [[2, 6]]


def test_greedy_matches_row_by_row_reference():
    generator = torch.Generator().manual_seed(1)
    num_rows, width, vocab = 64, 5, 4  # a small vocab so drafts often match
    logits = torch.randn(num_rows, width, vocab, generator=generator)
    drafts = logits[:, :-1].argmax(dim=-1)
    flip = torch.rand(num_rows, width - 1, generator=generator) < 0.25
    drafts = torch.where(flip, torch.randint(0, vocab, drafts.shape, generator=generator), drafts)
    num_drafts = torch.randint(0, width, (num_rows,), generator=generator)
    output, num_accepted = accept_greedy(logits, drafts, num_drafts)
    ref_output, ref_accepted = _greedy_reference(logits, drafts, num_drafts)
    assert torch.equal(num_accepted, ref_accepted) and torch.equal(output, ref_output)
    assert len(set(num_accepted.tolist())) >= 4  # the batch exercises many outcomes


def test_sampled_certain_and_impossible_drafts():
    probs = torch.zeros(2, 2, VOCAB)
    probs[:, 0, 3] = 1.0               # the target is sure of token 3 first
    probs[:, 1] = torch.full((VOCAB,), 1 / VOCAB)
    drafts = torch.tensor([[3], [4]])  # row 1's draft has target probability 0
    for draft_probs in (None, torch.full((2, 1, VOCAB), 1 / VOCAB)):
        output, num_accepted = accept_sampled(probs, drafts, torch.tensor([1, 1]),
                                              draft_probs, [None, None])
        assert num_accepted.tolist() == [1, 0]
        assert output[0, 0] == 3 and 0 <= output[0, 1] < VOCAB
        assert output[1].tolist() == [3, PAD_TOKEN]  # the residual is the target's 3


def test_no_draft_positions_at_all():
    """K = 0 (a batch where nobody drafted): one token per request, from the target."""
    probs = torch.zeros(2, 1, VOCAB)
    probs[0, 0, 4] = probs[1, 0, 1] = 1.0
    no_drafts, zero = torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    for output, num_accepted in (accept_greedy(probs, no_drafts, zero),
                                 accept_sampled(probs, no_drafts, zero, None, _seeded([0, 1]))):
        assert output.tolist() == [[4], [1]] and num_accepted.tolist() == [0, 0]


def _random_case(seed: int, num_rows: int, width: int):
    generator = torch.Generator().manual_seed(seed)
    probs = torch.randn(num_rows, width, VOCAB, generator=generator).softmax(dim=-1)
    draft_probs = torch.randn(num_rows, width - 1, VOCAB, generator=generator).softmax(dim=-1)
    drafts = torch.randint(0, VOCAB, (num_rows, width - 1), generator=generator)
    num_drafts = torch.randint(0, width, (num_rows,), generator=generator)
    return probs, drafts, num_drafts, draft_probs


def _seeded(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


@pytest.mark.parametrize("one_hot", [False, True])
def test_sampled_seeds_reproduce_and_differ(one_hot):
    probs, drafts, num_drafts, draft_probs = _random_case(2, 200, 4)
    draft_probs = None if one_hot else draft_probs
    run = lambda seeds: accept_sampled(probs, drafts, num_drafts, draft_probs, _seeded(seeds))
    first, again = run(range(200)), run(range(200))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    other = run(range(1000, 1200))
    assert not torch.equal(first[0], other[0])


def test_sampled_seeded_row_independent_of_batch_and_padding():
    """A seeded request's result depends on its own row only: not on the other requests,
    the padded width, or what the padding holds."""
    probs, drafts, num_drafts, draft_probs = _random_case(3, 8, 3)
    alone = [accept_sampled(probs[i:i + 1], drafts[i:i + 1], num_drafts[i:i + 1],
                            draft_probs[i:i + 1], _seeded([i])) for i in range(8)]
    wide_probs = torch.cat([probs, torch.full((8, 2, VOCAB), float("nan"))], dim=1)
    wide_drafts = torch.cat([drafts, torch.full((8, 2), -1)], dim=1)
    wide_q = torch.cat([draft_probs, torch.full((8, 2, VOCAB), float("nan"))], dim=1)
    for i in range(8):  # garbage past each row's drafts too
        wide_probs[i, num_drafts[i] + 1:] = float("nan")
        wide_drafts[i, num_drafts[i]:] = -1
    output, num_accepted = accept_sampled(wide_probs, wide_drafts, num_drafts, wide_q,
                                          _seeded(range(8)))
    for i, (row_output, row_accepted) in enumerate(alone):
        assert num_accepted[i] == row_accepted[0]
        assert output[i, :3].tolist() == row_output[0].tolist()
        assert output[i, 3:].tolist() == [PAD_TOKEN] * 2


def test_invalid_arguments_name_the_argument():
    probs, drafts, num_drafts, draft_probs = _random_case(4, 3, 3)
    with pytest.raises(ValueError, match="draft_tokens"):
        accept_greedy(probs, drafts[:, :1], num_drafts)
    with pytest.raises(ValueError, match="num_drafts"):
        accept_greedy(probs, drafts, num_drafts.float())
    with pytest.raises(ValueError, match="target_probs"):
        accept_sampled(probs[0], drafts, num_drafts, None, [None] * 3)
    with pytest.raises(ValueError, match="draft_probs"):
        accept_sampled(probs, drafts, num_drafts, draft_probs[:, :1], [None] * 3)
    with pytest.raises(ValueError, match="generators"):
        accept_sampled(probs, drafts, num_drafts, None, [None] * 2)


# --- distribution: the tokens a step emits follow the target --------------------------------

def _distributions(seed: int):
    """Context-dependent target p and draft q over VOCAB tokens: p1 [V], p2 [V, V] (row: the
    first token), p3 [V, V, V]; likewise q1, q2. Independent draws, so q differs from p."""
    generator = torch.Generator().manual_seed(seed)
    table = lambda *shape: (0.8 * torch.randn(*shape, VOCAB, generator=generator)).softmax(-1)
    return (table(), table(VOCAB), table(VOCAB, VOCAB)), (table(), table(VOCAB))


def _draft(q, num_rows: int, generator: torch.Generator):
    """Drafts x1 ~ q1, x2 ~ q2(. | x1). One-hot runs use the same drafts but report no
    probabilities: the one-hot rule is exact for any draft, however it was chosen."""
    q1, q2 = q
    x1 = torch.multinomial(q1.expand(num_rows, VOCAB), 1, generator=generator)[:, 0]
    x2 = torch.multinomial(q2[x1], 1, generator=generator)[:, 0]
    return x1, x2


def _verify_batch(p, q, width: int, one_hot: bool, full_drafts: bool, seed: int):
    """NUM_SAMPLES independent requests in one batch, each with its drafts and target rows.
    Returns (x1, output, num_accepted, num_drafts)."""
    p1, p2, p3 = p
    generator = torch.Generator().manual_seed(seed)
    x1, x2 = _draft(q, NUM_SAMPLES, generator)
    rows = [p1.expand(NUM_SAMPLES, VOCAB), p2[x1], p3[x1, x2]][:width]
    draft_rows = [q[0].expand(NUM_SAMPLES, VOCAB), q[1][x1]][:width - 1]
    drafts = torch.stack([x1, x2][:width - 1], dim=1)
    num_drafts = (torch.full((NUM_SAMPLES,), width - 1) if full_drafts
                  else torch.randint(0, width, (NUM_SAMPLES,), generator=generator))
    output, num_accepted = accept_sampled(
        torch.stack(rows, dim=1), drafts, num_drafts,
        None if one_hot else torch.stack(draft_rows, dim=1), [None] * NUM_SAMPLES,
        default_generator=torch.Generator().manual_seed(seed + 1))
    return x1, output, num_accepted, num_drafts


def _chi_square_p_value(tokens: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs.double().flatten() * tokens.numel()
    assert expected.min() >= 5  # the chi-square approximation holds
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = expected.numel() - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                   statistic / 2).item()


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("width", [2, 3], ids=["k1", "k2"])
def test_sampled_tokens_follow_the_target(one_hot, width):
    """First token ~ p1 and the pair (y1, y2) ~ p1(y1) p2(y2 | y1), where y2 is this step's
    second token when a draft was accepted, else the next step's plain sample from p2(. | y1).
    k1 covers the bonus token, k2 the second draft's acceptance and correction; draft counts
    vary per row (padded rows), 0..k."""
    p, q = _distributions(seed=10 + width)
    x1, output, num_accepted, _ = _verify_batch(p, q, width, one_hot, full_drafts=False,
                                                seed=20 + width)
    y1 = output[:, 0]
    next_step = torch.multinomial(p[1][y1], 1, generator=torch.Generator().manual_seed(5))[:, 0]
    y2 = torch.where(num_accepted >= 1, output[:, 1], next_step)
    assert (output >= 0).sum(dim=1).tolist() == (num_accepted + 1).tolist()
    assert _chi_square_p_value(y1, p[0]) > P_VALUE_THRESHOLD
    joint = p[0][:, None] * p[1]
    assert _chi_square_p_value(y1 * VOCAB + y2, joint) > P_VALUE_THRESHOLD
    # negative control: the drafts themselves do not follow the target
    assert _chi_square_p_value(x1, p[0]) < 1e-6


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_probs", "one_hot"])
def test_acceptance_rate_matches_theory(one_hot):
    """P(first draft accepted) = sum min(p1, q1) (one-hot: sum q1 p1, the chance the drafted
    token is accepted), and E[accepted of 2] adds sum_x1 P(accept x1) * alpha2(x1); observed
    within 4 standard errors."""
    p, q = _distributions(seed=30)
    _, _, num_accepted, _ = _verify_batch(p, q, 3, one_hot, full_drafts=True, seed=31)
    if one_hot:
        accept_first = q[0] * p[0]
        accept_second = (q[1] * p[1]).sum(dim=-1)
    else:
        accept_first = torch.minimum(p[0], q[0])
        accept_second = torch.minimum(p[1], q[1]).sum(dim=-1)
    alpha = accept_first.sum().item()
    expected_mean = alpha + (accept_first * accept_second).sum().item()
    observed_rate = (num_accepted >= 1).double().mean().item()
    assert abs(observed_rate - alpha) < 4 * (alpha * (1 - alpha) / NUM_SAMPLES) ** 0.5
    standard_error = num_accepted.double().std().item() / NUM_SAMPLES ** 0.5
    assert abs(num_accepted.double().mean().item() - expected_mean) < 4 * standard_error
