"""The scheduling policies end to end on a tiny Llama: greedy outputs (and beam search's)
are the same under the step token budget and under priority order as under the default
policy; priority is refused, naming it, unless the priority policy is on."""
from __future__ import annotations

import pytest
import torch

from tllm import LLM, KvCacheConfig, SamplingParams, SchedulerConfig
from tllm.config import LlmArgs

KV = KvCacheConfig(tokens_per_block=4, max_tokens=4096)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 37, 9, 61, 3, 24)]


def generate(path, prompts, scheduler_config, priority=None, beams=False):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    beam = SamplingParams(use_beam_search=True, best_of=2, n=2, temperature=0, max_tokens=8)
    params = [beam if beams and i % 3 == 0 else greedy for i in range(len(prompts))]
    with LLM(str(path), dtype="float32", max_num_tokens=64, max_batch_size=4,
             kv_cache_config=KV, scheduler_config=scheduler_config) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False, priority=priority)
        stats = llm.get_kv_cache_stats()
    assert stats["blocks_free"] == stats["blocks_total"]
    return [[o.token_ids for o in out.outputs] for out in outputs]


def test_greedy_and_beam_outputs_equal_the_default_policy(tiny_llama):
    path, model = tiny_llama
    batch = prompts(model.config.vocab_size)
    default = generate(path, batch, SchedulerConfig(), beams=True)
    assert generate(path, batch, SchedulerConfig(step_token_budget=8), beams=True) == default
    for whole_chunks in (True, False):
        config = SchedulerConfig(prefill_token_budget=8, admit_whole_chunks=whole_chunks)
        assert generate(path, batch, config, beams=True) == default
    by_priority = generate(path, batch, SchedulerConfig(scheduling_policy="priority"),
                           priority=[2, 0, 1, 0, 2, 1], beams=True)
    assert by_priority == default
    with torch.no_grad():
        ref = model.generate(torch.tensor([batch[1]]), do_sample=False, max_new_tokens=12,
                             min_new_tokens=12, pad_token_id=0)
    assert default[1][0] == ref[0, len(batch[1]):].tolist()


def test_priority_needs_the_priority_policy(tiny_llama):
    path, _ = tiny_llama
    with LLM(str(path), dtype="float32", kv_cache_config=KV) as llm:
        with pytest.raises(ValueError, match="^priority: .*scheduling_policy"):
            llm.generate([1, 2, 3], priority=1, use_tqdm=False)
        with pytest.raises(ValueError, match="^priority: 2 given for 1 prompts"):
            llm.generate([[1, 2, 3]], priority=[0, 0], use_tqdm=False)
        with pytest.raises(ValueError, match="^priority: must be an integer"):
            llm.generate({"prompt_token_ids": [1, 2], "priority": "high"}, use_tqdm=False)
        assert llm.generate([1, 2, 3], priority=0, use_tqdm=False).outputs


def test_step_token_budget_is_checked_against_the_engine():
    with pytest.raises(ValueError, match="step_token_budget .*max_num_tokens"):
        LlmArgs(model="x", max_num_tokens=64,
                scheduler_config=SchedulerConfig(step_token_budget=128))
    with pytest.raises(ValueError, match="step_token_budget needs enable_chunked_prefill"):
        LlmArgs(model="x", enable_chunked_prefill=False,
                scheduler_config=SchedulerConfig(step_token_budget=64))
    with pytest.raises(ValueError, match="prefill_token_budget .*max_num_tokens"):
        LlmArgs(model="x", max_num_tokens=64,
                scheduler_config=SchedulerConfig(prefill_token_budget=128))
    with pytest.raises(ValueError, match="not both"):
        LlmArgs(model="x", scheduler_config=SchedulerConfig(step_token_budget=64,
                                                            prefill_token_budget=64))
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")


def test_scheduler_flags_merge_over_the_config_file(tmp_path):
    import argparse

    from tllm.llmapi.cli_args import add_engine_args, llm_kwargs
    path = tmp_path / "llm.yml"
    path.write_text("scheduler_config:\n  preemption_mode: swap\n  step_token_budget: 64\n")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--config", str(path), "--step-token-budget", "256",
                              "--scheduling-policy", "priority"])
    assert parser.parse_args(["--prefill-token-budget", "512"]).prefill_token_budget == 512
    kwargs = llm_kwargs(args, model="m")
    assert kwargs["scheduler_config"] == {"preemption_mode": "swap", "step_token_budget": 256,
                                          "scheduling_policy": "priority"}
    LlmArgs(**kwargs)
