"""/v1/chat/completions with http image URLs on a tiny Qwen2.5-VL whose server lists
127.0.0.1 in allowed_media_domains: a fetched image gives the data-URL answer; a refused
fetch is a 400 naming the part and the server keeps serving; a slow host holds up neither
the event loop nor other requests; the Python API's chat fetches the same way."""
from __future__ import annotations

import threading

import httpx
import pytest

from tests.multimodal.image_host import ImageHost
from tests.multimodal.test_qwen2_5_vl import NUM_NEW, make_llm, params
from tests.multimodal.test_serve_images import chat_body, data_url, image_part
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread


@pytest.fixture(scope="module")
def fetching_server(tiny_qwen_vl):
    llm = make_llm(tiny_qwen_vl[0], allowed_media_domains=["http://127.0.0.1"],
                   media_fetch_timeout_s=5.0, max_media_fetch_bytes=1 << 16)
    with ImageHost(oversized_bytes=1 << 16) as host, \
            ServerThread(build_app(llm, ServerConfig(model="tiny-vl"))) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield llm, host, client
    llm.shutdown()


def answer(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_fetched_image_answers_as_its_data_url(fetching_server):
    llm, host, http = fetching_server
    text = {"type": "text", "text": "describe"}
    fetched = answer(http.post("/v1/chat/completions", json=chat_body(
        image_part(host.url("/image.png")), text)))
    inline = answer(http.post("/v1/chat/completions", json=chat_body(
        image_part(data_url(host.png)), text)))
    assert fetched == inline
    direct = llm.chat([{"role": "user", "content": [image_part(host.url("/image.png")),
                                                    text]}], params(), use_tqdm=False)
    assert direct.outputs[0].text == fetched and len(direct.outputs[0].token_ids) == NUM_NEW


@pytest.mark.parametrize("path, host_name, message", [
    ("/redirect-away", "127.0.0.1", "redirected to another host"),
    ("/huge", "127.0.0.1", "larger than 65,536 bytes"),
    ("/image.png", "localhost", "not in --allowed-media-domains"),
    ("/missing.png", "127.0.0.1", "answered HTTP 404"),
])
def test_refused_fetch_is_a_400_naming_the_part(fetching_server, path, host_name, message):
    llm, host, http = fetching_server
    response = http.post("/v1/chat/completions", json=chat_body(
        {"type": "text", "text": "x"}, image_part(host.url(path, host=host_name))))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages.0.content.1" and message in error["message"], error
    answer(http.post("/v1/chat/completions", json=chat_body({"type": "text", "text": "hi"})))


def test_slow_host_blocks_neither_the_loop_nor_other_requests(fetching_server):
    llm, host, http = fetching_server
    host.slow_started.clear()
    host.release.clear()
    results = {}

    def slow_request() -> None:
        with httpx.Client(base_url=str(http.base_url), timeout=60) as client:
            results["slow"] = client.post("/v1/chat/completions", json=chat_body(
                image_part(host.url("/slow"))))
    thread = threading.Thread(target=slow_request)
    thread.start()
    try:
        assert host.slow_started.wait(timeout=30)
        assert http.get("/health").status_code == 200
        answer(http.post("/v1/chat/completions", json=chat_body(
            image_part(data_url(host.png)), {"type": "text", "text": "hi"})))
        assert "slow" not in results   # still waiting on the image host
    finally:
        host.release.set()
        thread.join(timeout=60)
    answer(results["slow"])
