"""The images server's batching on a tiny random Qwen-Image (fp32, CPU): concurrent compatible
requests run as one transformer batch and each gets the images it gets alone; incompatible
ones run separately; a full queue answers 429; a request that fails in a batch fails alone.
/metrics counts the batches and their sizes."""
from __future__ import annotations

import asyncio
import base64
import io
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.serve.helpers import assert_openai_error
from tests.visual_gen.tiny_models import save_tiny_model
from tllm.serve.context import ServerConfig
from tllm.serve.testing import ServerThread
from tllm.serve.visual.batcher import BatchingConfig
from tllm.serve.visual.images import build_images_app
from tllm.visual_gen.params import VisualGenParams

ROUTE = "/v1/images/generations"
COMMON = {"size": "48x32", "steps": 2, "negative_prompt": " ", "true_cfg_scale": 2.5}
BODIES = [{"prompt": "a cat", "seed": 1, **COMMON},
          {"prompt": "a red fox in the snow at night", "seed": 7, "n": 2, **COMMON},
          {"prompt": "a dog", "seed": 3, **COMMON}]


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    from tllm.visual_gen import VisualGen
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny_qwen_image"))
    return VisualGen(str(folder), device="cpu", show_progress=False)


class CountingGen:
    """The model, counting its pipeline calls; `gate`, when set, holds each call until
    released."""

    def __init__(self, gen) -> None:
        self.gen = gen
        self.num_calls = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.gen, name)

    def _enter(self) -> None:
        self.num_calls += 1
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(60)

    def generate(self, *args, **kwargs):
        self._enter()
        return self.gen.generate(*args, **kwargs)

    def generate_batch(self, *args, **kwargs):
        self._enter()
        return self.gen.generate_batch(*args, **kwargs)


@contextmanager
def serve(gen, tmp_path, max_queue_size=None, **batching):
    app = build_images_app(gen, ServerConfig(model="m", max_queue_size=max_queue_size),
                           files_dir=tmp_path, batching=BatchingConfig(**batching))
    try:
        with ServerThread(app) as server:
            yield server
    finally:
        app.state.ctx.close()


async def post_all(base_url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        return await asyncio.gather(*(client.post(ROUTE, json=body) for body in bodies))


def pixels(response: httpx.Response) -> list[np.ndarray]:
    assert response.status_code == 200, response.text
    return [np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))), np.int16)
            for item in response.json()["data"]]


def alone(gen, body: dict) -> list[np.ndarray]:
    width, height = (int(side) for side in body["size"].split("x"))
    params = VisualGenParams(height=height, width=width, num_inference_steps=body["steps"],
                             seed=body["seed"], num_images_per_prompt=body.get("n", 1),
                             negative_prompt=body["negative_prompt"],
                             true_cfg_scale=body["true_cfg_scale"])
    return [np.asarray(image, np.int16) for image in gen.generate(body["prompt"],
                                                                  params).images]


def batch_sizes(base_url: str) -> tuple[float, float]:
    """(batches run, requests in them) from /metrics."""
    text = httpx.get(f"{base_url}/metrics").text
    count, total = (re.search(rf'^tllm:visual_batch_size_{name}{{model_name="m"}} (\S+)$',
                              text, re.M).group(1) for name in ("count", "sum"))
    return float(count), float(total)


@pytest.mark.parametrize("num_requests", [2, 3])
def test_concurrent_requests_batch_and_each_gets_its_own_images(gen, tmp_path, num_requests):
    counting = CountingGen(gen)
    bodies = BODIES[:num_requests]
    with serve(counting, tmp_path, max_batch_size=num_requests, window_s=60) as server:
        responses = asyncio.run(post_all(server.base_url, bodies))
        assert batch_sizes(server.base_url) == (1, num_requests)
    assert counting.num_calls == 1
    for body, response in zip(bodies, responses):
        got, expected = pixels(response), alone(gen, body)
        assert len(got) == len(expected) == body.get("n", 1)
        # The batch's latents are within 1e-6 of each request's alone (tests/visual_gen/
        # test_batching.py); the 8-bit images came out identical in our runs.
        assert all(np.abs(a - b).max() <= 1 for a, b in zip(got, expected))


def test_incompatible_requests_run_separately(gen, tmp_path):
    counting = CountingGen(gen)
    bodies = [{**BODIES[0], "steps": 1}, {**BODIES[2], "steps": 2}]
    with serve(counting, tmp_path, max_batch_size=2, window_s=0.05) as server:
        responses = asyncio.run(post_all(server.base_url, bodies))
        assert batch_sizes(server.base_url) == (2, 2)
    assert counting.num_calls == 2
    assert all(response.status_code == 200 for response in responses)
    assert all("steps_skipped" not in response.json() for response in responses)  # no cache


def test_a_full_queue_answers_429(gen, tmp_path):
    counting = CountingGen(gen)
    counting.gate = threading.Event()
    body = {**BODIES[0], "steps": 1}
    with serve(counting, tmp_path, max_queue_size=1, max_batch_size=1) as server, \
            ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, server.base_url + ROUTE, json=body, timeout=60)
        assert counting.entered.wait(60)       # the first one runs: the queue is full
        error = assert_openai_error(httpx.post(server.base_url + ROUTE, json=body), 429)
        assert error["code"] == "queue_full"
        counting.gate.set()
        assert first.result().status_code == 200
        assert httpx.post(server.base_url + ROUTE, json=body, timeout=60).status_code == 200


def test_a_request_that_fails_in_a_batch_fails_alone(gen, tmp_path, monkeypatch):
    encode = gen.pipeline.text_embeds

    def text_embeds(prompts, params):
        if prompts == ["broken"]:
            raise ValueError("prompt cannot be encoded")
        return encode(prompts, params)

    monkeypatch.setattr(gen.pipeline, "text_embeds", text_embeds)
    bodies = [BODIES[0], {**BODIES[2], "prompt": "broken"}]
    with serve(gen, tmp_path, max_batch_size=2, window_s=60) as server:
        good, bad = asyncio.run(post_all(server.base_url, bodies))
        assert batch_sizes(server.base_url) == (1, 2)
    monkeypatch.undo()
    assert assert_openai_error(bad, 400)["param"] == "prompt"
    assert all(np.abs(a - b).max() <= 1 for a, b in zip(pixels(good), alone(gen, BODIES[0])))


def test_step_cached_requests_run_alone_and_get_their_own_images(gen, tmp_path):
    """Step caching decides its skips over the whole batch, so a request asking for it runs
    alone: each gets the image of VisualGen.generate with the same cache settings."""
    counting = CountingGen(gen)
    cached = {"cache": "teacache", "cache_threshold": 0.2}
    bodies = [{**BODIES[0], **cached}, {**BODIES[2], **cached}]
    with serve(counting, tmp_path, max_batch_size=2, window_s=0.05) as server:
        responses = asyncio.run(post_all(server.base_url, bodies))
    assert counting.num_calls == 2
    for body, response in zip(bodies, responses):
        width, height = (int(side) for side in body["size"].split("x"))
        params = VisualGenParams(height=height, width=width, num_inference_steps=body["steps"],
                                 seed=body["seed"], negative_prompt=body["negative_prompt"],
                                 true_cfg_scale=body["true_cfg_scale"], **cached)
        output = gen.generate(body["prompt"], params)
        expected = [np.asarray(image, np.int16) for image in output.images]
        assert all(np.abs(a - b).max() <= 1 for a, b in zip(pixels(response), expected))
        assert response.json()["steps_skipped"] == output.steps_skipped     # the extension


def test_a_bad_cache_name_is_a_400(gen, tmp_path):
    with serve(gen, tmp_path) as server:
        response = httpx.post(f"{server.base_url}{ROUTE}", json={**BODIES[0], "cache": "x"})
    assert response.status_code == 400
