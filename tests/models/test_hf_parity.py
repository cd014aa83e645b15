"""Greedy tokens and logprobs equal HF transformers' (fp32, CPU) for each model family, with
prompts of many lengths sharing one continuous batch: chunked prefill, queued requests,
prefix reuse and small KV blocks all on at once."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import make_tiny_model
from tests.models.hf_reference import assert_greedy_matches_hf, generate_batch, make_prompts
from tllm import LLM, KvCacheConfig, SamplingParams



@pytest.mark.parametrize("arch", ["Llama", "Mistral", "Qwen2", "Qwen3"])
def test_greedy_matches_hf_in_continuous_batch(arch, tmp_path):
    hf_model = make_tiny_model(arch, tmp_path)
    prompts = make_prompts(hf_model.config.vocab_size)
    assert_greedy_matches_hf(hf_model, prompts, generate_batch(tmp_path, prompts))


def test_prompt_logprobs_match_hf(tiny_llama):
    path, hf_model = tiny_llama
    prompt = make_prompts(hf_model.config.vocab_size)[2]
    with LLM(str(path), max_num_tokens=16,
             kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512)) as llm:
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3),
                           use_tqdm=False)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-3
        assert len(entry) >= 3
