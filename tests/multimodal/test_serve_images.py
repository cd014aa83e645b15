"""/v1/chat/completions with image_url parts on a tiny Qwen2.5-VL: a data-URL image gives
the Python API's tokens; hostile images (corrupt base64, 1 pixel, a header stating
20,000 x 20,000, 50 images, http and file URLs) are 400s naming the part, and the server
keeps serving."""
from __future__ import annotations

import base64
import io
import struct
import zlib

import httpx
import pytest

from tests.multimodal.conftest import IMAGE, make_image
from tests.multimodal.test_qwen2_5_vl import NUM_NEW, chat_text, make_llm, params
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def stated_size_png(width: int, height: int) -> bytes:
    """A small PNG whose header states width x height (its data is a 1-pixel image's)."""
    raw = bytearray(png_bytes(make_image(1, 1, 0)))
    header = b"IHDR" + struct.pack(">II", width, height) + bytes(raw[24:29])
    raw[16:29] = header[4:]
    raw[29:33] = struct.pack(">I", zlib.crc32(header))
    return bytes(raw)


@pytest.fixture(scope="module")
def vl_server(tiny_qwen_vl):
    llm = make_llm(tiny_qwen_vl[0], limit_mm_per_prompt={"image": 2})
    with ServerThread(build_app(llm, ServerConfig(model="tiny-vl",
                                                  max_body_bytes=4 << 20))) as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            yield llm, client
    llm.shutdown()


def chat_body(*parts) -> dict:
    return {"model": "tiny-vl", "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": list(parts)}]}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_chat_with_data_url_equals_python_api(vl_server):
    llm, http = vl_server
    image = make_image(56, 42, 11)
    response = http.post("/v1/chat/completions", json=chat_body(
        image_part(data_url(png_bytes(image))), {"type": "text", "text": "describe"}))
    assert response.status_code == 200, response.text
    served = response.json()["choices"][0]["message"]["content"]
    direct = llm.generate({"prompt": chat_text(IMAGE, "describe"),
                           "multi_modal_data": {"image": [image]}}, params(), use_tqdm=False)
    assert served == direct.outputs[0].text
    assert response.json()["usage"]["prompt_tokens"] == len(direct.prompt_token_ids)


@pytest.mark.parametrize("parts, where, message", [
    ([image_part("data:image/png;base64,@@not base64@@")], "messages.0.content.0",
     "corrupt"),
    ([image_part(data_url(png_bytes(make_image(1, 1, 0))))], "messages.0.content.0",
     "at least 2"),
    ([image_part(data_url(stated_size_png(20_000, 20_000)))], "messages.0.content.0",
     "pixels"),
    ([image_part(data_url(b"GIF89a not really"))], "messages.0.content.0", "not an image"),
    ([{"type": "text", "text": "x"}] + [image_part(data_url(png_bytes(make_image(28, 28, 0))))]
     * 50, "messages.0.content.3", "more than 2 images"),
    ([image_part("http://127.0.0.1/x.png")], "messages.0.content.0", "not fetched"),
    ([image_part("file:///etc/passwd")], "messages.0.content.0", "file:// image URLs are off"),
])
def test_hostile_images_are_400s_naming_the_part(vl_server, parts, where, message):
    llm, http = vl_server
    response = http.post("/v1/chat/completions", json=chat_body(*parts))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == where and message in error["message"], error
    ok = http.post("/v1/chat/completions", json=chat_body({"type": "text", "text": "hi"}))
    assert ok.status_code == 200


def test_responses_input_image_equals_python_api(vl_server):
    llm, http = vl_server
    image = make_image(28, 56, 12)
    response = http.post("/v1/responses", json={
        "model": "tiny-vl", "max_output_tokens": NUM_NEW, "temperature": 0,
        "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(png_bytes(image))},
            {"type": "input_text", "text": "describe"}]}]})
    assert response.status_code == 200, response.text
    message = [item for item in response.json()["output"] if item["type"] == "message"][0]
    direct = llm.generate({"prompt": chat_text(IMAGE, "describe"),
                           "multi_modal_data": {"image": [image]}}, params(), use_tqdm=False)
    assert message["content"][0]["text"] == direct.outputs[0].text
    bad = http.post("/v1/responses", json={"model": "tiny-vl", "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input.0.content.0"


def test_engine_process_server_takes_images(tiny_qwen_vl, vl_server):
    """`tllm serve`'s default: the engine in its own process (the images cross the pipe)."""
    from tllm import KvCacheConfig
    from tllm.llmapi.process_llm import ProcessLLM
    llm, http = vl_server
    image = make_image(42, 42, 13)
    body = chat_body(image_part(data_url(png_bytes(image))), {"type": "text", "text": "hi"})
    expected = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    remote = ProcessLLM(str(tiny_qwen_vl[0]), max_num_tokens=8, max_batch_size=4,
                        kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024))
    try:
        with ServerThread(build_app(remote, ServerConfig(model="tiny-vl"))) as server:
            with httpx.Client(base_url=server.base_url, timeout=60) as client:
                response = client.post("/v1/chat/completions", json=body)
    finally:
        remote.shutdown()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"] == expected
