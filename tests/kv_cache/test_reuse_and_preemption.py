"""Prefix reuse, host/disk tiers and preemption never change a greedy answer."""
from __future__ import annotations

import pytest
import torch

from tllm import (LLM, CapacitySchedulerPolicy, KvCacheConfig, SamplingParams,
                  SchedulerConfig)

GREEDY = SamplingParams(max_tokens=10, temperature=0)
BLOCK = 4


def shared_prefix_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, vocab, (40,), generator=g).tolist()
    tail = torch.randint(3, vocab, (8,), generator=g).tolist()
    return [base,
            base[:16] + tail,          # prefix ends on a block boundary
            base[:18] + tail,          # prefix ends mid-block
            base[:40],                 # equals a whole earlier prompt
            base[:7],                  # shorter than two blocks
            tail + base[:12]]          # no shared prefix


def run(path, prompts, sequential=True, **kwargs):
    with LLM(str(path), max_num_tokens=64, **kwargs) as llm:
        if sequential:  # one at a time, so later prompts find earlier ones cached
            outs = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)
                    for p in prompts]
        else:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                use_tqdm=False)
        stats = llm.get_kv_cache_stats()
        assert stats["blocks_free"] == stats["blocks_total"]
    return [o.outputs[0].token_ids for o in outs], stats


def kv(**kw):
    return KvCacheConfig(tokens_per_block=BLOCK, **kw)


def test_reuse_on_and_off_give_the_same_tokens(tiny_llama):
    path, model = tiny_llama
    prompts = shared_prefix_prompts(model.config.vocab_size)
    with_reuse, stats = run(path, prompts, kv_cache_config=kv(max_tokens=1024))
    without, off_stats = run(path, prompts,
                             kv_cache_config=kv(max_tokens=1024, enable_block_reuse=False))
    assert with_reuse == without
    assert stats["blocks_reused"] >= 4 + 4 + 9 and off_stats["blocks_reused"] == 0
    assert 0 < stats["hit_rate"] < 1


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_evicted_blocks_come_back_from_a_lower_tier(tiny_llama, tmp_path, tier):
    path, model = tiny_llama
    g = torch.Generator().manual_seed(5)
    first = torch.randint(3, model.config.vocab_size, (33,), generator=g).tolist()
    filler = torch.randint(3, model.config.vocab_size, (60,), generator=g).tolist()
    prompts = [first, filler, first]  # the filler evicts every block of the first prompt
    reference, _ = run(path, prompts, kv_cache_config=kv(max_tokens=1024))
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # layers * (k, v) * tokens * kv heads * dim * 4
    tiers = (dict(host_cache_size=64 * block_bytes) if tier == "host" else
             dict(disk_cache_dir=str(tmp_path), disk_cache_size=64 * block_bytes))
    tokens, stats = run(path, prompts, kv_cache_config=kv(max_tokens=72, **tiers))
    assert tokens == reference
    assert stats["blocks_onboarded"] >= 8 and stats["blocks_offloaded"] >= 8
    assert stats[f"{tier}_blocks"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_max_utilization_keeps_answers(tiny_llama, mode):
    path, model = tiny_llama
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
               for n in (20, 9, 31, 14, 25, 6, 17, 28)]
    reference, _ = run(path, prompts, sequential=False, kv_cache_config=kv(max_tokens=2048))
    policy = SchedulerConfig(capacity_scheduler_policy=CapacitySchedulerPolicy.MAX_UTILIZATION,
                             preemption_mode=mode)
    tiers = dict(host_cache_size=1 << 20) if mode == "swap" else {}
    tokens, stats = run(path, prompts, sequential=False, scheduler_config=policy,
                        kv_cache_config=kv(max_tokens=64, enable_block_reuse=False, **tiers))
    assert tokens == reference
    assert stats["preemptions"] > 0
    if mode == "swap":
        assert stats["blocks_swapped_in"] == stats["blocks_swapped_out"] > 0


def test_cache_salt_separates_prefixes(tiny_llama):
    path, _ = tiny_llama
    prompt = list(range(10, 30))
    with LLM(str(path), kv_cache_config=kv(max_tokens=512)) as llm:
        llm.generate({"prompt_token_ids": prompt, "cache_salt": "a"}, GREEDY, use_tqdm=False)
        before = llm.get_kv_cache_stats()["blocks_reused"]
        llm.generate({"prompt_token_ids": prompt, "cache_salt": "b"}, GREEDY, use_tqdm=False)
        assert llm.get_kv_cache_stats()["blocks_reused"] == before
        llm.generate({"prompt_token_ids": prompt, "cache_salt": "a"}, GREEDY, use_tqdm=False)
        assert llm.get_kv_cache_stats()["blocks_reused"] > before
