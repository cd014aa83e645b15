"""The overlap scheduler (step N+1 launched before step N's tokens reach the host) gives the
same outputs as the plain loop, whatever ends the requests."""
from __future__ import annotations

import pytest
import torch

from tllm import (LLM, CapacitySchedulerPolicy, KvCacheConfig, SamplingParams,
                  SchedulerConfig)


def workload(vocab: int):
    g = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (int(n),), generator=g).tolist()}
               for n in torch.randint(1, 50, (10,), generator=g)]
    params = [SamplingParams(max_tokens=12, temperature=0),
              SamplingParams(max_tokens=9, temperature=0.8, seed=5, n=3),
              SamplingParams(max_tokens=15, temperature=0, repetition_penalty=1.3,
                             presence_penalty=0.5, logprobs=2),
              SamplingParams(max_tokens=1, temperature=0),
              SamplingParams(max_tokens=20, temperature=1.0, seed=9, top_k=20, min_tokens=5)]
    return prompts, [params[i % len(params)] for i in range(len(prompts))]


def run(path, overlap: bool, **kwargs):
    with LLM(str(path), disable_overlap_scheduler=not overlap, max_num_tokens=24,
             max_batch_size=5, **kwargs) as llm:
        prompts, params = workload(llm._engine.config.vocab_size)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.get_kv_cache_stats()
        assert stats["blocks_free"] == stats["blocks_total"]
    return outs


def assert_same(a, b):
    """Tokens and finish reasons equal; logprobs equal up to the float noise of different
    batch shapes (the two loops group requests into steps differently)."""
    for x, y in zip(a, b, strict=True):
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert (cx.token_ids, cx.finish_reason) == (cy.token_ids, cy.finish_reason)
            for px, py in zip(cx.logprobs or [], cy.logprobs or [], strict=True):
                assert px.keys() == py.keys()
                assert all(abs(px[t].logprob - py[t].logprob) < 1e-4 for t in px)


@pytest.mark.parametrize("policy", ["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"])
def test_overlap_on_and_off_agree(tiny_llama, policy):
    path, _ = tiny_llama
    kwargs = dict(kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=160
                                                if policy == "MAX_UTILIZATION" else 2048),
                  scheduler_config=SchedulerConfig(
                      capacity_scheduler_policy=CapacitySchedulerPolicy(policy)))
    assert_same(run(path, overlap=True, **kwargs), run(path, overlap=False, **kwargs))


def test_stop_token_seen_one_step_late_changes_nothing(tiny_llama):
    path, _ = tiny_llama
    prompt = {"prompt_token_ids": [5, 17, 33, 2, 90]}
    with LLM(str(path), kv_cache_config=KvCacheConfig(max_tokens=512)) as llm:
        greedy = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0),
                              use_tqdm=False).outputs[0].token_ids
        stop = greedy[3]
        out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0,
                                                  stop_token_ids=[stop]), use_tqdm=False)
    assert out.outputs[0].token_ids == greedy[:greedy.index(stop) + 1]
