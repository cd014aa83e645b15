"""Issue 14's HTTP findings as regression tests, over the engine double (vocabulary 256):
edge validation of every integer the engine would index or size with, the stream_options
rule and vLLM's continuous_usage_stats, completions' max_tokens default, 500s without
internal text, the body-read timeout and header limit, and --protect-metrics."""
from __future__ import annotations

import json
import logging
import re
import socket
import time

import httpx
import pytest

from tests.serve.helpers import assert_openai_error
from tllm.serve.context import ServerConfig
from tllm.serve.http.server import uvicorn_config
from tllm.serve.http.app import build_app
from tllm.serve.testing import FakeLLM, ServerThread

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
COMPLETION = {"model": "fake", "prompt": "hi", "max_tokens": 3}
MESSAGES = [{"role": "user", "content": "hi"}]
VOCAB = 256     # FakeTokenizer's


@pytest.fixture()
def fake():
    return FakeLLM()


def _serve(llm, **config) -> ServerThread:
    return ServerThread(build_app(llm, ServerConfig(model="fake", **config)))


@pytest.fixture()
def http(fake):
    with _serve(fake, body_read_timeout_s=0.5) as server:
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            yield client


def _sse_chunks(text: str) -> list[dict]:
    events = [b.removeprefix("data: ") for b in text.split("\n\n") if b]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- finding 1 and the edge validation of integers ----

REFUSED = [
    ("top_k 1e20 (finding 1)", {"top_k": 100000000000000000000, "temperature": 0.8}, "top_k"),
    ("top_k 2**63", {"top_k": 2**63}, "top_k"),
    ("top_k above the vocabulary", {"top_k": VOCAB + 1}, "top_k"),
    ("top_k below -1", {"top_k": -2**70}, "top_k"),
    ("prompt token id past the vocabulary", {"prompt": [1, VOCAB]}, "prompt"),
    ("prompt token id 2**64 in a batch", {"prompt": [[1], [2**64]]}, "prompt"),
    ("negative prompt token id", {"prompt": [-1]}, "prompt"),
    ("stop_token_ids past the vocabulary", {"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ("stop_token_ids 2**63", {"stop_token_ids": [2**63]}, "stop_token_ids"),
    ("logit_bias key past the vocabulary", {"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ("logit_bias key 2**70", {"logit_bias": {str(2**70): 1}}, "logit_bias"),
    ("logit_bias key superscript two (finding 2)", {"logit_bias": {"²": 5}}, "logit_bias"),
    ("logit_bias key Arabic-Indic digit", {"logit_bias": {"٣": 5}}, "logit_bias"),
    ("logit_bias key with a space", {"logit_bias": {" 5": 5}}, "logit_bias"),
    ("logit_bias key negative", {"logit_bias": {"-1": 5}}, "logit_bias"),
    ("seed 2**63", {"seed": 2**63}, "seed"),
    ("seed below -2**63", {"seed": -2**63 - 1}, "seed"),
    ("n above 128", {"n": 129}, "n"),
    ("best_of above 128", {"best_of": 129, "n": 129}, "n"),
    ("logprobs above 20", {"logprobs": 21}, "logprobs"),
    ("min_tokens 2**70", {"min_tokens": 2**70}, "min_tokens"),
    ("max_tokens 2**70", {"max_tokens": 2**70}, "max_tokens"),
]


@pytest.mark.parametrize("fields,param", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_out_of_range_integer_is_a_400_naming_the_field(http, fields, param):
    error = assert_openai_error(http.post(COMPLETIONS, json={**COMPLETION, **fields}), 400)
    assert error["param"] == param, error
    assert http.post(COMPLETIONS, json=COMPLETION).status_code == 200


@pytest.mark.parametrize("fields", [
    {"top_k": VOCAB}, {"top_k": -1}, {"top_k": 0}, {"prompt": [0, VOCAB - 1]},
    {"logit_bias": {str(VOCAB - 1): 100, "0": -100}}, {"stop_token_ids": [VOCAB - 1]},
    {"seed": 2**63 - 1, "n": 3}, {"seed": -2**63}, {"n": 128, "max_tokens": 1},
    {"logprobs": 20}], ids=str)
def test_integers_at_the_limits_are_accepted(http, fields):
    response = http.post(COMPLETIONS, json={**COMPLETION, **fields})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("fields,param", [
    ({"top_k": 2**63}, "top_k"), ({"logit_bias": {"²": 1}}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"n": 129}, "n"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids")], ids=str)
def test_chat_checks_the_same_fields(http, fields, param):
    body = {"messages": MESSAGES, "max_tokens": 2, **fields}
    assert assert_openai_error(http.post(CHAT, json=body), 400)["param"] == param


def test_a_refused_request_does_not_disturb_one_running(fake):
    fake.token_delay_s = 0.01
    with _serve(fake) as server, httpx.Client(base_url=server.base_url, timeout=10) as client:
        with client.stream("POST", COMPLETIONS, json={**COMPLETION, "max_tokens": 30,
                                                      "stream": True}) as stream:
            bad = client.post(COMPLETIONS, json={**COMPLETION, "top_k": 2**63})
            assert_openai_error(bad, 400)
            text = "".join(stream.iter_text())
    finishes = [c["choices"][0]["finish_reason"] for c in _sse_chunks(text) if c["choices"]]
    assert finishes[-1] == "length" and len(finishes) == 30


# ---- findings 3 and 4: stream_options ----

@pytest.mark.parametrize("path,base", [(COMPLETIONS, COMPLETION),
                                       (CHAT, {"messages": MESSAGES, "max_tokens": 2})])
@pytest.mark.parametrize("stream", [None, False])
def test_stream_options_without_stream_is_a_400(http, path, base, stream):
    body = {**base, "stream_options": {"include_usage": True}}
    if stream is not None:
        body["stream"] = stream
    error = assert_openai_error(http.post(path, json=body), 400)
    assert error["param"] == "stream_options"
    assert http.post(path, json={**base, "stream_options": None}).status_code == 200


def test_guidellm_shaped_request_succeeds(http):
    """guidellm 0.8.1 sends vLLM's continuous_usage_stats and content as a list of parts."""
    body = {"model": "fake", "max_completion_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]}
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    chunks = _sse_chunks(response.text)
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "abcd"


def test_continuous_usage_stats_is_exposed_by_the_protocol():
    from tllm.serve.openai.protocol import ChatCompletionRequest, CompletionRequest
    body = CompletionRequest.model_validate(
        {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert body.continuous_usage_stats and not body.include_usage
    chat = ChatCompletionRequest.model_validate({"messages": MESSAGES, "stream": True})
    assert not chat.continuous_usage_stats


# ---- finding 5: completions' max_tokens default ----

@pytest.mark.parametrize("max_tokens", ["absent", None])
def test_completions_max_tokens_defaults_to_16(http, max_tokens):
    body = {"model": "fake", "prompt": "hi"}
    if max_tokens != "absent":
        body["max_tokens"] = max_tokens
    response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16


def test_chat_without_max_tokens_still_fills_the_context(http, fake):
    response = http.post(CHAT, json={"messages": MESSAGES})
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == fake.max_seq_len


# ---- finding 6: no internal text in 500s ----

def test_500_names_a_request_id_and_logs_the_exception(http, fake, caplog):
    fake.fail_with = RuntimeError("secret detail /srv/models/x.py line 3")
    with caplog.at_level(logging.ERROR, logger="tllm.serve.http.errors"):
        response = http.post(COMPLETIONS, json=COMPLETION)
    error = assert_openai_error(response, 500)
    assert "secret" not in response.text and "RuntimeError" not in response.text
    request_id = response.headers["x-request-id"]
    assert request_id in error["message"] and error["code"] == "internal_error"
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and "secret detail" in str(logged[0].exc_info[1])


def test_error_event_midway_through_a_stream_hides_the_exception(http, fake, caplog):
    fake.fail_midway = RuntimeError("secret step failure")
    with caplog.at_level(logging.ERROR, logger="tllm.serve.http.errors"):
        response = http.post(COMPLETIONS, json={**COMPLETION, "stream": True})
    error = _sse_chunks(response.text)[-1]["error"]
    assert "secret" not in response.text and error["code"] == "internal_error"
    request_id = error["message"].split("request id ")[1].split(";")[0]
    assert any(request_id in r.getMessage() for r in caplog.records)


# ---- finding 7: body-read timeout, body and header limits ----

def _raw_exchange(port: int, head: bytes, wait_s: float) -> tuple[bytes, float]:
    """Send head (and whatever body it holds), then read until the server closes; returns
    what came back and the seconds it took to close."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        start = time.monotonic()
        sock.sendall(head)
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                raise AssertionError(f"the server held the connection {wait_s} s: "
                                     f"{received!r}") from None
            if not chunk:
                return received, time.monotonic() - start
            received += chunk


def test_stalled_body_gets_408_and_the_connection_closed(fake):
    with _serve(fake, body_read_timeout_s=0.5) as server:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: 100\r\n\r\n" + b'{"prompt":')
        received, seconds = _raw_exchange(server.port, head, wait_s=5)
        assert received.startswith(b"HTTP/1.1 408"), received
        assert b"request_timeout" in received and 0.4 < seconds < 3
        with httpx.Client(base_url=server.base_url) as client:  # and it serves on
            assert client.post(COMPLETIONS, json=COMPLETION).status_code == 200


def test_body_over_the_cap_without_content_length_is_413(fake):
    with _serve(fake, max_body_bytes=1000) as server:
        chunks = (b'{"prompt": "' + b"x" * 600 for _ in range(3))
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            response = client.post(COMPLETIONS, content=chunks,
                                   headers={"content-type": "application/json"})
            assert_openai_error(response, 413)


def test_oversized_headers_are_refused_and_the_connection_closed(fake):
    with _serve(fake, max_header_bytes=4096) as server:
        big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000
        received, _ = _raw_exchange(server.port, big + b"\r\n\r\n", wait_s=5)  # whole
        assert received.startswith(b"HTTP/1.1 431") and b"headers_too_large" in received
        received, _ = _raw_exchange(server.port, big, wait_s=5)   # never ends
        assert received.startswith(b"HTTP/1.1 431"), received
        assert b"headers_too_large" in received
        received, _ = _raw_exchange(server.port, b"NOT HTTP\r\n\r\n", wait_s=5)
        assert received.startswith(b"HTTP/1.1 400") and b"invalid_http" in received
        with httpx.Client(base_url=server.base_url) as client:
            assert client.get("/health", headers={"X-Small": "a" * 1000}).status_code == 200


_BIG_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000


@pytest.mark.parametrize("first,rest", [
    (_BIG_HEAD, b"a" * 200_000 + b"\r\n\r\n"),                 # refused by h11, incomplete
    (_BIG_HEAD + b"\r\nContent-Length: 200000\r\n\r\n", b"{" * 200_000)])  # by the app
def test_a_refused_request_still_arriving_reads_its_answer(fake, first, rest):
    # The client goes on sending after the server refused its request: a lingering close
    # (answer, FIN, the rest read and dropped), not a reset, which could destroy the answer
    # before the client read it (the soak script's "huge header" saw a ReadError).
    with _serve(fake, max_header_bytes=4096) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(first)
            received = sock.recv(65536)        # the answer, while the request is arriving
            sock.sendall(rest)
            while chunk := sock.recv(65536):   # then the end of the answer: no reset
                received += chunk
        assert received.startswith(b"HTTP/1.1 431") and b"headers_too_large" in received


def test_limit_flags_reach_the_server_config():
    import argparse

    from tllm.serve.cli_args import add_serve_parser, server_config
    parser = argparse.ArgumentParser(prog="tllm")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    defaults = server_config(parser.parse_args(["serve"]), "m")
    assert (defaults.body_read_timeout_s, defaults.max_header_bytes,
            defaults.keep_alive_timeout_s, defaults.header_read_timeout_s,
            defaults.max_connections, defaults.protect_metrics) == (10.0, 16384, 5, 10, 1024,
                                                                     False)
    args = parser.parse_args(["serve", "--body-read-timeout", "2.5", "--max-header-bytes",
                              "8192", "--keep-alive-timeout", "30", "--api-key", "k",
                              "--protect-metrics", "--header-read-timeout", "3",
                              "--max-connections", "64"])
    config = server_config(args, "m")
    assert (config.body_read_timeout_s, config.max_header_bytes, config.keep_alive_timeout_s,
            config.header_read_timeout_s, config.max_connections,
            config.protect_metrics) == (2.5, 8192, 30, 3, 64, True)


def test_uvicorn_gets_the_connection_limits(fake):
    app = build_app(fake, ServerConfig(model="fake", max_header_bytes=1234,
                                       keep_alive_timeout_s=7, max_connections=9))
    try:
        config = uvicorn_config(app)
        config.load()
    finally:
        app.state.ctx.close()
    assert (config.h11_max_incomplete_event_size, config.timeout_keep_alive) == (1234, 7)
    assert config.http_protocol_class.keywords["guard"].limits.max_connections == 9


# ---- finding 8 (the schema itself; schemathesis runs in test_serve_schemathesis.py) ----

def test_openapi_documents_bodies_and_errors(http):
    schema = http.get("/openapi.json").json()
    paths = schema["paths"]
    for path, name in ((COMPLETIONS, "CompletionRequest"), (CHAT, "ChatCompletionRequest")):
        operation = paths[path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
        assert set(operation["responses"]["200"]["content"]) == {"application/json",
                                                                 "text/event-stream"}
        for status in ("400", "401", "413", "415", "500", "default"):
            error = operation["responses"][status]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "422" not in json.dumps({p: {m: list(o["responses"]) for m, o in ops.items()}
                                    for p, ops in paths.items()})
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    request = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["n"]["maximum"] == 128 and request["logprobs"]["anyOf"][0]["maximum"] == 20
    assert "continuous_usage_stats" in schema["components"]["schemas"]["StreamOptions"][
        "properties"]
    assert "swagger-ui" in http.get("/docs").text and http.get("/redoc").status_code == 200


def test_docs_pages_load_their_scripts_from_the_server_not_a_cdn(http):
    for page in ("/docs", "/redoc"):
        html = http.get(page).text
        assert "cdn." not in html and "googleapis" not in html
        for asset in re.findall(r'(?:src|href)="(/docs/assets/[^"]+)"', html):
            response = http.get(asset)
            assert response.status_code == 200 and len(response.content) > 1000
    assert http.get("/docs/assets/../../etc/passwd").status_code == 404


# ---- --api-key and --protect-metrics ----

PROTECTABLE = ("/metrics", "/docs", "/redoc", "/openapi.json")


@pytest.mark.parametrize("protect", [False, True])
def test_protect_metrics(fake, protect):
    with _serve(fake, api_key="sesame", protect_metrics=protect) as server:
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            good = {"Authorization": "Bearer sesame"}
            for path in PROTECTABLE:
                if protect:
                    assert_openai_error(client.get(path), 401)
                    assert_openai_error(client.get(path, params={"api_key": "sesame"}), 401)
                    assert client.get(path, headers=good).status_code == 200
                else:
                    assert client.get(path).status_code == 200
            assert client.get("/health").status_code == 200
            assert client.get("/version").status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [100000000000000000000, 2**63, 49153])
def test_real_model_refuses_top_k_past_its_vocabulary(server, top_k):
    """Finding 1 against SmolLM2 (vocabulary 49152): a 400, and the server serves on."""
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        body = {"model": "smollm2", "prompt": "Hi", "temperature": 0.8, "top_k": top_k,
                "max_tokens": 2}
        error = assert_openai_error(client.post(COMPLETIONS, json=body), 400)
        assert error["param"] == "top_k" and "49152" in error["message"]
        response = client.post(COMPLETIONS, json={**body, "top_k": 49152})
        assert response.status_code == 200, response.text
