"""One request's failure never fails another's: a request whose sampling or host-side
processing raises is finished with its own error while the rest of its batch goes on, with
the same tokens as if it had never been there."""
from __future__ import annotations

import pytest

from tllm import LLM, KvCacheConfig, SamplingParams
from tllm.executor import postprocess
from tllm.sampling.sampler import Sampler

POISON_SEED = 666
PROMPTS = [{"prompt_token_ids": [5, 17, 33, 2 + i, 90, 41]} for i in range(4)]
INNOCENT = [SamplingParams(max_tokens=8, temperature=0),
            SamplingParams(max_tokens=8, temperature=0.9, seed=3),
            SamplingParams(max_tokens=8, temperature=0, logprobs=2),
            SamplingParams(max_tokens=8, temperature=1.0, seed=4, top_k=5)]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    path, _ = tiny_llama
    with LLM(str(path), max_batch_size=8, kv_cache_config=KvCacheConfig(max_tokens=512)) as llm:
        yield llm


def run_with_poison(llm, poison_params):
    outputs = [llm.generate_async(p, sp) for p, sp in zip(PROMPTS, INNOCENT)]
    bad = llm.generate_async({"prompt_token_ids": [9, 8, 7, 6]}, poison_params)
    innocent = [o.result() for o in outputs]
    with pytest.raises(RuntimeError, match="poisoned"):
        bad.result()
    stats = llm.get_kv_cache_stats()
    assert stats["blocks_free"] == stats["blocks_total"]  # nothing leaked either
    return [o.outputs[0].token_ids for o in innocent]


def alone(llm):
    outs = llm.generate(PROMPTS, INNOCENT, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_a_request_that_breaks_the_sampler_fails_alone(llm, monkeypatch):
    expected = alone(llm)
    real = Sampler._processed_logits

    def poisoned(self, logits, rows, requests, slots):
        if any(r.sampling_params.seed == POISON_SEED for r in requests):
            raise RuntimeError("poisoned sampling parameters")
        return real(self, logits, rows, requests, slots)

    monkeypatch.setattr(Sampler, "_processed_logits", poisoned)
    got = run_with_poison(llm, SamplingParams(max_tokens=8, temperature=0.5,
                                              seed=POISON_SEED))
    assert got == expected


def test_a_request_whose_processing_raises_fails_alone(llm, monkeypatch):
    expected = alone(llm)
    real = postprocess.check_stop

    def poisoned(request, token):
        if request.sampling_params.seed == POISON_SEED and request.num_output_tokens == 2:
            raise RuntimeError("poisoned stop check")
        return real(request, token)

    monkeypatch.setattr(postprocess, "check_stop", poisoned)
    got = run_with_poison(llm, SamplingParams(max_tokens=8, temperature=0,
                                              seed=POISON_SEED))
    assert got == expected


def test_an_enormous_top_k_keeps_every_token(llm):
    """top_k past the vocabulary (2**63, as a hostile client sent) filters nothing."""
    params = SamplingParams(max_tokens=4, temperature=0.8, top_k=2**63, seed=1)
    same = SamplingParams(max_tokens=4, temperature=0.8, top_k=-1, seed=1)
    huge, plain = llm.generate([PROMPTS[0], PROMPTS[0]], [params, same], use_tqdm=False)
    assert huge.outputs[0].token_ids == plain.outputs[0].token_ids


def test_a_scheduling_failure_fails_the_queue_once_and_the_engine_serves_on(llm, monkeypatch):
    """A failure inside the scheduler fails no step (none is in flight): before, the same
    requests were scheduled into it again at every iteration, forever. Now they fail, their
    blocks come back, and the next requests are served."""
    from tllm.scheduler.scheduler import Scheduler
    expected = alone(llm)
    real, calls = Scheduler.schedule, []

    def breaks_once(self):
        if self.waiting and not calls:   # the first time there is a request to schedule
            calls.append(1)
            raise RuntimeError("the scheduler broke")
        return real(self)

    monkeypatch.setattr(Scheduler, "schedule", breaks_once)
    broken = llm.generate_async(PROMPTS[0], INNOCENT[0])
    with pytest.raises(RuntimeError, match="scheduler broke"):
        broken.result()
    stats = llm.get_kv_cache_stats()
    assert stats["blocks_free"] == stats["blocks_total"]
    assert alone(llm) == expected
