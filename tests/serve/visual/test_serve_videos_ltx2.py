"""The videos endpoints on a tiny random LTX-2: the MP4 a job returns carries the audio track,
the synchronous form too, and LTX-2's frame rule is a 400 naming num_frames."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.serve.helpers import assert_openai_error
from tests.visual_gen.tiny_ltx2 import save_tiny_ltx2
from tllm.serve.context import ServerConfig
from tllm.serve.visual.images import build_images_app
from tllm.serve.testing import ServerThread
from tllm.visual_gen.video_io import decode_mp4

FAST = {"steps": 2, "seed": 0, "size": "64x32", "num_frames": 5, "guidance_scale": 1}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tllm.visual_gen import VisualGen
    folder = save_tiny_ltx2(tmp_path_factory.mktemp("tiny_ltx2_serve"))
    app = build_images_app(VisualGen(str(folder), device="cpu", show_progress=False),
                           ServerConfig(model="ltx2"))
    with ServerThread(app) as server, httpx.Client(base_url=server.base_url,
                                                   timeout=60) as client:
        yield client
    app.state.ctx.close()


def test_job_mp4_has_sound(served):
    job = served.post("/v1/videos", json={"prompt": "waves", **FAST}).json()
    deadline = time.monotonic() + 60
    while (status := served.get(f"/v1/videos/{job['id']}").json()["status"]) != "completed":
        assert status not in ("failed",) and time.monotonic() < deadline, status
        time.sleep(0.02)
    frames, rate, has_audio = decode_mp4(served.get(f"/v1/videos/{job['id']}/content").content)
    assert frames.shape == (5, 32, 64, 3) and rate == 24 and has_audio


def test_sync_mp4_has_sound(served):
    response = served.post("/v1/videos/generations", json={"prompt": "rain", **FAST})
    assert response.status_code == 200
    assert decode_mp4(response.content)[2]


@pytest.mark.parametrize("body,param", [({"num_frames": 4}, "num_frames"),
                                        ({"size": "48x32"}, "size")])
def test_ltx2_rules_are_400s(served, body, param):
    error = assert_openai_error(served.post("/v1/videos", json={"prompt": "x", **FAST, **body}),
                                400)
    assert param in (error["param"] or "") or param in error["message"]
