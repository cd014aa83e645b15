"""Server behaviour that needs no model, over an engine double: engine down or stuck (503),
internal errors (500, and the server keeps serving), API key (401), body cap (413),
disconnects abort, SSE framing."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.serve.helpers import assert_openai_error
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import FakeLLM, ServerThread

COMPLETION = {"model": "fake", "prompt": "hi", "max_tokens": 3}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture()
def fake():
    return FakeLLM(token_delay_s=0.001)


def _serve(llm, **config):
    return ServerThread(build_app(llm, ServerConfig(model="fake", **config)))


@pytest.fixture()
def http(fake):
    with _serve(fake, stuck_timeout_s=0.05) as server:
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            yield client


def test_dead_engine_answers_503(http, fake):
    assert http.get("/health").status_code == 200
    fake.is_alive = False
    assert_openai_error(http.get("/health"), 503)
    response = http.post("/v1/completions", json=COMPLETION)
    assert_openai_error(response, 503)
    assert response.headers["retry-after"] == "1"


@pytest.mark.parametrize("stream", [False, True])
def test_engine_dying_mid_request_ends_it_with_503(fake, stream):
    app = build_app(fake, ServerConfig(model="fake"))
    app.state.ctx.engine.liveness_interval_s = 0.05
    fake.token_delay_s = 0.02
    # The engine dies once the request has run a few steps (not after a fixed time: on a
    # loaded machine the server may not have taken the request by then).
    steps_before = fake.num_steps
    threading.Thread(target=_kill_after_steps, args=(fake, steps_before + 5),
                     daemon=True).start()
    with ServerThread(app) as server, httpx.Client(base_url=server.base_url) as client:
        body = {**COMPLETION, "max_tokens": 400, "stream": stream}
        response = client.post("/v1/completions", json=body, timeout=5)
        text = response.text
        if stream:
            error = json.loads(_sse_events(text)[-2])["error"]
            assert error["code"] == "engine_unavailable"
        else:
            assert_openai_error(response, 503)


def _kill_after_steps(fake, num_steps: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while fake.num_steps < num_steps and time.monotonic() < deadline:
        time.sleep(0.005)
    fake.is_alive = False


def test_stuck_engine_fails_health(http, fake):
    fake.active.add(object())  # work queued, and the step counter never moves
    assert http.get("/health").status_code == 200
    time.sleep(0.1)
    error = assert_openai_error(http.get("/health"), 503)
    assert "no progress" in error["message"]
    fake.active.clear()
    assert http.get("/health").status_code == 200


def test_internal_error_is_500_and_the_server_keeps_serving(http, fake):
    fake.fail_with = RuntimeError("boom")
    error = assert_openai_error(http.post("/v1/completions", json=COMPLETION), 500)
    assert "boom" not in error["message"] and error["type"] == "server_error"  # in the log
    fake.fail_with = None
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_failure_midway_through_a_stream_ends_it_with_an_error_event(http, fake):
    fake.fail_midway = RuntimeError("engine step failed")
    response = http.post("/v1/completions", json={**COMPLETION, "stream": True})
    events = _sse_events(response.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "internal_error"
    fake.fail_midway = None
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200


@pytest.mark.parametrize("body,path", [(COMPLETION, "/v1/completions"),
                                       (CHAT, "/v1/chat/completions")])
def test_sse_framing(http, body, path):
    response = http.post(path, json={**body, "stream": True,
                                     "stream_options": {"include_usage": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")
    events = _sse_events(response.text)
    chunks = [json.loads(e) for e in events[:-1]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [f for f in finishes if f] == ["length"] and finishes[-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_api_key(fake):
    with _serve(fake, api_key="sesame") as server:
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            assert_openai_error(client.post("/v1/completions", json=COMPLETION), 401)
            assert_openai_error(client.get("/v1/models",
                                           headers={"Authorization": "Bearer nope"}), 401)
            good = {"Authorization": "Bearer sesame"}
            assert client.post("/v1/completions", json=COMPLETION,
                               headers=good).status_code == 200
            assert client.get("/health").status_code == 200


def test_body_over_the_cap_is_413(fake):
    with _serve(fake, max_body_bytes=1000) as server:
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            big = {**COMPLETION, "prompt": "x" * 2000}
            assert_openai_error(client.post("/v1/completions", json=big), 413)
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200


def test_served_model_name(fake):
    with _serve(fake, served_model_name="my-model") as server:
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            assert client.get("/v1/models").json()["data"][0]["id"] == "my-model"
            assert_openai_error(client.post("/v1/completions", json=COMPLETION), 404)
            response = client.post("/v1/completions", json={**COMPLETION, "model": "my-model"})
            assert response.json()["model"] == "my-model"


@pytest.mark.parametrize("stream", [False, True])
def test_client_that_goes_away_aborts_its_request(http, fake, stream):
    fake.token_delay_s = 0.05
    body = {**COMPLETION, "max_tokens": 400, "stream": stream}
    if stream:  # read two events, then hang up
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(lines), next(lines)
    else:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + 2
    while fake.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not fake.active
    metrics = http.get("/metrics").text
    assert 'tllm:request_success_total{finished_reason="abort",model_name="fake"} 1.0' in metrics


def _sse_events(text: str) -> list[str]:
    blocks = [b for b in text.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks)
    return [b.removeprefix("data: ") for b in blocks]


# A 1x1 PNG: a valid image, refused before it is decoded since the model takes none.
PNG_1x1 = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8"
           "/5+hHgAHggJ/PchI7wAAAABJRU5ErkJggg==")


def test_images_to_a_text_model_are_a_400(http):
    image = {"type": "image_url", "image_url": {"url": PNG_1x1}}
    chat = {"model": "fake", "max_tokens": 2,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}]}
    error = assert_openai_error(http.post("/v1/chat/completions", json=chat), 400)
    assert "takes no images" in error["message"] and error["param"] == "messages.0.content.0"
    responses = {"model": "fake", "max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": PNG_1x1}, {"type": "input_text", "text": "hi"}]}]}
    error = assert_openai_error(http.post("/v1/responses", json=responses), 400)
    assert "takes no images" in error["message"]
    assert http.post("/v1/completions", json={"model": "fake", "prompt": "hi",
                                              "max_tokens": 2}).status_code == 200
