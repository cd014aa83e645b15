"""POST /v1/embeddings over the pooling engine double: the official openai client's
embeddings.create unmodified (floats and base64), every input form, dimensions, usage, the
inputs sent to the engine at once; the task decides which routes answer."""
from __future__ import annotations

import base64
import time

import httpx
import numpy as np
import openai
import pytest

from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import FakeLLM, ServerThread
from tllm.serve.testing_pooling import FakePoolingLLM, fake_embedding
from tests.serve.helpers import assert_openai_error

TEXTS = ["hello", "the quick brown fox", "a"]
SIZE = 8


@pytest.fixture(scope="module")
def llm():
    return FakePoolingLLM(task="embed", embedding_size=SIZE)


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(build_app(llm, ServerConfig(model="embedder"))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


def expected(text: str, dimensions: int = SIZE) -> np.ndarray:
    vector = np.asarray(fake_embedding(list(text.encode()), SIZE)[:dimensions])
    return vector / np.linalg.norm(vector)


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
def test_openai_client_embeddings_create(client, encoding_format):
    kwargs = {} if encoding_format is None else {"encoding_format": encoding_format}
    out = client.embeddings.create(model="embedder", input=TEXTS, **kwargs)
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == "embedder"
    for text, item in zip(TEXTS, out.data):
        embedding = item.embedding
        if encoding_format == "base64":     # the client hands base64 back as it came
            embedding = np.frombuffer(base64.b64decode(embedding), dtype="<f4")
        np.testing.assert_allclose(embedding, expected(text), rtol=1e-6, atol=1e-6)
    num_tokens = sum(len(t.encode()) for t in TEXTS)
    assert out.usage.prompt_tokens == out.usage.total_tokens == num_tokens


def test_base64_is_little_endian_float32_of_the_float_vector(http):
    floats = http.post("/v1/embeddings", json={"input": "hello"}).json()
    encoded = http.post("/v1/embeddings", json={"input": "hello", "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(encoded.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(decoded, np.float32(floats["data"][0]["embedding"]))


@pytest.mark.parametrize("value", ["hello", ["hello"], list(b"hello"), [list(b"hello")]],
                         ids=["text", "texts", "token ids", "token id lists"])
def test_every_input_form(http, value):
    body = http.post("/v1/embeddings", json={"input": value}).json()
    assert len(body["data"]) == 1 and body["object"] == "list"
    np.testing.assert_allclose(body["data"][0]["embedding"], expected("hello"), atol=1e-9)
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5}


def test_dimensions_truncate_and_renormalise(client):
    out = client.embeddings.create(model="embedder", input="hello", dimensions=3,
                                   encoding_format="float")
    np.testing.assert_allclose(out.data[0].embedding, expected("hello", 3), atol=1e-9)


def test_a_request_s_inputs_go_to_the_engine_at_once(http, llm):
    llm.max_in_flight = 0
    texts = [f"text {i}" for i in range(20)]
    assert http.post("/v1/embeddings", json={"input": texts}).status_code == 200
    assert llm.max_in_flight == len(texts)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi"})])
def test_generation_routes_of_an_embedding_model_name_the_task(http, path, body):
    error = assert_openai_error(http.post(path, json=body), 400)
    assert error["code"] == "unsupported_task" and "'embed'" in error["message"]
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["embedder"]


def test_embeddings_of_a_generation_model_name_the_task():
    with ServerThread(build_app(FakeLLM(), ServerConfig(model="fake"))) as server:
        response = httpx.post(server.base_url + "/v1/embeddings", json={"input": "hi"})
        completion = httpx.post(server.base_url + "/v1/completions",
                                json={"prompt": "hi", "max_tokens": 1})
    error = assert_openai_error(response, 400)
    assert error["param"] == "model" and "'generate'" in error["message"]
    assert completion.status_code == 200


def test_a_client_that_goes_away_cancels_its_engine_calls():
    llm = FakePoolingLLM(task="embed", delay_s=30)
    with ServerThread(build_app(llm, ServerConfig(model="embedder"))) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + "/v1/embeddings", json={"input": ["a", "b", "c"]},
                       timeout=0.5)
        deadline = time.monotonic() + 10
        while llm.num_cancelled < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert llm.num_cancelled == 3 and llm.num_in_flight == 0
