"""Pooling requests as generation requests are, over the pooling engine double: they count in
/metrics (each input a finished request with its prompt tokens, each request's latency; those
ended by a dead engine as aborted), and a full queue answers 429 with Retry-After, a dead
engine 503; /tokenize, which runs no engine call, still answers."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.helpers import assert_openai_error
from tllm.llmapi.process_llm import EngineDeadError
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread
from tllm.serve.testing_pooling import FakePoolingLLM

MODEL = "embedder"


def scrape(http: httpx.Client) -> dict[tuple, float]:
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))):
            s.value for family in text_string_to_metric_families(http.get("/metrics").text)
            for s in family.samples}


@pytest.fixture()
def served():
    llm = FakePoolingLLM(task="embed")
    with ServerThread(build_app(llm, ServerConfig(model=MODEL, max_queue_size=2))) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            yield llm, http


def test_pooling_requests_count_in_the_metrics(served):
    _, http = served
    before = scrape(http)
    assert http.post("/v1/embeddings", json={"input": ["a", "bb", "ccc"]}).status_code == 200
    assert http.post("/v1/rerank", json={"query": "a", "documents": ["b", "c"]}
                     ).status_code == 200
    after = scrape(http)

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("tllm:request_success_total", finished_reason="stop") == 5
    # the rerank's pairs on an embedding model: the query's and the document's tokens
    assert delta("tllm:prompt_tokens_total") == 6 + 2 * 2
    assert delta("tllm:request_prompt_tokens_count") == 5
    assert delta("tllm:e2e_request_latency_seconds_count") == 2
    assert delta("tllm:generation_tokens_total") == 0


def test_a_full_queue_is_a_429_and_a_dead_engine_a_503(served, monkeypatch):
    llm, http = served
    idle = llm.get_stats()
    monkeypatch.setattr(llm, "get_stats", lambda: {**idle, "num_waiting": 2})
    for path, body in (("/v1/embeddings", {"input": "a"}), ("/v1/score",
                                                             {"text_1": "a", "text_2": "b"}),
                       ("/v1/rerank", {"query": "a", "documents": ["b"]})):
        refused = http.post(path, json=body)
        assert assert_openai_error(refused, 429)["code"] == "queue_full", path
        assert int(refused.headers["retry-after"]) >= 1
    assert http.post("/tokenize", json={"prompt": "a"}).status_code == 200
    monkeypatch.setattr(llm, "get_stats", lambda: idle)
    assert http.post("/v1/embeddings", json={"input": ["a"] * 3}).status_code == 200

    async def dead(*args, **kwargs):
        raise EngineDeadError("the engine process exited")

    before = scrape(http)
    monkeypatch.setattr(llm, "encode_async", dead)
    assert_openai_error(http.post("/v1/embeddings", json={"input": ["a", "b"]}), 503)
    key = ("tllm:request_success_total", (("finished_reason", "abort"),))
    assert scrape(http)[key] - before.get(key, 0.0) == 2
