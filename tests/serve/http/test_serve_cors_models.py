"""GET /v1/models/{id} (OpenAI's retrieve-model) and CORS with --allowed-origins (issue 38):
off by default; when on, preflights are answered without the API key, and the real request
still needs it. Over the engine double."""
from __future__ import annotations

import argparse
import contextlib
import http.server
import threading

import httpx
import openai
import pytest

from tests.serve.browser import launch_browser
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


# ---- CORS from a real page ----

# The page's script: a chat request with the key (a preflight first: Authorization and a JSON
# body are not "simple"), answering the status and the X-Ignored-Fields header it can read.
FETCH = """async ([url, key]) => {
  try {
    const response = await fetch(url + "/v1/chat/completions", {method: "POST",
      headers: {"Content-Type": "application/json", ...(key ? {"Authorization": "Bearer " + key} : {})},
      body: JSON.stringify({model: "org/fake", messages: [{role: "user", content: "hi"}],
                            max_tokens: 2, verbosity: "low"})});
    return {status: response.status, ignored: response.headers.get("X-Ignored-Fields"),
            object: (await response.json()).object || null};
  } catch (error) { return {error: String(error)}; }
}"""


@pytest.fixture(scope="module")
def browser():
    yield from launch_browser()


class _PageHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<html><body>a client page</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def _page_origin():
    """A second loopback server for the client's page: a page of another origin in the same
    (loopback) address space, as a developer's web app beside the API is; Chromium keeps a
    public page from reaching loopback whatever CORS says."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _page_at(browser, origin: str):
    page = browser.new_page()
    page.goto(f"{origin}/")
    return page


def test_a_page_of_an_allowed_origin_calls_the_api_in_chromium(browser):
    with _page_origin() as allowed, _page_origin() as stranger:
        with _serve(api_key=KEY, allowed_origins=(allowed,)) as server:
            page = _page_at(browser, allowed)
            answer = page.evaluate(FETCH, [server.base_url, KEY])
            assert answer == {"status": 200, "ignored": "verbosity",
                              "object": "chat.completion"}
            refused = page.evaluate(FETCH, [server.base_url, None])  # readable: CORS headers
            assert refused["status"] == 401                         # on the 401 too
            blocked = _page_at(browser, stranger).evaluate(FETCH, [server.base_url, KEY])
            assert "error" in blocked and "fetch" in blocked["error"].lower(), blocked


def test_without_allowed_origins_chromium_blocks_the_page(browser):
    with _page_origin() as origin, _serve(api_key=KEY) as server:
        blocked = _page_at(browser, origin).evaluate(FETCH, [server.base_url, KEY])
        assert "error" in blocked, blocked


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
