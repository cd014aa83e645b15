"""Bad inputs of the pooling and token routes, over the pooling engine double: each a 400
with OpenAI's error body naming the field (empty lists, more items than the cap, ids out of
the vocabulary, dimensions out of range, inputs longer than max_seq_len); then the server
keeps serving. The API key covers the new routes."""
from __future__ import annotations

import httpx
import pytest

from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread
from tllm.serve.testing_pooling import FakePoolingLLM
from tests.serve.helpers import assert_openai_error

MAX_SEQ_LEN = 64
EMBEDDINGS, SCORE, RERANK = "/v1/embeddings", "/v1/score", "/v1/rerank"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"
KEY = "sesame-0123456789"
BEARER = {"Authorization": f"Bearer {KEY}"}
GOOD = {EMBEDDINGS: {"input": "hi"}, SCORE: {"text_1": "a", "text_2": "b"},
        RERANK: {"query": "a", "documents": ["b"]}, TOKENIZE: {"prompt": "hi"},
        DETOKENIZE: {"tokens": [104, 105]}}

BAD = [
    ("empty input list", EMBEDDINGS, {"input": []}, "input"),
    ("empty input", EMBEDDINGS, {"input": ""}, "input"),
    ("an empty input in a list", EMBEDDINGS, {"input": ["a", ""]}, "input"),
    ("an empty token list", EMBEDDINGS, {"input": [[1], []]}, "input"),
    ("more inputs than the cap", EMBEDDINGS, {"input": ["a"] * 2049}, "input"),
    ("10,000 inputs", EMBEDDINGS, {"input": ["a"] * 10_000}, "input"),
    ("token id out of the vocabulary", EMBEDDINGS, {"input": [1, 256]}, "input"),
    ("huge token id", EMBEDDINGS, {"input": [[1], [2**70]]}, "input"),
    ("negative token id", EMBEDDINGS, {"input": [1, -1]}, "input"),
    ("mixed input list", EMBEDDINGS, {"input": ["a", 1]}, "input"),
    ("input of the wrong type", EMBEDDINGS, {"input": 5}, "input"),
    ("input missing", EMBEDDINGS, {}, "input"),
    ("input longer than max_seq_len", EMBEDDINGS, {"input": "x" * (MAX_SEQ_LEN + 1)}, "input"),
    ("ids longer than max_seq_len", EMBEDDINGS, {"input": [1] * (MAX_SEQ_LEN + 1)}, "input"),
    ("dimensions above the embedding size", EMBEDDINGS, {"input": "a", "dimensions": 9},
     "dimensions"),
    ("zero dimensions", EMBEDDINGS, {"input": "a", "dimensions": 0}, "dimensions"),
    ("negative dimensions", EMBEDDINGS, {"input": "a", "dimensions": -1}, "dimensions"),
    ("unknown encoding_format", EMBEDDINGS, {"input": "a", "encoding_format": "hex"},
     "encoding_format"),
    ("empty text_2 list", SCORE, {"text_1": "a", "text_2": []}, "text_2"),
    ("more text_2 than the cap", SCORE, {"text_1": "a", "text_2": ["b"] * 2049}, "text_2"),
    ("text_1 of the wrong type", SCORE, {"text_1": 1, "text_2": "b"}, "text_1"),
    ("N:M texts", SCORE, {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
    ("no documents", RERANK, {"query": "a", "documents": []}, "documents"),
    ("more documents than the cap", RERANK, {"query": "a", "documents": ["b"] * 2049},
     "documents"),
    ("negative top_n", RERANK, {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("document without text", RERANK, {"query": "a", "documents": [{"txt": "b"}]},
     "documents"),
    ("query missing", RERANK, {"documents": ["b"]}, "query"),
    ("neither prompt nor messages", TOKENIZE, {}, None),
    ("both prompt and messages", TOKENIZE,
     {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, None),
    ("empty messages", TOKENIZE, {"messages": []}, "messages"),
    ("reserved template variable", TOKENIZE,
     {"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"tokenize": 1}},
     "chat_template_kwargs"),
    ("token id out of the vocabulary", DETOKENIZE, {"tokens": [256]}, "tokens"),
    ("negative token id", DETOKENIZE, {"tokens": [-1]}, "tokens.0"),
    ("token ids missing", DETOKENIZE, {}, "tokens"),
]


@pytest.fixture(scope="module")
def http():
    llm = FakePoolingLLM(task="embed", embedding_size=8, max_seq_len=MAX_SEQ_LEN)
    with ServerThread(build_app(llm, ServerConfig(model="embedder"))) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            yield client


@pytest.mark.parametrize("path,body,param", [case[1:] for case in BAD],
                         ids=[f"{case[1]} {case[0]}" for case in BAD])
def test_bad_input_is_a_400_naming_the_field(http, path, body, param):
    error = assert_openai_error(http.post(path, json=body), 400)
    assert error["param"] == param, error
    assert http.post(path, json=GOOD[path]).status_code == 200


def test_inputs_up_to_max_seq_len_and_the_cap_pass(http):
    assert http.post(EMBEDDINGS, json={"input": "x" * MAX_SEQ_LEN}).status_code == 200
    assert http.post(EMBEDDINGS, json={"input": ["a"] * 2048}).status_code == 200


def test_the_cap_is_a_setting():
    llm = FakePoolingLLM(task="score")
    with ServerThread(build_app(llm, ServerConfig(model="s", max_pooling_inputs=2))) as server:
        refused = httpx.post(server.base_url + RERANK, json={"query": "a",
                                                             "documents": ["a"] * 3})
        passed = httpx.post(server.base_url + RERANK, json={"query": "a",
                                                            "documents": ["a"] * 2})
    assert "--max-pooling-inputs" in assert_openai_error(refused, 400)["message"]
    assert passed.status_code == 200


def test_the_api_key_covers_the_pooling_and_token_routes():
    llm = FakePoolingLLM(task="embed")
    with ServerThread(build_app(llm, ServerConfig(model="e", api_key=KEY))) as server:
        with httpx.Client(base_url=server.base_url) as client:
            for path, body in GOOD.items():
                if path in (SCORE, RERANK, EMBEDDINGS, TOKENIZE, DETOKENIZE):
                    error = assert_openai_error(client.post(path, json=body), 401)
                    assert error["code"] == "invalid_api_key"
                    assert client.post(path, json=body, headers=BEARER).status_code == 200
            v2 = client.post("/v2/rerank", json=GOOD[RERANK])
    assert v2.status_code == 401


@pytest.mark.parametrize("ids", [[1, 256], [1, -1], [2**70]], ids=["256", "-1", "2**70"])
def test_the_server_refuses_ids_outside_the_vocabulary_before_the_engine(http, ids):
    error = assert_openai_error(http.post(EMBEDDINGS, json={"input": ids}), 400)
    assert "outside the vocabulary (size 256)" in error["message"], error
