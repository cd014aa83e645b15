"""Counter-based sampling noise and the fused token-drawing kernel against its reference:
the same tokens for the same (seed, counter), rows independent of each other, and draws
whose frequencies follow the probabilities."""
from __future__ import annotations

import pytest
import torch

from tllm.kernels.sampling_noise import exponential_noise, sample_tokens_ref
from tllm.kernels.triton.sample_tokens import sample_tokens


def random_probs(rows: int, vocab: int, seed: int, zero_frac: float = 0.3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2
    logits[torch.rand(rows, vocab, generator=g) < zero_frac] = float("-inf")
    logits[:, 0] = 0.0  # every row keeps a token
    return logits.softmax(dim=-1)


@pytest.mark.parametrize("rows,vocab", [(1, 7), (5, 300), (3, 5000)])
def test_kernel_draws_the_reference_tokens(device, rows, vocab):
    probs = random_probs(rows, vocab, seed=rows + vocab)
    g = torch.Generator().manual_seed(vocab)
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    counters = torch.randint(0, 2**31, (rows,), generator=g)
    expected = sample_tokens_ref(probs, seeds, counters)
    got = sample_tokens(probs.to(device), seeds.to(device), counters.to(device)).cpu()
    scores = probs / exponential_noise(seeds, counters, vocab)
    top2 = scores.topk(2, dim=-1).values
    near_tie = (top2[:, 0] - top2[:, 1]) < 1e-5 * top2[:, 0]
    assert bool(((got == expected) | near_tie).all())
    assert bool((probs.gather(1, got[:, None]) > 0).all())  # never a removed token


def test_noise_depends_only_on_the_rows_own_seed_and_counter():
    seeds = torch.tensor([7, 7, 8, 7])
    counters = torch.tensor([3, 4, 3, 3])
    noise = exponential_noise(seeds, counters, 64)
    assert torch.equal(noise[0], noise[3])               # same key, same noise
    assert not torch.equal(noise[0], noise[1])           # the next position differs
    assert not torch.equal(noise[0], noise[2])           # another seed differs
    alone = exponential_noise(seeds[1:2], counters[1:2], 64)
    assert torch.equal(alone[0], noise[1])               # whatever else is in the batch
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())


def test_draws_follow_the_probabilities():
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125, 0.0]])
    num = 20000
    seeds = torch.arange(num, dtype=torch.int64) * 7919
    tokens = sample_tokens_ref(probs.expand(num, -1).contiguous(), seeds,
                               torch.zeros(num, dtype=torch.int64))
    freq = torch.bincount(tokens, minlength=5).float() / num
    assert float((freq - probs[0]).abs().max()) < 0.015
    assert int(freq[4] * num) == 0
