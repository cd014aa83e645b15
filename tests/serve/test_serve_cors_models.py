"""GET /v1/models/{id} (OpenAI's retrieve-model) and CORS with --allowed-origins (issue 38):
off by default; when on, preflights are answered without the API key, and the real request
still needs it. Over the engine double."""
from __future__ import annotations

import argparse

import httpx
import openai
import pytest

from tests.serve.helpers import assert_openai_error
from tllm.serve.cli_args import add_serve_parser, server_config
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import FakeLLM, ServerThread

KEY = "sk-test"
PAGE = "http://localhost:3000"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "org/fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def _serve(**config):
    return ServerThread(build_app(FakeLLM(), ServerConfig(model="org/fake", **config)))


@pytest.fixture(scope="module")
def plain():
    with _serve() as server, httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def cors():
    with _serve(api_key=KEY, allowed_origins=(PAGE,)) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            yield client


# ---- /v1/models/{id} ----

def test_retrieve_the_served_model(plain):
    response = plain.get("/v1/models/org/fake")
    assert response.status_code == 200, response.text
    card = response.json()
    assert card["id"] == "org/fake" and card["object"] == "model"
    assert card == {**plain.get("/v1/models").json()["data"][0], "created": card["created"]}


def test_an_unknown_model_is_a_404(plain):
    error = assert_openai_error(plain.get("/v1/models/gpt-5"), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_the_openai_client_retrieves_it(plain):
    client = openai.OpenAI(base_url=f"{plain.base_url}/v1", api_key="none", max_retries=0)
    assert client.models.retrieve("org/fake").id == "org/fake"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_retrieve_needs_the_key(cors):
    assert_openai_error(cors.get("/v1/models/org/fake"), 401)
    assert cors.get("/v1/models/org/fake", headers=AUTH).json()["id"] == "org/fake"


# ---- CORS ----

def test_no_cors_headers_by_default(plain):
    preflight = plain.options("/v1/chat/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in preflight.headers
    response = plain.post("/v1/chat/completions", json=CHAT, headers={"Origin": PAGE})
    assert response.status_code == 200
    assert "access-control-allow-origin" not in response.headers


def test_preflight_passes_without_the_key(cors):
    response = cors.options("/v1/chat/completions", headers=PREFLIGHT)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == PAGE
    assert "POST" in response.headers["access-control-allow-methods"]
    allowed = response.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed and "content-type" in allowed


def test_the_key_still_guards_the_request(cors):
    refused = cors.post("/v1/chat/completions", json=CHAT, headers={"Origin": PAGE})
    assert_openai_error(refused, 401)
    assert refused.headers["access-control-allow-origin"] == PAGE  # the page can read why
    answer = cors.post("/v1/chat/completions", json={**CHAT, "verbosity": "low"},
                       headers={"Origin": PAGE, **AUTH})
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == PAGE
    assert "x-ignored-fields" in answer.headers["access-control-expose-headers"].lower()


def test_another_origin_gets_no_grant(cors):
    headers = {**PREFLIGHT, "Origin": "http://evil.example"}
    preflight = cors.options("/v1/chat/completions", headers=headers)
    assert preflight.status_code == 400
    assert "access-control-allow-origin" not in preflight.headers
    response = cors.post("/v1/chat/completions", json=CHAT,
                         headers={"Origin": "http://evil.example", **AUTH})
    assert "access-control-allow-origin" not in response.headers


def _config(*argv: str) -> ServerConfig:
    parser = argparse.ArgumentParser(prog="tllm")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return server_config(parser.parse_args(["serve", *argv]), "smollm2")


def test_command_line():
    assert _config().allowed_origins == () and not _config().strict_request_fields
    config = _config("--allowed-origins", "http://a, http://b/", "--allowed-origins", "*",
                     "--allowed-origins", "http://a", "--strict-request-fields")
    assert config.allowed_origins == ("http://a", "http://b", "*")
    assert config.strict_request_fields
