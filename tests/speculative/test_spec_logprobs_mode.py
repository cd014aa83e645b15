"""logprobs_mode with speculative decoding on (a tiny random Llama drafting for itself, fp32,
CPU): the accepted tokens' logprobs are those of the distribution the mode names, at each
position, as without speculation (HF's warpers on HF's logits are the reference)."""
from __future__ import annotations

import pytest

from tests.sampling.test_logprobs_mode import PROMPT, _check_output
from tllm import LLM, DraftTargetDecodingConfig, KvCacheConfig, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    path = str(tiny_llama[0])
    with LLM(path, max_num_tokens=64, max_batch_size=4, max_seq_len=128,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024),
             speculative_config=DraftTargetDecodingConfig(speculative_model=path,
                                                          max_draft_len=3)) as llm:
        yield llm


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=8, temperature=0.7, top_k=20, seed=3, logprobs=3,
                   logprobs_mode="tempered_logprobs"),
    SamplingParams(max_tokens=8, temperature=0.7, top_k=20, top_p=0.9, seed=3, logprobs=3,
                   logprobs_mode="processed_logprobs"),
    SamplingParams(max_tokens=8, temperature=0, top_k=5, logprobs=2,
                   logprobs_mode="processed_logprobs"),
    SamplingParams(max_tokens=8, temperature=0.8, seed=4, logprobs=2),
], ids=["tempered", "processed-topk-topp", "processed-greedy", "raw-sampled"])
def test_accepted_tokens_logprobs_follow_the_mode(llm, tiny_llama, params):
    params.ignore_eos = True
    before = llm.get_stats()["spec_accepted_tokens"]
    output = llm.generate(PROMPT, params, use_tqdm=False)
    assert llm.get_stats()["spec_accepted_tokens"] > before   # drafts were kept
    _check_output(tiny_llama[1], output, params)
