"""Deterministic mode (LlmArgs.deterministic) on a tiny random Llama, fp32 on the CPU: the
same probe requests give the same token ids and logprobs, bit for bit, alone and in 50
random batches (1-64 requests, prompts chunked by random prefill token budgets, prefix
reuse on and off, the overlap scheduler on and off), greedy and seeded sampling."""
from __future__ import annotations

import random

import pytest

from tllm import LLM, KvCacheConfig, SamplingParams, SchedulerConfig

PROBE_PROMPT = [(7 * i + 3) % 380 + 3 for i in range(37)]
PROBES = (SamplingParams(max_tokens=5, temperature=0, logprobs=3),
          SamplingParams(max_tokens=5, temperature=0.9, top_p=0.9, seed=11, logprobs=3))
NUM_COMPOSITIONS = 50


def _engine(path, reuse: bool, overlap: bool, budget: int | None) -> LLM:
    return LLM(str(path), deterministic=True, max_num_tokens=128, max_batch_size=64,
               max_seq_len=128, disable_overlap_scheduler=not overlap,
               scheduler_config=SchedulerConfig(prefill_token_budget=budget),
               kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=5144,
                                             enable_block_reuse=reuse))


def _answers(outputs) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def _composition(rng: random.Random) -> tuple[list[list[int]], list[SamplingParams], list[int]]:
    """Other requests around the probes (some sharing the probe's first blocks), and where
    the probes sit in the batch."""
    size = rng.randint(1, 64)
    prompts, params = [], []
    for _ in range(max(0, size - len(PROBES))):
        head = PROBE_PROMPT[:rng.choice((8, 16))] if rng.random() < 0.2 else []
        prompts.append(head + [rng.randrange(3, 380) for _ in range(rng.randint(1, 16))])
        params.append(SamplingParams(max_tokens=rng.randint(1, 2),
                                     temperature=rng.choice((0, 0.7, 1.0)), seed=rng.randrange(99)))
    slots = []
    for probe in PROBES:
        at = rng.randint(0, len(prompts))
        prompts.insert(at, PROBE_PROMPT)
        params.insert(at, probe)
        slots = [s + (s >= at) for s in slots] + [at]
    return prompts, params, slots


@pytest.fixture(scope="module")
def alone(tiny_llama):
    with _engine(tiny_llama[0], reuse=False, overlap=False, budget=None) as llm:
        return [_answers([llm.generate(PROBE_PROMPT, p, use_tqdm=False)])[0] for p in PROBES]


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
def test_probes_bitwise_identical_in_any_batch(tiny_llama, alone, reuse, overlap):
    rng = random.Random(f"{reuse}-{overlap}")
    budget = rng.choice((5, 9, 16, 23, 40, None))
    with _engine(tiny_llama[0], reuse, overlap, budget) as llm:
        for _ in range(NUM_COMPOSITIONS // 4 + (reuse and overlap) * (NUM_COMPOSITIONS % 4)):
            prompts, params, slots = _composition(rng)
            answers = _answers(llm.generate(prompts, params, use_tqdm=False))
            for probe, slot in enumerate(slots):
                assert answers[slot] == alone[probe], (len(prompts), budget, probe)


def test_probe_answers_are_sane(alone):
    for tokens, logprobs in alone:
        assert len(tokens) == 5 and len(logprobs) == 5
        assert all(t in entry and entry[t].logprob <= 0 for t, entry in zip(tokens, logprobs))
