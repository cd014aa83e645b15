"""POST /v1/rerank, /v2/rerank and /v1/score over the pooling engine double: a cross-encoder
(score task) and an embedding model (cosine); ordering, top_n, documents, score shapes."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread
from tllm.serve.testing_pooling import FakePoolingLLM, fake_embedding
from tests.serve.helpers import assert_openai_error

QUERY = "abcd"
# The fake cross-encoder scores the share of the query's bytes a document holds.
DOCUMENTS = ["xyz", "abcd", "ab", "a"]
SCORES = [0.0, 1.0, 0.5, 0.25]


def serve(task: str):
    return ServerThread(build_app(FakePoolingLLM(task=task), ServerConfig(model=task)))


@pytest.fixture(scope="module")
def http():
    with serve("score") as server, httpx.Client(base_url=server.base_url) as client:
        yield client


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_rerank_orders_by_relevance(http, path):
    body = http.post(path, json={"query": QUERY, "documents": DOCUMENTS}).json()
    assert [r["index"] for r in body["results"]] == [1, 2, 3, 0]
    assert [r["relevance_score"] for r in body["results"]] == [1.0, 0.5, 0.25, 0.0]
    assert [r["document"]["text"] for r in body["results"]] == ["abcd", "ab", "a", "xyz"]
    num_tokens = sum(len(QUERY) + len(d) for d in DOCUMENTS)
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    assert body["model"] == "score" and body["id"].startswith("rerank-")


def test_rerank_top_n_document_objects_and_no_documents(http):
    body = http.post("/v1/rerank", json={
        "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "top_n": 2,
        "return_documents": False}).json()
    assert [(r["index"], r["document"]) for r in body["results"]] == [(1, None), (2, None)]
    every = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS,
                                          "top_n": 10}).json()
    assert len(every["results"]) == len(DOCUMENTS)


def test_score_one_to_one_one_to_n_and_n_to_n(http):
    one = http.post("/v1/score", json={"text_1": QUERY, "text_2": "ab"}).json()
    assert [(d["index"], d["score"], d["object"]) for d in one["data"]] == [(0, 0.5, "score")]
    many = http.post("/v1/score", json={"text_1": [QUERY], "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in many["data"]] == SCORES
    pairs = http.post("/v1/score", json={"text_1": ["ab", "xy", "a"],
                                         "text_2": ["abc", "x", "b"]}).json()
    assert [d["score"] for d in pairs["data"]] == [1.0, 0.5, 0.0]
    assert pairs["usage"]["prompt_tokens"] == 2 + 3 + 2 + 1 + 1 + 1


def test_score_of_lists_of_two_lengths_is_a_400(http):
    response = http.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert assert_openai_error(response, 400)["param"] == "text_2"


def test_an_embedding_model_scores_by_cosine():
    with serve("embed") as server:
        body = httpx.post(server.base_url + "/v1/score",
                          json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
        ranked = httpx.post(server.base_url + "/v1/rerank",
                            json={"query": QUERY, "documents": DOCUMENTS}).json()
    query = fake_embedding(list(QUERY.encode()), 8)
    cosines = [float(np.dot(query, fake_embedding(list(d.encode()), 8))) for d in DOCUMENTS]
    np.testing.assert_allclose([d["score"] for d in body["data"]], cosines, atol=1e-9)
    assert [r["index"] for r in ranked["results"]] == list(np.argsort(cosines)[::-1])


@pytest.mark.parametrize("path,body", [
    ("/v1/score", {"text_1": "a", "text_2": "b"}),
    ("/v1/rerank", {"query": "a", "documents": ["b"]}),
    ("/v1/embeddings", {"input": "a"}),
    ("/v1/completions", {"prompt": "a"})])
def test_a_classifier_answers_other_tasks_routes_with_a_400(path, body):
    with serve("classify") as server:
        response = httpx.post(server.base_url + path, json=body)
        tokens = httpx.post(server.base_url + "/tokenize", json={"prompt": "a"})
    error = assert_openai_error(response, 400)
    assert error["code"] == "unsupported_task" and "'classify'" in error["message"]
    assert tokens.json()["tokens"] == [97]
