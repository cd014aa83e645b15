"""Pooling requests through the LLM API on a generating model (tiny random Qwen3, fp32):
they ride the same batches as generation without changing its tokens, hold no KV blocks once
done, embed as HF's last hidden state does, and bad arguments raise ValueError naming them."""
import asyncio

import numpy as np
import pytest
import torch

from tiny_models import TEXTS, save_bert, save_qwen3
from tllm import LLM, SamplingParams
from tllm.config import KvCacheConfig
from tllm.pooling_params import PoolingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_causal")
    hf = save_qwen3(path, "Qwen3ForCausalLM")
    llm = LLM(str(path), max_num_tokens=16, max_batch_size=16,
              kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024))
    yield llm, hf
    llm.shutdown()


def test_a_generating_model_embeds_its_last_token(qwen3):
    llm, hf = qwen3
    assert llm.task == "generate"
    assert llm.pooling_info == {"embedding_size": 32, "labels": None}
    outputs = llm.embed(TEXTS)
    for text, output in zip(TEXTS, outputs):
        ids = llm.tokenizer.encode(text)
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            hidden = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
        np.testing.assert_allclose(output.embedding,
                                   torch.nn.functional.normalize(hidden, dim=-1), atol=1e-5)


def test_pooling_beside_generation_leaves_its_tokens_and_no_blocks(qwen3):
    llm, _ = qwen3
    prompts = TEXTS[:3]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    free_before = llm.get_stats()["kv_blocks_free"]
    results = [llm.generate_async(p, GREEDY) for p in prompts]
    embeddings = llm.embed(TEXTS * 3)      # while those generate: in the same steps
    beside = [r.result(timeout=60).outputs[0].token_ids for r in results]
    assert beside == alone
    # the later copies reuse the first's cached prefix blocks: the same embeddings
    first = np.array([o.embedding for o in embeddings[:len(TEXTS)]])
    for copy in (1, 2):
        again = embeddings[copy * len(TEXTS):(copy + 1) * len(TEXTS)]
        np.testing.assert_allclose([o.embedding for o in again], first, atol=1e-6)
    assert llm.get_stats()["kv_blocks_free"] == free_before


def test_encode_async_and_score_async_of_an_embedder(qwen3):
    llm, _ = qwen3

    async def run():
        one = await llm.encode_async({"prompt_token_ids": [5, 6, 7]},
                                     PoolingParams("embed", dimensions=4), request_id="e1")
        scores = await llm.score_async(TEXTS[0], TEXTS[1:3])
        return one, scores
    one, scores = asyncio.run(run())
    assert one.request_id == "e1" and len(one.embedding) == 4
    cut = llm.embed({"prompt_token_ids": [9, 9, 5, 6, 7]}, dimensions=4)[0]
    assert llm.embed([[1, 2, 3]])[0].prompt_token_ids == [1, 2, 3]
    truncated = asyncio.run(llm.encode_async(
        [9, 9, 5, 6, 7], PoolingParams("embed", dimensions=4, truncate_prompt_tokens=3)))
    assert truncated.prompt_token_ids == [5, 6, 7]
    np.testing.assert_allclose(truncated.embedding, one.embedding, atol=1e-6)
    assert cut.prompt_token_ids == [9, 9, 5, 6, 7]
    assert abs(np.linalg.norm(one.embedding) - 1) < 1e-5
    query, *docs = llm.embed(TEXTS[:3])
    expected = [float(np.dot(query.embedding, d.embedding)) for d in docs]
    np.testing.assert_allclose([s.score for s in scores], expected, atol=1e-5)
    np.testing.assert_allclose([s.score for s in llm.score(TEXTS[0], TEXTS[1:3])], expected,
                               atol=1e-5)


@pytest.mark.parametrize("call,match", [
    (lambda llm: llm.embed([]), "prompts"),
    (lambda llm: llm.embed([[1, 2, 10**6]]), "vocabulary"),
    (lambda llm: llm.embed([[1, -2]]), "prompt_token_ids"),
    (lambda llm: llm.embed(""), "empty"),
    (lambda llm: llm.embed(TEXTS, dimensions=33), "dimensions"),
    (lambda llm: llm.embed(TEXTS, dimensions=0), "dimensions"),
    (lambda llm: llm.classify(TEXTS), "task"),
    (lambda llm: llm.score("q", []), "documents"),
    (lambda llm: llm.score("", ["d"]), "query"),
    (lambda llm: asyncio.run(llm.encode_async("x", "embed")), "params"),
    (lambda llm: PoolingParams("rerank"), "task"),
    (lambda llm: PoolingParams("classify", dimensions=4), "dimensions"),
])
def test_bad_arguments_raise_value_error_naming_them(qwen3, call, match):
    llm, _ = qwen3
    free_before = llm.get_stats()["kv_blocks_free"]
    with pytest.raises(ValueError, match=match):
        call(llm)
    assert llm.get_stats()["kv_blocks_free"] == free_before


def test_an_encoder_refuses_generation_and_frees_its_blocks(tmp_path):
    save_bert(tmp_path, "XLMRobertaModel")  # positions from pad + 1 = 1: at most 63
    with pytest.raises(ValueError, match="task"):
        LLM(str(tmp_path), task="generate")
    with LLM(str(tmp_path), max_num_tokens=12,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=256)) as llm:
        free_before = llm.get_stats()["kv_blocks_free"]
        with pytest.raises(ValueError, match="task"):
            llm.generate("the cat", GREEDY)
        with pytest.raises(ValueError, match="max_num_tokens"):  # no chunks: one step
            llm.embed("the cat sat on the mat the dog ran fast on the river")
        with pytest.raises(ValueError, match="63"):
            llm.embed([[5] * 64])
        assert len(llm.embed(TEXTS * 4)) == 24
        assert llm.get_stats()["kv_blocks_free"] == free_before


def test_pooling_beside_speculative_decoding(qwen3, tmp_path):
    """Steps whose generation request carries n-gram drafts still end their pooling
    requests (small waves of them, sent while it decodes), and its tokens stay as they
    are without any."""
    from tllm.config import NGramDecodingConfig
    base, _ = qwen3
    expected = [o.embedding for o in base.embed(TEXTS[:2])]
    repetitive = "the cat sat on the mat the cat sat on the mat the cat"
    long_greedy = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    alone = base.generate(repetitive, long_greedy, use_tqdm=False).outputs[0].token_ids
    save_qwen3(tmp_path, "Qwen3ForCausalLM")   # the same seed: the fixture's weights
    with LLM(str(tmp_path), max_num_tokens=16, max_batch_size=16,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024),
             speculative_config=NGramDecodingConfig(max_draft_len=3)) as llm:
        result = llm.generate_async(repetitive, long_greedy)
        waves = [llm.embed(TEXTS[:2]) for _ in range(40)]
        assert result.result(timeout=60).outputs[0].token_ids == alone
    for wave in waves:
        np.testing.assert_allclose([o.embedding for o in wave], expected, atol=1e-5)
