"""Full blocks become reusable as soon as they are computed, whatever the request does next:
a request that finishes in its prefill step (max_tokens=1, as evaluation harnesses and a
disaggregated context server send) publishes its prompt blocks too."""
from __future__ import annotations

import pytest

from tllm import LLM, KvCacheConfig, SamplingParams

pytestmark = pytest.mark.slow
BLOCK = 16
PROMPT = ("Reuse of the KV cache across requests means that a prefix computed once can be "
          "attached to a later request with the same first tokens, instead of being computed "
          "again, which saves both time and memory for every request sharing the prefix. "
          "A request that ends in its prefill step must publish its blocks all the same.")


def reused_by(llm, prompt, max_tokens) -> int:
    before = llm.get_kv_cache_stats()["blocks_reused"]
    llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
    return llm.get_kv_cache_stats()["blocks_reused"] - before


@pytest.mark.parametrize("overlap", [True, False])
def test_a_request_ending_in_its_prefill_step_publishes_its_blocks(overlap):
    with LLM("smollm2", max_seq_len=256, disable_overlap_scheduler=not overlap,
             kv_cache_config=KvCacheConfig(tokens_per_block=BLOCK, max_tokens=2048)) as llm:
        num_tokens = len(llm.tokenizer.encode(PROMPT))
        full_blocks = (num_tokens - 1) // BLOCK     # the last token is always computed
        assert full_blocks >= 3
        assert reused_by(llm, PROMPT, 1) == 0       # the first one computes everything
        assert reused_by(llm, PROMPT, 1) == full_blocks
        assert reused_by(llm, PROMPT, 4) == full_blocks
