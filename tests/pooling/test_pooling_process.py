"""ProcessLLM forwards pooling requests to its engine process: the same outputs as LLM's,
refusals as ValueError, task and pooling info from the engine."""
import asyncio

import numpy as np
import pytest

from tiny_models import TEXTS, add_sentence_transformers_layout, save_bert
from tllm import LLM
from tllm.config import KvCacheConfig
from tllm.llmapi.process_llm import ProcessLLM
from tllm.pooling_params import PoolingParams

KV = KvCacheConfig(tokens_per_block=4, max_tokens=512)


def test_process_llm_encodes_as_llm_does(tmp_path):
    save_bert(tmp_path, "BertModel")
    add_sentence_transformers_layout(tmp_path, "mean", True)
    with LLM(str(tmp_path), kv_cache_config=KV) as llm:
        expected = [o.embedding for o in llm.embed(TEXTS)]
        expected_scores = [o.score for o in llm.score(TEXTS[0], TEXTS[1:])]

    async def run(remote):
        outputs = await asyncio.gather(*[
            remote.encode_async(t, PoolingParams("embed")) for t in TEXTS])
        scores = await remote.score_async(TEXTS[0], TEXTS[1:])
        with pytest.raises(ValueError, match="dimensions"):
            await remote.encode_async("the cat", PoolingParams("embed", dimensions=64))
        with pytest.raises(ValueError, match="vocabulary"):
            await remote.encode_async([10**6], PoolingParams("embed"))
        return outputs, scores

    with ProcessLLM(str(tmp_path), kv_cache_config=KV) as remote:
        assert remote.task == "embed"
        assert remote.pooling_info == {"embedding_size": 32, "labels": None}
        outputs, scores = asyncio.run(run(remote))
        np.testing.assert_allclose([o.embedding for o in remote.embed(TEXTS[:2])],
                                   expected[:2], atol=1e-6)
        np.testing.assert_allclose([s.score for s in remote.score(TEXTS[0], TEXTS[1:])],
                                   expected_scores, atol=1e-6)
    np.testing.assert_allclose([o.embedding for o in outputs], expected, atol=1e-6)
    np.testing.assert_allclose([s.score for s in scores], expected_scores, atol=1e-6)
