"""The images server's housekeeping: a client that disconnects cancels its request (a queued
one is skipped, a running one stops at its next denoising step, a batch once all of its
clients left, the others still answered) and the next request is served; "url" files are
deleted once expired; a temporary files folder goes with the server."""
from __future__ import annotations

import asyncio
import os
import time

import httpx

from tests.serve.helpers import assert_openai_error
from tllm.serve.context import ServerConfig
from tllm.serve.visual.batcher import BatchingConfig
from tllm.serve.visual.images import build_images_app
from tllm.serve.testing import ServerThread
from tllm.visual_gen.pipeline import DenoiseHook

FAST = {"steps": 1, "seed": 0, "size": "32x16"}
STEP_S = 0.05
GIVE_UP_AFTER_S = 0.5


class StepCounter(DenoiseHook):
    """Sleeps STEP_S after each step (so that a generation outlasts its client) and counts."""

    def __init__(self) -> None:
        self.steps = 0

    def update(self, step) -> None:
        self.steps += 1
        time.sleep(STEP_S)


class SlowGen:
    """A VisualGen whose steps take STEP_S each; counts the generations started."""

    def __init__(self, gen) -> None:
        self.gen = gen
        self.counter = StepCounter()
        self.num_started = 0

    def __getattr__(self, name: str):
        return getattr(self.gen, name)

    def generate(self, prompt, params, image=None, hooks=()):
        self.num_started += 1
        return self.gen.generate(prompt, params, image=image, hooks=[*hooks, self.counter])

    def generate_batch(self, requests, hooks=()):
        self.num_started += 1
        return self.gen.generate_batch(requests, hooks=[*hooks, self.counter])


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


async def give_up(base_url: str, num_requests: int) -> list[BaseException]:
    """num_requests long generations at once, each abandoned after GIVE_UP_AFTER_S."""
    body = {"prompt": "a cat", "steps": 200, "seed": 0, "size": "32x16"}
    async with httpx.AsyncClient(base_url=base_url, timeout=GIVE_UP_AFTER_S) as client:
        return await asyncio.gather(
            *(client.post("/v1/images/generations", json=body) for _ in range(num_requests)),
            return_exceptions=True)


def test_clients_that_leave_cancel_their_requests(visual_gen, tmp_path):
    slow = SlowGen(visual_gen)
    app = build_images_app(slow, ServerConfig(model="m"), files_dir=tmp_path,
                           batching=BatchingConfig(max_batch_size=1))
    ctx = app.state.ctx
    with ServerThread(app) as server:
        results = asyncio.run(give_up(server.base_url, 2))
        assert all(isinstance(r, httpx.TimeoutException) for r in results), results
        wait_for(lambda: ctx.num_cancelled == 2 and ctx.num_pending == 0)
        # The running one stopped within a step or two of the client leaving; the queued
        # one never started.
        assert slow.num_started == 1
        assert slow.counter.steps <= (GIVE_UP_AFTER_S + 1.0) / STEP_S < 200
        response = httpx.post(f"{server.base_url}/v1/images/generations",
                              json={"prompt": "a dog", **FAST}, timeout=60)
        assert response.status_code == 200, response.text
        assert slow.num_started == 2


def test_a_batch_stops_once_all_of_its_clients_left(visual_gen, tmp_path):
    slow = SlowGen(visual_gen)
    app = build_images_app(slow, ServerConfig(model="m"), files_dir=tmp_path,
                           batching=BatchingConfig(max_batch_size=2, window_s=60))
    ctx = app.state.ctx
    with ServerThread(app) as server:
        results = asyncio.run(give_up(server.base_url, 2))
        assert all(isinstance(r, httpx.TimeoutException) for r in results), results
        wait_for(lambda: ctx.num_cancelled == 2 and ctx.num_pending == 0)
        assert slow.num_started == 1        # one batch of both
        assert slow.counter.steps <= (GIVE_UP_AFTER_S + 1.0) / STEP_S < 200


def test_a_batch_goes_on_for_the_clients_that_stay(visual_gen, tmp_path):
    slow = SlowGen(visual_gen)
    app = build_images_app(slow, ServerConfig(model="m"), files_dir=tmp_path,
                           batching=BatchingConfig(max_batch_size=2, window_s=60))
    body = {"prompt": "a cat", "steps": 12, "seed": 0, "size": "32x16"}  # >= 0.6 s

    async def one_leaves(base_url: str):
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as stays, \
                httpx.AsyncClient(base_url=base_url, timeout=GIVE_UP_AFTER_S) as leaves:
            return await asyncio.gather(stays.post("/v1/images/generations", json=body),
                                        leaves.post("/v1/images/generations", json=body),
                                        return_exceptions=True)

    with ServerThread(app) as server:
        kept, left = asyncio.run(one_leaves(server.base_url))
        assert isinstance(left, httpx.TimeoutException), left
        assert kept.status_code == 200, kept.text
        wait_for(lambda: app.state.ctx.num_cancelled == 1)
    assert slow.num_started == 1 and slow.counter.steps == 12


def test_url_files_expire(visual_gen, tmp_path):
    app = build_images_app(visual_gen, ServerConfig(model="m", image_url_ttl_s=60),
                           files_dir=tmp_path)
    other = tmp_path / "notes.txt"      # not ours: never swept
    other.write_text("x")
    with ServerThread(app) as server, httpx.Client(base_url=server.base_url,
                                                   timeout=60) as client:
        def url_image() -> str:
            response = client.post("/v1/images/generations",
                                   json={"prompt": "a cat", "response_format": "url", **FAST})
            assert response.status_code == 200, response.text
            return response.json()["data"][0]["url"]

        old_url = url_image()
        assert client.get(old_url).status_code == 200
        long_ago = time.time() - 61
        for path in [*tmp_path.glob("*.png"), other]:
            os.utime(path, (long_ago, long_ago))
        new_url = url_image()       # writing a file sweeps the expired ones
        assert_openai_error(client.get(old_url), 404)
        assert client.get(new_url).status_code == 200
        assert other.exists() and len(list(tmp_path.glob("*.png"))) == 1


def test_a_temporary_files_folder_is_removed_on_close(visual_gen):
    app = build_images_app(visual_gen, ServerConfig(model="m"))
    files_dir = app.state.ctx.files_dir
    assert files_dir.is_dir()
    app.state.ctx.close()
    assert not files_dir.exists()



def test_with_the_api_key_url_files_are_signed_and_expire(visual_gen, tmp_path):
    """Issue 31, item 6: a "url" answer is a signed URL that lasts image_url_ttl_s; the file
    without its signature, or after that, needs the key."""
    app = build_images_app(visual_gen, ServerConfig(model="m", api_key="k",
                                                    image_url_ttl_s=60), files_dir=tmp_path)
    with ServerThread(app) as server, httpx.Client(timeout=60) as client:
        response = client.post(f"{server.base_url}/v1/images/generations",
                               headers={"Authorization": "Bearer k"},
                               json={"prompt": "a cat", "response_format": "url", **FAST})
        assert response.status_code == 200, response.text
        url = response.json()["data"][0]["url"]
        assert client.get(url).headers["content-type"] == "image/png"     # no key needed
        assert_openai_error(client.get(url.split("?")[0]), 401)
        signer = app.state.ctx.signer
        signer.clock = lambda: time.time() + 61
        assert_openai_error(client.get(url), 401)
