"""Prefix reuse for a hybrid (tiny random NemotronH, fp32 on the CPU): the state-space
layers' state is checkpointed at the last block boundary of each prefill chunk, and a prefix
hit is cut back to the last block with a checkpoint. Greedy tokens equal HF's and a run with
reuse off; hits are counted; no checkpoint row stays held once requests finish."""
from __future__ import annotations

import pytest
import torch

from tests.models.hf_reference import TOP, assert_greedy_matches_hf, check_logprobs, hf_greedy
from tests.models.test_nemotron_h_parity import TINY, save_tiny
from tllm import LLM, CapacitySchedulerPolicy, KvCacheConfig, SamplingParams, SchedulerConfig

pytest.importorskip("transformers")

NUM_NEW = 8
BLOCK = 4
CHUNK = 16   # the step budget: a prompt is prefilled in chunks of 16 (checkpoints at 16, 32..)


def _prompts() -> tuple[list[int], list[int], list[int]]:
    """A 40-token prompt; one sharing its first 30 tokens (7 full blocks, the last with no
    checkpoint: the hit falls back to 16 tokens); one sharing 32 (a checkpointed block)."""
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, TINY["vocab_size"], (40,), generator=g).tolist()
    tail = torch.randint(3, TINY["vocab_size"], (6,), generator=g).tolist()
    return base, base[:30] + tail, base[:32] + tail


def _engine(path, reuse: bool, checkpoints: int | None = 8) -> LLM:
    return LLM(str(path), max_num_tokens=CHUNK, max_batch_size=2,
               kv_cache_config=KvCacheConfig(tokens_per_block=BLOCK, max_tokens=1024,
                                             enable_block_reuse=reuse,
                                             max_state_checkpoints=checkpoints))


def _greedy(llm: LLM, prompt: list[int]):
    """The greedy tokens and their top logprobs."""
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True, logprobs=TOP)
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out.outputs[0].token_ids, out.outputs[0].logprobs


def _checkpoints(llm: LLM):
    return llm._engine.executor.runner.model.state_cache.checkpoints


def test_reuse_on_block_boundary_gives_same_tokens(tmp_path):
    hf_model = save_tiny(tmp_path, seed=4)
    prompts = _prompts()
    reused, tokens = [], []
    with _engine(tmp_path, reuse=True) as llm:
        for prompt in prompts:   # one after another: each later one finds the first's blocks
            before = llm.get_kv_cache_stats()["blocks_reused"]
            tokens.append(_greedy(llm, prompt))
            reused.append(llm.get_kv_cache_stats()["blocks_reused"] - before)
        checkpoints = _checkpoints(llm)
        assert checkpoints.num_restored == 2
        assert checkpoints.num_rows_held == 0   # every save keyed or given back
    # 7 shared blocks, cut back to the checkpoint at 16 tokens; 8 shared, all of them
    assert reused == [0, 16 // BLOCK, 32 // BLOCK]
    with _engine(tmp_path, reuse=False) as llm:
        assert [_greedy(llm, p)[0] for p in prompts] == [t for t, _ in tokens]
        assert llm._engine.executor.runner.model.state_cache.checkpoints is None
    for prompt, (ours, logprobs) in zip(prompts, tokens):
        want, want_logprobs = hf_greedy(hf_model, prompt, NUM_NEW)
        assert ours == want
        check_logprobs(logprobs, want_logprobs, want)   # a wrong state shows here first


def test_checkpoint_pool_stays_bounded(tmp_path):
    """More checkpoints than rows (2: one per batch slot, the default): old ones are
    evicted, hits only ever use those left, and the answers stay HF's."""
    hf_model = save_tiny(tmp_path, seed=5)
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, TINY["vocab_size"], (20,), generator=g).tolist()
    prompts = [shared + torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist()
               for n in (13, 21, 6, 30, 9)]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
    with _engine(tmp_path, reuse=True, checkpoints=None) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        checkpoints = _checkpoints(llm)
        assert checkpoints.pool.num_evictions > 0
        assert checkpoints.num_restored > 0
        assert checkpoints.num_rows_held == 0
    assert_greedy_matches_hf(hf_model, prompts, outputs, NUM_NEW, logprobs=False)


def test_preemption_with_recompute_restores_state(tmp_path):
    """A preempted request comes back with a prefix hit on its own blocks and its state
    restored from a checkpoint; its answers stay HF's."""
    hf_model = save_tiny(tmp_path, seed=1)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist()
               for n in (20, 9, 31, 14, 25, 6)]
    policy = SchedulerConfig(capacity_scheduler_policy=CapacitySchedulerPolicy.MAX_UTILIZATION)
    with LLM(str(tmp_path), max_num_tokens=CHUNK, max_batch_size=4, scheduler_config=policy,
             kv_cache_config=KvCacheConfig(tokens_per_block=BLOCK, max_tokens=64)) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=NUM_NEW, temperature=0,
                                              ignore_eos=True), use_tqdm=False)
        assert llm.get_kv_cache_stats()["preemptions"] > 0
        assert _checkpoints(llm).num_restored > 0
        assert _checkpoints(llm).num_rows_held == 0
    assert_greedy_matches_hf(hf_model, prompts, outputs, NUM_NEW, logprobs=False)
