"""The pooling and token routes through the fronts: the router sends them to a replica, the
disaggregated front to a context server, with the replica's answer (and its error bodies) as
they are, the API key checked at the front and sent on, and the client's X-Request-Id passed
through. Over the pooling engine double."""
from __future__ import annotations

import httpx
import pytest

from tests.serve.helpers import assert_openai_error
from tllm.serve.context import ServerConfig
from tllm.serve.fronts.disagg_front import DisaggFront, DisaggFrontConfig, build_front_app
from tllm.serve.fronts.proxy import WHOLE_ROUTES
from tllm.serve.fronts.router import Router, RouterConfig, build_router_app
from tllm.serve.http.app import build_app
from tllm.serve.pooling.routes import POOLING_ENDPOINTS
from tllm.serve.testing import ServerThread
from tllm.serve.testing_pooling import FakePoolingLLM, fake_embedding

KEY = "sesame-0123456789"
BEARER = {"Authorization": f"Bearer {KEY}"}
NOBODY = "127.0.0.1:9"      # a generation server nobody runs: pooling must not need it
BODIES = {"/v1/embeddings": {"input": ["hi", "there"]},
          "/v1/score": {"text_1": "a", "text_2": ["ab", "b"]},
          "/v1/rerank": {"query": "a", "documents": ["ab", "b"]},
          "/v2/rerank": {"query": "a", "documents": ["ab", "b"]},
          "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [104, 105]}}


@pytest.fixture(scope="module")
def replica():
    seen: list[tuple[str, str | None]] = []
    app = build_app(FakePoolingLLM(task="embed"), ServerConfig(model="embedder", api_key=KEY))

    @app.middleware("http")
    async def record(request, call_next):
        seen.append((request.url.path, request.headers.get("x-request-id")))
        return await call_next(request)

    with ServerThread(app) as server:
        server.seen = seen
        yield server


def _router(url: str):
    return build_router_app(Router(RouterConfig([url], policy="cache_aware", api_key=KEY)))


def _disaggregated(url: str):
    return build_front_app(DisaggFront(DisaggFrontConfig(
        context_servers={"urls": [url]}, generation_servers={"urls": [NOBODY]}, api_key=KEY)))


@pytest.fixture(params=[_router, _disaggregated], ids=["router", "disaggregated"])
def front(request, replica):
    with ServerThread(request.param(replica.base_url)) as server, httpx.Client(
            base_url=server.base_url, headers=BEARER, timeout=30) as client:
        yield client


def test_every_pooling_route_of_the_server_is_forwarded():
    assert set(POOLING_ENDPOINTS) == set(WHOLE_ROUTES)


@pytest.mark.parametrize("path", sorted(BODIES))
def test_the_replica_answers_through_the_front(front, replica, path):
    direct = httpx.post(replica.base_url + path, json=BODIES[path], headers=BEARER, timeout=30)
    through = front.post(path, json=BODIES[path], headers={"X-Request-Id": f"trace-{path}"})
    assert through.status_code == 200, through.text
    assert through.headers["x-request-id"] == f"trace-{path}"
    assert replica.seen[-1] == (path, f"trace-{path}")
    drop = ("id", "created")    # new per answer
    assert ({k: v for k, v in through.json().items() if k not in drop}
            == {k: v for k, v in direct.json().items() if k not in drop})


def test_embeddings_through_the_front_are_the_engine_s(front):
    [data] = front.post("/v1/embeddings", json={"input": [104, 105]}).json()["data"]
    assert data["embedding"] == pytest.approx(fake_embedding([104, 105], 8))


def test_the_replica_s_error_body_comes_back_as_it_is(front):
    error = assert_openai_error(front.post("/v1/embeddings", json={"input": []}), 400)
    assert error["param"] == "input"
    task = assert_openai_error(front.post("/classify", json={"input": "a"}), 400)
    assert task["code"] == "unsupported_task"    # an embedding model does not classify
    bad_json = front.post("/tokenize", content=b"{", headers={"content-type":
                                                              "application/json"})
    assert_openai_error(bad_json, 400)


def test_the_front_checks_the_api_key(front):
    refused = front.post("/v1/embeddings", json={"input": "a"}, headers={"Authorization": ""})
    assert_openai_error(refused, 401)
