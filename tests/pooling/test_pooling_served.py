"""The pooling routes over the real engine (the route tests use an engine double): the
official openai client's embeddings equal sentence-transformers' `encode`, /v1/rerank's
scores equal HF's cross-encoder, /tokenize counts what the model's tokenizer makes."""
import base64

import httpx
import numpy as np
import openai
import torch

from test_pooling_models import TOL, make_llm, st_encode
from tiny_models import TEXTS, add_sentence_transformers_layout, save_bert
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread


def test_openai_embeddings_equal_sentence_transformers(tmp_path):
    save_bert(tmp_path, "BertModel")
    add_sentence_transformers_layout(tmp_path, "mean", True)
    expected = st_encode(tmp_path, TEXTS)
    with make_llm(tmp_path, max_num_tokens=32) as llm, \
            ServerThread(build_app(llm, ServerConfig(model="bert"))) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        floats = client.embeddings.create(model="bert", input=TEXTS)
        packed = client.embeddings.create(model="bert", input=TEXTS,
                                          encoding_format="base64")
        tokens = httpx.post(server.base_url + "/tokenize",
                            json={"model": "bert", "prompt": TEXTS[1]}).json()
        encoded = [llm.tokenizer.encode(text) for text in TEXTS]
    np.testing.assert_allclose([d.embedding for d in floats.data], expected, atol=TOL)
    # the openai client decodes base64 itself when it asked for it; raw strings otherwise
    got = [d.embedding if isinstance(d.embedding, list)
           else np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in packed.data]
    np.testing.assert_allclose(got, expected, atol=TOL)
    assert floats.usage.prompt_tokens == sum(len(ids) for ids in encoded)
    assert tokens["tokens"] == encoded[1]


def test_rerank_scores_equal_hf_cross_encoder(tmp_path):
    from transformers import AutoTokenizer
    hf = save_bert(tmp_path, "BertForSequenceClassification", num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    query, docs = TEXTS[3], TEXTS[:3]
    with torch.no_grad():
        expected = [float(torch.sigmoid(hf(**tokenizer(query, d, return_tensors="pt"))
                                        .logits)[0, 0]) for d in docs]
    with make_llm(tmp_path) as llm, \
            ServerThread(build_app(llm, ServerConfig(model="ce"))) as server:
        body = httpx.post(server.base_url + "/v1/rerank",
                          json={"model": "ce", "query": query, "documents": docs}).json()
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(docs))], expected, atol=TOL)
    assert [r["index"] for r in body["results"]] == list(np.argsort(expected)[::-1])
