"""Sampler.sample and prompt_logprobs: the processing chain against HF transformers, the
support and frequencies of many draws, greedy, per-request seeds, min_tokens and logprobs."""
from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tllm.request import Request
from tllm.sampling.sampler import Sampler, _processed_probs, prompt_logprobs
from tllm.sampling_params import SamplingParams

VOCAB = 257
EOS = 2


def random_logits(seed: int, rows: int = 4, vocab: int = VOCAB, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def make_request(params: SamplingParams, prompt: list[int] | None = None,
                 outputs: list[int] = (), seed: int | None = None,
                 rid: str = "r") -> Request:
    if seed is not None:
        params = dataclasses.replace(params, seed=seed)
    request = Request(request_id=rid, prompt_token_ids=list(prompt or [5, 9, 11]),
                      sampling_params=params, max_new_tokens=16,
                      eos_token_ids=frozenset({EOS}))
    for token in outputs:
        request.append_token(token)
    return request


def hf_chain(row: torch.Tensor, params: SamplingParams, token_ids: list[int],
             output_ids: list[int], stop_ids: set[int] = frozenset()) -> torch.Tensor:
    """The logits the Sampler should draw from, built from HF processors on one row:
    repetition penalty, OpenAI presence/frequency penalty, min_tokens stop masking, then the
    warpers temperature -> top_k -> top_p -> min_p."""
    scores = row[None, :].clone()
    ids = torch.tensor([token_ids])
    scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    for token, count in Counter(output_ids).items():
        scores[0, token] -= count * params.frequency_penalty + params.presence_penalty
    for token in stop_ids:
        scores[0, token] = float("-inf")
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        warpers.append(MinPLogitsWarper(params.min_p))
    for warper in warpers:
        scores = warper(ids, scores)
    return scores[0]


class ProbeSampler(Sampler):
    """Records the final distribution of the random rows (what the noise is applied to)."""

    def _sample_random(self, logits, rows, index):
        self.probs = _processed_probs(logits, rows, index)
        return super()._sample_random(logits, rows, index)


def draw(row: torch.Tensor, params: SamplingParams, num_draws: int, seed: int = 0):
    """num_draws samples of one distribution: identical rows in one batch."""
    requests = [make_request(params, rid=f"r{i}") for i in range(num_draws)]
    out = Sampler(seed=seed).sample(row[None, :].repeat(num_draws, 1), requests).host()
    return torch.bincount(torch.tensor(out.token_ids), minlength=row.numel())


# ---- the chain as the Sampler runs it ---------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampler_distribution_matches_hf_chain_per_row(seed):
    params = [
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.6, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=5, repetition_penalty=1.3),
        SamplingParams(temperature=1.2, min_p=0.1, presence_penalty=0.8,
                       frequency_penalty=-0.4),
        SamplingParams(temperature=0.5, top_k=100, top_p=0.95, repetition_penalty=0.8,
                       presence_penalty=-1.0, frequency_penalty=1.5),
    ]
    g = torch.Generator().manual_seed(seed + 100)
    prompts = [torch.randint(0, 40, (8,), generator=g).tolist() for _ in params]
    outputs = [torch.randint(0, 40, (6,), generator=g).tolist() for _ in params]
    requests = [make_request(p, prompt, out) for p, prompt, out in zip(params, prompts, outputs)]
    logits = random_logits(seed, rows=len(params))
    sampler = ProbeSampler(seed=seed)
    result = sampler.sample(logits, requests).host()
    for row, request in enumerate(requests):
        expected = hf_chain(logits[row], request.sampling_params, request.token_ids,
                            request.output_token_ids)
        expected_probs = expected.softmax(dim=-1)
        assert torch.equal(sampler.probs[row] > 0, expected_probs > 0)
        torch.testing.assert_close(sampler.probs[row], expected_probs, rtol=1e-5, atol=1e-7)
        assert expected_probs[result.token_ids[row]] > 0


# ---- support and frequencies of many draws ----------------------------------------------

NUM_DRAWS = 8000


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("params", [
    SamplingParams(top_k=8),
    SamplingParams(top_p=0.8),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_p=0.03),
], ids=["top_k", "top_p", "min_p", "chain"])
def test_draws_cover_exactly_the_kept_set_with_the_right_frequencies(seed, params):
    row = random_logits(seed + 7, rows=1, scale=2.0)[0]
    expected = hf_chain(row, params, [0], []).softmax(dim=-1)
    kept = expected > 0
    assert 1 < int(kept.sum()) < VOCAB  # the filter really filtered something
    # Every kept token is likely enough to show up many times in NUM_DRAWS.
    assert float(expected[kept].min()) * NUM_DRAWS > 20
    if params.top_k > 0 and params.top_p == 1.0 and params.min_p == 0.0:
        assert torch.equal(kept.nonzero().flatten().sort().values,
                           row.topk(params.top_k).indices.sort().values)

    counts = draw(row, params, NUM_DRAWS, seed=seed)
    drawn = counts > 0
    assert torch.equal(drawn, kept)  # only kept tokens, and every one of them
    empirical = counts.float() / NUM_DRAWS
    total_variation = 0.5 * float((empirical - expected).abs().sum())
    assert total_variation < 0.05


def test_unfiltered_draws_match_the_softmax():
    row = random_logits(11, rows=1, vocab=32, scale=1.5)[0]
    counts = draw(row, SamplingParams(temperature=1.3), NUM_DRAWS)
    expected = (row / 1.3).softmax(dim=-1)
    assert bool((counts > 0).all())
    assert 0.5 * float((counts.float() / NUM_DRAWS - expected).abs().sum()) < 0.05


# ---- greedy -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_is_argmax(seed):
    logits = random_logits(seed, rows=6)
    requests = [make_request(SamplingParams(temperature=0.0, top_k=3, top_p=0.5))
                for _ in range(6)]
    assert Sampler(seed=seed).sample(logits, requests).host().token_ids == logits.argmax(-1).tolist()


def test_greedy_rows_are_argmax_in_a_batch_with_random_rows():
    logits = random_logits(3, rows=6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    out = Sampler(seed=3).sample(logits, [make_request(p) for p in params]).host()
    argmax = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_with_repetition_penalty_is_argmax_of_hf_penalised_logits(seed):
    logits = random_logits(seed, rows=4)
    top2 = logits.topk(2, dim=-1).indices
    penalties = [1.5, 3.0, 0.7, 1.0]
    g = torch.Generator().manual_seed(seed + 50)
    requests = []
    for row, penalty in enumerate(penalties):
        # The prompt holds the argmax token, so a penalty > 1 can move the choice.
        prompt = torch.randint(0, VOCAB, (10,), generator=g).tolist() + [int(top2[row, 0])]
        outputs = torch.randint(0, VOCAB, (4,), generator=g).tolist()
        requests.append(make_request(SamplingParams(temperature=0.0,
                                                    repetition_penalty=penalty),
                                     prompt, outputs))
    out = Sampler(seed=seed).sample(logits, requests).host()
    for row, request in enumerate(requests):
        hf = RepetitionPenaltyLogitsProcessor(penalties[row])(
            torch.tensor([request.token_ids]), logits[row][None, :].clone())
        assert out.token_ids[row] == int(hf.argmax())


def test_repetition_penalty_changes_the_greedy_choice():
    logits = random_logits(8, rows=1)
    best = int(logits.argmax())
    request = make_request(SamplingParams(temperature=0.0, repetition_penalty=100.0),
                           prompt=[best])
    token = Sampler().sample(logits, [request]).host().token_ids[0]
    assert token == int(logits[0].topk(2).indices[1])


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_with_presence_frequency_penalty_is_argmax_of_openai_formula(seed):
    logits = random_logits(seed, rows=3, scale=1.0)
    best = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0.0, presence_penalty=2.0),
              SamplingParams(temperature=0.0, frequency_penalty=1.0),
              SamplingParams(temperature=0.0, presence_penalty=-0.5, frequency_penalty=0.9)]
    # Each row already produced its argmax token (several times) and a few others.
    outputs = [[best[0], 7, 7], [best[1]] * 3 + [3], [best[2], best[2], 40, 7]]
    requests = [make_request(p, outputs=o) for p, o in zip(params, outputs)]
    out = Sampler(seed=seed).sample(logits, requests).host()
    for row, request in enumerate(requests):
        expected = hf_chain(logits[row], SamplingParams(
            presence_penalty=params[row].presence_penalty,
            frequency_penalty=params[row].frequency_penalty), [0], request.output_token_ids)
        assert out.token_ids[row] == int(expected.argmax())
    assert out.token_ids != best  # the penalties moved at least one choice


# ---- seeds ------------------------------------------------------------------------------


def run_steps(sampler: Sampler, batches: list[list[Request]], row_logits: list[torch.Tensor],
              other_seed: int) -> None:
    """Step every batch len(row_logits) times; seeded rows see row_logits[step], others
    see fresh random logits; sampled tokens are appended."""
    g = torch.Generator().manual_seed(other_seed)
    for step_logits in row_logits:
        for batch in batches:
            logits = torch.randn(len(batch), VOCAB, generator=g) * 3
            for i, request in enumerate(batch):
                if request.sampling_params.seed is not None:
                    logits[i] = step_logits
            for request, token in zip(batch, sampler.sample(logits, batch).host().token_ids):
                request.append_token(token)


def test_same_seed_same_samples_in_different_batches():
    params = SamplingParams(temperature=1.0, top_k=100, repetition_penalty=1.1)
    steps = [random_logits(s, rows=1, scale=1.0)[0] for s in range(20)]
    a = make_request(params, seed=1234, rid="a")
    b = make_request(params, seed=1234, rid="b")
    c = make_request(params, seed=4321, rid="c")
    batch_1 = [a, make_request(params, rid="x"), c]
    batch_2 = [make_request(params, rid="y"), make_request(SamplingParams(top_p=0.5), rid="z"),
               b, make_request(SamplingParams(temperature=0.0), rid="w")]
    run_steps(Sampler(seed=0), [batch_1], steps, other_seed=1)
    run_steps(Sampler(seed=99), [batch_2], steps, other_seed=2)
    assert a.output_token_ids == b.output_token_ids
    assert a.output_token_ids != c.output_token_ids
    assert len(set(a.output_token_ids)) > 5  # really random, not a constant


def test_different_seeds_differ_and_each_repeats():
    params = SamplingParams(temperature=1.0)
    steps = [random_logits(s + 40, rows=1, scale=1.0)[0] for s in range(16)]
    requests = [make_request(params, seed=seed, rid=str(seed)) for seed in (0, 1, 2, 0)]
    run_steps(Sampler(seed=5), [requests], steps, other_seed=0)
    outputs = [tuple(r.output_token_ids) for r in requests]
    assert outputs[0] == outputs[3]
    assert len(set(outputs[:3])) == 3


def test_unseeded_rows_follow_the_sampler_seed():
    logits = random_logits(9, rows=8, scale=1.0)
    params = SamplingParams(temperature=1.0)

    def sample(seed):
        return Sampler(seed=seed).sample(logits, [make_request(params) for _ in range(8)]).host()

    assert sample(3).token_ids == sample(3).token_ids
    assert sample(3).token_ids != sample(4).token_ids


# ---- min_tokens -------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stop_tokens_are_not_sampled_before_min_tokens(temperature):
    stop_ids = {EOS, 17, 200}
    params = SamplingParams(temperature=temperature, min_tokens=4, stop_token_ids=[17, 200])
    requests = [make_request(params, rid=str(i)) for i in range(200)]
    sampler = Sampler(seed=0)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        logits = torch.randn(len(requests), VOCAB, generator=g)
        logits[:, list(stop_ids)] += 30.0  # the stop tokens hold almost all the mass
        tokens = sampler.sample(logits, requests).host().token_ids
        if step < 4:
            assert not stop_ids & set(tokens)
        else:
            assert set(tokens) <= stop_ids
        for request, token in zip(requests, tokens):
            # Keep the count of outputs in step across rows by appending a non-stop token.
            request.append_token(token if token not in stop_ids else 5)


def test_min_tokens_counts_existing_outputs_and_respects_ignore_eos():
    logits = random_logits(1, rows=3)
    logits[:, EOS] += 40.0
    logits[:, 17] += 30.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[17])
    requests = [
        make_request(params, outputs=[4]),  # one output so far: still masked
        make_request(params, outputs=[4, 6]),  # min_tokens reached
        make_request(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[17],
                                    ignore_eos=True)),  # EOS is no stop token here
    ]
    out = Sampler().sample(logits, requests).host()
    masked = logits[0].clone()
    masked[[EOS, 17]] = float("-inf")
    assert out.token_ids == [int(masked.argmax()), EOS, EOS]


def test_eos_outside_the_vocab_is_ignored():
    request = Request(request_id="r", prompt_token_ids=[1], max_new_tokens=4,
                      sampling_params=SamplingParams(temperature=0.0, min_tokens=3),
                      eos_token_ids=frozenset({VOCAB + 10, EOS}))
    logits = random_logits(2, rows=1)
    logits[0, EOS] += 50.0
    token = Sampler().sample(logits, [request]).host().token_ids[0]
    assert token != EOS


# ---- logprobs ---------------------------------------------------------------------------


def check_position_logprobs(entry, reference: torch.Tensor, token: int, k: int) -> None:
    """entry holds `token` and the top-k of `reference` (a log_softmax row), with the right
    values and ranks."""
    top = reference.topk(k).indices.tolist() if k else []
    assert set(entry) == {token, *top}
    for tid, logprob in entry.items():
        assert abs(logprob.logprob - float(reference[tid])) <= 1e-6
        assert logprob.rank == int((reference > reference[tid]).sum()) + 1
    for rank, tid in enumerate(top, start=1):
        assert entry[tid].rank == rank


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logprobs_are_of_the_raw_logits_with_ranks(seed):
    ks = [None, 0, 1, 5, 20, 3]
    params = [
        SamplingParams(temperature=1.0, logprobs=ks[0]),
        SamplingParams(temperature=1.0, logprobs=ks[1], repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=ks[2], presence_penalty=1.0),
        SamplingParams(temperature=0.5, top_k=10, logprobs=ks[3], frequency_penalty=-1.0),
        SamplingParams(temperature=2.0, top_p=0.7, logprobs=ks[4]),
        SamplingParams(temperature=1.0, min_p=0.2, min_tokens=3, logprobs=ks[5]),
    ]
    g = torch.Generator().manual_seed(seed)
    requests = [make_request(p, prompt=torch.randint(0, 30, (8,), generator=g).tolist(),
                             outputs=torch.randint(0, 30, (3,), generator=g).tolist())
                for p in params]
    logits = random_logits(seed, rows=len(params))
    logits[5, EOS] += 20.0  # masked by min_tokens for sampling, still reported raw
    out = Sampler(seed=seed).sample(logits.clone(), requests).host()
    reference = logits.log_softmax(dim=-1)
    assert out.logprobs[0] is None and out.sampled_logprobs[0] is None
    for row in range(1, len(params)):
        token = out.token_ids[row]
        check_position_logprobs(out.logprobs[row], reference[row], token, ks[row])
        assert abs(out.sampled_logprobs[row] - float(reference[row, token])) <= 1e-6
    assert out.logprobs[1].keys() == {out.token_ids[1]}  # logprobs=0: the sampled token only
    assert out.logprobs[5][EOS].rank == 1


def test_no_logprobs_when_none_asked():
    out = Sampler().sample(random_logits(0), [make_request(SamplingParams())] * 4).host()
    assert out.logprobs == [None] * 4 and out.sampled_logprobs == [None] * 4


def test_logprobs_from_half_precision_logits():
    logits = random_logits(4, rows=2).to(torch.bfloat16)
    requests = [make_request(SamplingParams(temperature=0.0, logprobs=4))] * 2
    out = Sampler().sample(logits, requests).host()
    reference = logits.float().log_softmax(dim=-1)
    for row in range(2):
        assert out.token_ids[row] == int(logits[row].float().argmax())
        check_position_logprobs(out.logprobs[row], reference[row], out.token_ids[row], 4)


@pytest.mark.parametrize("k", [0, 1, 6])
def test_prompt_logprobs(k):
    logits = random_logits(k, rows=9)
    g = torch.Generator().manual_seed(k)
    targets = torch.randint(0, VOCAB, (9,), generator=g).tolist()
    targets[0] = int(logits[0].argmax())  # one target is the top token (rank 1)
    result = prompt_logprobs(logits, targets, k)
    reference = logits.log_softmax(dim=-1)
    assert len(result) == 9
    for position, (entry, target) in enumerate(zip(result, targets)):
        check_position_logprobs(entry, reference[position], target, k)
    assert result[0][targets[0]].rank == 1


# ---- rows kept by batch slot --------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_slot_rows_sample_as_the_requests_themselves_say(seed):
    """The executor's path (parameters written once per slot, penalty counts kept on the
    device and updated by each step's tokens) draws what the per-call path draws."""
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.4),
              SamplingParams(temperature=0.9, top_k=20, presence_penalty=0.7, seed=3),
              SamplingParams(temperature=1.1, top_p=0.8, frequency_penalty=0.5, seed=4),
              SamplingParams(temperature=0.0, logprobs=2, min_tokens=3,
                             logit_bias={7: 5.0}),
              SamplingParams(temperature=0.7, min_p=0.05, seed=5, logprobs=0)]
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 40, (6,), generator=g).tolist() for _ in params]
    by_slot = [make_request(p, prompt, rid=f"s{i}") for i, (p, prompt) in
               enumerate(zip(params, prompts))]
    by_call = [make_request(p, prompt, rid=f"c{i}") for i, (p, prompt) in
               enumerate(zip(params, prompts))]
    slot_sampler = Sampler(seed=seed, num_slots=8, vocab_size=VOCAB)
    slots = np.array([6, 0, 3, 5, 1])
    for slot, request in zip(slots, by_slot):
        slot_sampler.assign_slot(int(slot), request)
    call_sampler = Sampler(seed=seed, vocab_size=VOCAB)
    for step in range(8):
        logits = random_logits(seed * 100 + step, rows=len(params), scale=2.0)
        logits[:, :40] += 2.0  # the prompt tokens matter to the penalties
        ours = slot_sampler.sample(logits, by_slot, slots).host()
        theirs = call_sampler.sample(logits, by_call).host()
        seeded = [i for i, p in enumerate(params) if p.seed is not None or p.is_greedy]
        assert [ours.token_ids[i] for i in seeded] == [theirs.token_ids[i] for i in seeded]
        assert ours.logprobs[3] == theirs.logprobs[3]
        for request, token in zip(by_slot, ours.token_ids):
            request.append_token(token)
        for request, token in zip(by_call, ours.token_ids):
            request.append_token(token)


def test_a_slot_taken_again_starts_from_the_new_requests_tokens():
    sampler = Sampler(seed=0, num_slots=2, vocab_size=VOCAB)
    params = SamplingParams(temperature=0.0, repetition_penalty=100.0)
    logits = random_logits(5, rows=1)
    best = int(logits.argmax())
    first = make_request(params, prompt=[best], rid="a")
    sampler.assign_slot(0, first)
    assert sampler.sample(logits, [first], np.array([0])).host().token_ids[0] != best
    sampler.release_slot(0)
    second = make_request(params, prompt=[best + 1], rid="b")
    sampler.assign_slot(0, second)
    assert sampler.sample(logits, [second], np.array([0])).host().token_ids[0] == best
