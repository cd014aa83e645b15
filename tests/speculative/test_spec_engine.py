"""N-gram speculation through the whole engine on a tiny random Llama: greedy output equal
to the same engine without it (mixed batches, chunked prefill, prefix reuse, preemption with
a tiny pool), counters that add up, all KV blocks free afterwards."""
from __future__ import annotations

import pytest
import torch

from tllm import LLM, KvCacheConfig, SamplingParams
from tllm.config import NGramDecodingConfig

NUM_NEW = 24


def repetitive_prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat spans (n-gram lookup finds them) and some that never do."""
    g = torch.Generator().manual_seed(3)
    span = torch.randint(3, vocab, (7,), generator=g).tolist()
    prompts = [span * 4, span * 2 + [9, 10] + span, list(range(3, 40)),
               torch.randint(3, vocab, (30,), generator=g).tolist(), [5]]
    prompts.append(prompts[0][:20] + [11, 12])  # shares a prefix with prompt 0
    prompts.append(prompts[0])                  # a whole-prompt prefix hit
    return prompts


def run(path, prompts, spec, *, params=None, **kwargs):
    params = params or SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
    args = dict(max_num_tokens=24, max_batch_size=3,
                kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=2048))
    args.update(kwargs)
    if spec:
        args["speculative_config"] = NGramDecodingConfig(max_draft_len=4,
                                                         max_matching_ngram_size=3)
    with LLM(str(path), **args) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        kv = llm._engine.kv_cache
        assert kv.num_free_blocks == kv.num_blocks
        stats = llm.get_stats()
    return [o.outputs[0].token_ids for o in outputs], stats


def test_greedy_identical_with_ngram_in_a_continuous_batch(tiny_llama):
    path, hf = tiny_llama
    prompts = repetitive_prompts(hf.config.vocab_size)
    plain, _ = run(path, prompts, spec=False)
    spec, stats = run(path, prompts, spec=True)
    assert spec == plain
    assert stats["spec_draft_tokens"] > 0
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert stats["spec_acceptance_rate"] == pytest.approx(
        stats["spec_accepted_tokens"] / stats["spec_draft_tokens"])


def test_a_failing_drafter_turns_speculation_off_and_requests_go_on(tiny_llama, monkeypatch):
    """Drafts only speed decoding up: a drafter that raises (the MTP head's bf16 router did,
    every step, on a GPU) is logged once and speculation is off; every request finishes
    with the tokens it gets without speculation (before: the same requests were scheduled
    into the failure again, forever)."""
    from tllm.speculative.ngram import NGramDrafter
    path, hf = tiny_llama
    prompts = repetitive_prompts(hf.config.vocab_size)
    plain, _ = run(path, prompts, spec=False)
    real, calls = NGramDrafter.propose, []

    def fails_on_the_third_call(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the drafter broke")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(NGramDrafter, "propose", fails_on_the_third_call)
    spec, stats = run(path, prompts, spec=True)
    assert spec == plain
    assert len(calls) == 3 and stats["spec_drafter_off"] == 1


def test_counters_add_up_at_batch_one(tiny_llama):
    """One request, prompt in one step: every later step gains its accepted drafts plus one
    token, so outputs = steps + accepted."""
    path, hf = tiny_llama
    prompt = repetitive_prompts(hf.config.vocab_size)[0]
    with LLM(str(path), kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=512),
             speculative_config=NGramDecodingConfig(max_draft_len=3)) as llm:
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                           use_tqdm=False)
        stats = llm.get_stats()
    num_output = len(out.outputs[0].token_ids)
    assert num_output == 30
    assert num_output == stats["num_steps"] + stats["spec_accepted_tokens"]
    assert stats["spec_verify_steps"] <= stats["num_steps"] - 1
    assert stats["spec_mean_accepted_length"] == pytest.approx(
        1 + stats["spec_accepted_tokens"] / stats["spec_verify_steps"])
    print(stats)


def test_greedy_identical_under_preemption_with_a_tiny_pool(tiny_llama):
    """MAX_UTILIZATION with 24 blocks of 4 tokens for 7 requests: requests are preempted
    (recomputed) while they hold drafts' blocks, and still end as without speculation."""
    from tllm.config import SchedulerConfig
    path, hf = tiny_llama
    prompts = repetitive_prompts(hf.config.vocab_size)
    kwargs = dict(kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=96),
                  scheduler_config=SchedulerConfig(capacity_scheduler_policy="MAX_UTILIZATION"),
                  max_batch_size=4)
    plain, plain_stats = run(path, prompts, spec=False, **kwargs)
    spec, stats = run(path, prompts, spec=True, **kwargs)
    assert spec == plain
    assert stats["num_preemptions"] > 0 and stats["spec_accepted_tokens"] > 0


def test_sliding_window_model_rolls_back_within_its_window(tmp_path):
    """A Mistral with a window of 8 and 4-token blocks gives back blocks behind the window;
    a rollback must never need one of those back."""
    import transformers
    from tests.conftest import TINY
    torch.manual_seed(0)
    config = transformers.MistralConfig(**TINY, sliding_window=8,
                                        architectures=["MistralForCausalLM"])
    transformers.MistralForCausalLM(config).eval().save_pretrained(tmp_path)
    prompts = repetitive_prompts(config.vocab_size)
    plain, _ = run(tmp_path, prompts, spec=False)
    spec, stats = run(tmp_path, prompts, spec=True)
    assert spec == plain
    assert stats["kv_blocks_freed_by_window"] > 0 and stats["spec_accepted_tokens"] > 0


def test_sampling_with_speculation_reproduces_with_seeds(tiny_llama):
    """Seeded sampled requests speculate too (rejection sampling); the same seeds give the
    same tokens run to run, whatever else is in the batch."""
    path, hf = tiny_llama
    prompts = repetitive_prompts(hf.config.vocab_size)[:3]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.7, top_k=20, seed=5,
                            ignore_eos=True)
    first, stats = run(path, prompts, spec=True, params=params)
    again, _ = run(path, prompts[:1], spec=True, params=params)
    assert first[0] == again[0]
    assert stats["spec_draft_tokens"] > 0


def test_spec_config_from_yaml_and_metrics(tiny_llama, tmp_path):
    """`--speculative-config spec.yml` reaches LlmArgs; /metrics shows the counters."""
    import argparse

    from tllm.llmapi.cli_args import add_engine_args, llm_kwargs
    from tllm.serve.http.metrics import ServerMetrics
    path, _ = tiny_llama
    spec = tmp_path / "spec.yml"
    spec.write_text("decoding_type: NGram\nmax_draft_len: 3\nmax_matching_ngram_size: 2\n")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = llm_kwargs(parser.parse_args(["--speculative-config", str(spec)]), str(path))
    with LLM(**kwargs) as llm:
        assert llm.args.speculative_config == NGramDecodingConfig(
            max_draft_len=3, max_matching_ngram_size=2)
        llm.generate({"prompt_token_ids": [5, 6, 7] * 6},
                     SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                     use_tqdm=False)
        text = ServerMetrics("m", llm.get_stats).render().decode()
        drafted = llm.get_stats()["spec_draft_tokens"]
    assert f'tllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {float(drafted)}' in text
    assert "tllm:spec_decode_mean_accepted_length" in text
    bad = tmp_path / "bad.yml"
    bad.write_text("decoding_type: Medusa\n")
    with pytest.raises(ValueError, match="decoding_type"):
        LLM(**llm_kwargs(parser.parse_args(["--speculative-config", str(bad)]), str(path)))
