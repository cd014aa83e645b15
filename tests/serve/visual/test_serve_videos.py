"""The videos endpoints on a tiny random Cosmos 3: submit, poll, download the MP4, list,
delete; DELETE cancels a running job at its next step and the next job runs; the synchronous
form answers the MP4 and a client that leaves cancels it; bad requests are 400s naming the
field, before anything is queued."""
from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import numpy as np
import pytest

from tests.serve.helpers import assert_openai_error
from tests.visual_gen.tiny_cosmos import save_tiny_cosmos
from tllm.serve.context import ServerConfig
from tllm.serve.visual.images import build_images_app
from tllm.serve.testing import ServerThread
from tllm.visual_gen.params import VisualGenParams
from tllm.visual_gen.pipeline import DenoiseHook
from tllm.visual_gen.video_io import decode_mp4

FAST = {"steps": 2, "seed": 0, "size": "48x32", "num_frames": 5}
STEP_S = 0.05


class SlowSteps(DenoiseHook):
    def __init__(self) -> None:
        self.steps = 0

    def update(self, step) -> None:
        self.steps += 1
        time.sleep(STEP_S)


class SlowGen:
    """The model, with STEP_S added to each denoising step; counts steps and generations."""

    def __init__(self, gen) -> None:
        self.gen, self.hook, self.num_started = gen, SlowSteps(), 0

    def __getattr__(self, name: str):
        return getattr(self.gen, name)

    def generate(self, prompt, params, image=None, hooks=()):
        self.num_started += 1
        return self.gen.generate(prompt, params, image=image, hooks=[*hooks, self.hook])


@pytest.fixture(scope="module")
def cosmos(tmp_path_factory):
    from tllm.visual_gen import VisualGen
    folder = save_tiny_cosmos(tmp_path_factory.mktemp("tiny_cosmos_serve"))
    return VisualGen(str(folder), device="cpu", show_progress=False)


@pytest.fixture(scope="module")
def served(cosmos):
    slow = SlowGen(cosmos)
    app = build_images_app(slow, ServerConfig(model="cosmos"))
    with ServerThread(app) as server, httpx.Client(base_url=server.base_url,
                                                   timeout=60) as client:
        yield client, slow, server
    app.state.ctx.close()


def _wait(client, video_id: str, status: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.get(f"/v1/videos/{video_id}").json()
        if job["status"] == status:
            return job
        assert job["status"] not in ("failed", "completed"), job
        assert time.monotonic() < deadline, job
        time.sleep(0.02)


def test_submit_poll_download_delete(served):
    client, _, _ = served
    response = client.post("/v1/videos", json={"prompt": "a fox", **FAST})
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["object"] == "video" and job["id"].startswith("video_")
    assert job["status"] in ("queued", "in_progress") and job["model"] == "cosmos"
    done = _wait(client, job["id"], "completed")
    assert done["progress"] == 100 and done["completed_at"] >= done["created_at"]
    content = client.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    frames, rate, _ = decode_mp4(content.content)
    assert frames.shape == (5, 32, 48, 3) and rate == 24
    assert job["id"] in [j["id"] for j in client.get("/v1/videos").json()["data"]]
    deleted = client.delete(f"/v1/videos/{job['id']}").json()
    assert deleted == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert_openai_error(client.get(f"/v1/videos/{job['id']}"), 404)
    assert_openai_error(client.get(f"/v1/videos/{job['id']}/content"), 404)


def test_seconds_and_fps_set_the_frames(served):
    client, _, _ = served
    body = {**FAST, "prompt": "a cube", "seconds": "0.5", "fps": 16}
    del body["num_frames"]
    job = client.post("/v1/videos", json=body).json()
    _wait(client, job["id"], "completed")
    frames, rate, _ = decode_mp4(client.get(f"/v1/videos/{job['id']}/content").content)
    assert frames.shape[0] == 9 and rate == 16      # 4 * round(0.5 * 16 / 4) + 1


def test_step_caching_reports_steps_skipped(served, cosmos):
    client, _, _ = served
    cached = {"cache": "teacache", "cache_threshold": 0.2}
    body = {**FAST, "prompt": "a fox", "steps": 4, **cached}
    job = client.post("/v1/videos", json=body).json()
    assert "steps_skipped" not in job           # known once completed
    done = _wait(client, job["id"], "completed")
    expected = cosmos.generate("a fox", VisualGenParams(
        num_frames=5, height=32, width=48, num_inference_steps=4, seed=0, **cached))
    assert [done["steps_skipped"]] == expected.steps_skipped and done["steps_skipped"] >= 1
    plain = client.post("/v1/videos", json={**FAST, "prompt": "a fox"}).json()
    assert "steps_skipped" not in _wait(client, plain["id"], "completed")


def test_delete_cancels_a_running_job(served):
    client, slow, _ = served
    job = client.post("/v1/videos", json={"prompt": "a fox", **FAST, "steps": 200}).json()
    _wait(client, job["id"], "in_progress")
    before = slow.hook.steps
    while slow.hook.steps < before + 2:
        time.sleep(0.01)
    assert client.delete(f"/v1/videos/{job['id']}").status_code == 200
    started = slow.num_started
    nxt = client.post("/v1/videos", json={"prompt": "a cube", **FAST}).json()
    _wait(client, nxt["id"], "completed")       # the worker was freed
    assert slow.num_started == started + 1
    assert slow.hook.steps - before < 100       # the cancelled one stopped early


def test_content_before_completion_is_409(served):
    client, _, _ = served
    job = client.post("/v1/videos", json={"prompt": "a fox", **FAST, "steps": 40}).json()
    assert_openai_error(client.get(f"/v1/videos/{job['id']}/content"), 409)
    client.delete(f"/v1/videos/{job['id']}")


def test_sync_generation_and_disconnect(served):
    client, slow, server = served
    response = client.post("/v1/videos/generations", json={"prompt": "a fox", **FAST})
    assert response.status_code == 200 and response.headers["content-type"] == "video/mp4"
    assert decode_mp4(response.content)[0].shape == (5, 32, 48, 3)

    async def leave() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=0.5) as impatient:
            with pytest.raises(httpx.TimeoutException):
                await impatient.post("/v1/videos/generations",
                                     json={"prompt": "a fox", **FAST, "steps": 200})

    before = slow.hook.steps
    asyncio.run(leave())
    again = client.post("/v1/videos/generations", json={"prompt": "a cube", **FAST})
    assert again.status_code == 200      # served once the abandoned one stopped
    assert slow.hook.steps - before < 100


def test_image_to_video(served):
    from PIL import Image
    client, _, _ = served
    buffer = io.BytesIO()
    Image.fromarray((np.random.RandomState(0).rand(20, 30, 3) * 255).astype(np.uint8)).save(
        buffer, format="PNG")
    body = {"prompt": "the fox turns", **FAST,
            "input_reference": base64.b64encode(buffer.getvalue()).decode()}
    job = client.post("/v1/videos", json=body).json()
    _wait(client, job["id"], "completed")


@pytest.mark.parametrize("body,param", [
    ({"size": "47x32"}, "size"), ({"size": "big"}, "size"), ({"num_frames": 6}, "num_frames"),
    ({"num_frames": 0}, "num_frames"), ({"seconds": "-1"}, "seconds"),
    ({"seconds": "soon"}, "seconds"), ({"fps": 0}, "fps"), ({"steps": 0}, "steps"),
    ({"input_reference": "not base64!"}, "input_reference"), ({"prompt": ""}, "prompt"),
    ({"colour": "red"}, "colour")])
def test_bad_requests_are_400s(served, body, param):
    client, slow, _ = served
    started = slow.num_started
    error = assert_openai_error(client.post("/v1/videos", json={"prompt": "a fox", **FAST,
                                                                **body}), 400)
    assert error["param"] == param or param in (error["param"] or "") or param in error["message"]
    assert slow.num_started == started


def test_unknown_model_and_id(served):
    client, _, _ = served
    assert_openai_error(client.post("/v1/videos", json={"prompt": "x", "model": "sora-2"}), 404)
    assert_openai_error(client.get("/v1/videos/video_nope"), 404)
    assert_openai_error(client.delete("/v1/videos/video_nope"), 404)


def test_images_endpoint_points_to_videos(served):
    client, _, _ = served
    error = assert_openai_error(client.post("/v1/images/generations", json={"prompt": "x"}), 400)
    assert "/v1/videos" in error["message"]
