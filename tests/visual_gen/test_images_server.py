"""POST /v1/images/generations on a tiny Qwen-Image (and a tiny layered model): OpenAI's
response shape, PNGs of the asked size, files behind "url", and 400s with OpenAI's error body
for bad requests, after which the server keeps serving."""
from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

from tests.serve.helpers import assert_openai_error
from tllm.serve.context import ServerConfig
from tllm.serve.visual.images import build_images_app
from tllm.serve.testing import ServerThread

FAST = {"steps": 1, "seed": 0}


@pytest.fixture(scope="module")
def http(visual_gen, tmp_path_factory):
    app = build_images_app(visual_gen, ServerConfig(model="tiny-qwen-image"),
                           files_dir=tmp_path_factory.mktemp("files"))
    with ServerThread(app) as server, httpx.Client(base_url=server.base_url,
                                                   timeout=60) as client:
        yield client


def _png(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return image


def test_b64_json_pngs_of_the_asked_size(http):
    response = http.post("/v1/images/generations", json={
        "model": "tiny-qwen-image", "prompt": "a cat", "n": 2, "size": "48x32",
        "negative_prompt": " ", "true_cfg_scale": 2.0, **FAST})
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body["created"], int) and len(body["data"]) == 2
    assert all(_png(item["b64_json"]).size == (48, 32) for item in body["data"])


def test_url_serves_the_file(http):
    response = http.post("/v1/images/generations", json={
        "prompt": "a cat", "size": "32x16", "response_format": "url", **FAST})
    assert response.status_code == 200, response.text
    url = response.json()["data"][0]["url"]
    image = http.get(url)
    assert image.status_code == 200 and image.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(image.content)).size == (32, 16)


@pytest.mark.parametrize("body, param", [
    ({"size": "100x100"}, "size"), ({"size": "big"}, "size"), ({"size": "0x16"}, "size"),
    ({"steps": 0}, "steps"), ({"steps": 10_000}, "steps"), ({"n": 0}, "n"), ({"n": 11}, "n"),
    ({"n": "2"}, "n"), ({"true_cfg_scale": 0.5}, "true_cfg_scale"), ({"seed": -1}, "seed"),
    ({"response_format": "png"}, "response_format"), ({"colour": "red"}, "colour"),
    ({"prompt": ""}, "prompt"), ({"image": "aGk="}, "image"),
    ({"caption_language": "fr"}, "caption_language"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(http, body, param):
    response = http.post("/v1/images/generations", json={"prompt": "a cat", **FAST, **body})
    assert assert_openai_error(response, 400)["param"] == param
    assert http.get("/health").json() == {"status": "ok"}


def test_unknown_model_models_and_health(http):
    response = http.post("/v1/images/generations", json={"prompt": "a cat", "model": "x"})
    assert assert_openai_error(response, 404)["code"] == "model_not_found"
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-qwen-image"]
    assert_openai_error(http.get("/v1/nope"), 404)


def test_layered_model_takes_a_base64_image(layered_gen, rgba_image, tmp_path):
    buffer = io.BytesIO()
    rgba_image.save(buffer, format="PNG")
    app = build_images_app(layered_gen, ServerConfig(model="layered"), files_dir=tmp_path)
    with ServerThread(app) as server, httpx.Client(base_url=server.base_url,
                                                   timeout=60) as client:
        assert_openai_error(client.post("/v1/images/generations",
                                        json={"prompt": "a cat", **FAST}), 400)
        response = client.post("/v1/images/generations", json={
            "prompt": "a cat", "image": base64.b64encode(buffer.getvalue()).decode(),
            "layers": 2, **FAST})
        assert response.status_code == 200, response.text
        layers = [_png(item["b64_json"]) for item in response.json()["data"]]
        assert [(layer.mode, layer.size) for layer in layers] == [("RGBA", (768, 544))] * 2
