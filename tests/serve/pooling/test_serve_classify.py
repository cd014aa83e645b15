"""POST /classify (and /v1/classify) over the pooling engine double: vLLM's shape (each input's
probabilities, the likeliest label, num_classes; usage), every input form, the labels'
fallback names, 400s for bad input and for a model of another task."""
from __future__ import annotations

import httpx
import pytest

from tests.serve.helpers import assert_openai_error
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread
from tllm.serve.testing_pooling import FakePoolingLLM

MAX_SEQ_LEN = 64


def _fake_probs(token_ids: list[int]) -> list[float]:
    yes = (sum(token_ids) % 100) / 100     # the double's rule
    return [1 - yes, yes]


@pytest.fixture(scope="module")
def http():
    llm = FakePoolingLLM(task="classify", max_seq_len=MAX_SEQ_LEN)
    with ServerThread(build_app(llm, ServerConfig(model="classifier"))) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            yield client


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_the_vllm_shape(http, path):
    answer = http.post(path, json={"model": "classifier", "input": ["a", "bb"]})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "list" and body["model"] == "classifier"
    assert body["id"].startswith("classify-")
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    for index, (item, text) in enumerate(zip(body["data"], ["a", "bb"])):
        probs = _fake_probs(list(text.encode()))
        assert item == {"object": "classification", "index": index, "num_classes": 2,
                        "probs": pytest.approx(probs),
                        "label": ["no", "yes"][probs.index(max(probs))]}


@pytest.mark.parametrize("value", ["a", ["a"], [97], [[97]]],
                         ids=["text", "texts", "token ids", "token id lists"])
def test_every_input_form(http, value):
    [item] = http.post("/classify", json={"input": value}).json()["data"]
    assert item["probs"] == pytest.approx(_fake_probs([97]))


def test_a_model_without_label_names_gets_hf_s_default_names():
    llm = FakePoolingLLM(task="classify", labels=None)
    with ServerThread(build_app(llm, ServerConfig(model="reward"))) as server:
        [item] = httpx.post(server.base_url + "/classify", json={"input": "a"}).json()["data"]
    assert item["label"] == "LABEL_1"      # "a" is 97: 0.97 for label 1


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": ["a", ""]}, "input"),
    ({"input": [1, 256]}, "input"), ({"input": 5}, "input"), ({}, "input"),
    ({"input": "x" * (MAX_SEQ_LEN + 1)}, "input"), ({"input": ["a"] * 2049}, "input"),
    ({"input": "a", "model": "other"}, "model")],
    ids=["empty list", "empty text", "an empty text", "id out of the vocabulary",
         "wrong type", "missing", "too long", "too many", "another model"])
def test_bad_input_is_a_4xx_naming_the_field(http, body, param):
    error = assert_openai_error(http.post("/classify", json=body),
                                404 if param == "model" else 400)
    assert error["param"] == param, error


@pytest.mark.parametrize("task", ["embed", "score"])
def test_a_model_of_another_task_names_it(task):
    with ServerThread(build_app(FakePoolingLLM(task=task), ServerConfig(model="m"))) as server:
        refused = httpx.post(server.base_url + "/classify", json={"input": "a"})
    assert assert_openai_error(refused, 400)["code"] == "unsupported_task"


def test_generation_and_embedding_routes_of_a_classifier_name_the_task(http):
    for path, body in (("/v1/embeddings", {"input": "a"}),
                       ("/v1/completions", {"prompt": "a", "max_tokens": 1})):
        assert assert_openai_error(http.post(path, json=body), 400)["code"] == "unsupported_task"
