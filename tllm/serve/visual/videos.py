"""The videos endpoints of the visual server, in the shape of TensorRT-LLM's visual-generation
server (OpenAI's Videos API): `POST /v1/videos` queues a job and answers its id at once;
`GET /v1/videos/{id}` polls its status (queued, in_progress with a progress percentage,
completed, failed); `GET /v1/videos/{id}/content` downloads the MP4; `DELETE /v1/videos/{id}`
cancels a job that has not finished (it stops at the next denoising step) and forgets it;
`GET /v1/videos` lists the jobs. `POST /v1/videos/generations` is the synchronous form: it
answers the MP4 itself, and a client that disconnects cancels it.

Requests are validated before they are queued (400s naming the field, as the images
endpoint does). Jobs run one at a time on the images' worker thread; finished jobs are kept
(MP4s in memory) until `MAX_FINISHED_JOBS` newer ones have finished.
Body fields: prompt, model, size ("WxH"), seconds, and tllm's extensions fps, num_frames,
steps, seed, negative_prompt, guidance_scale, input_reference (a base64 image: image-to-video),
cache and cache_threshold (step caching: a completed job then reports `steps_skipped`).
"""
from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tllm.serve.http.errors import APIError, bad_request
from tllm.serve.openai.generation import abort_on_disconnect
from tllm.serve.openai.image_input import decode_image
from tllm.serve.http.app import read_body
from tllm.serve.openai.protocol import INT64_MAX

MAX_STEPS = 200
MAX_SECONDS = 60.0
MAX_FINISHED_JOBS = 64
_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
_PARAM_NAMES = {"height": "size", "width": "size", "num_inference_steps": "steps",
                "frame_rate": "fps"}


class VideoGenerationRequest(BaseModel):
    """OpenAI's videos body and tllm's (TensorRT-LLM's) extensions."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str = Field(min_length=1)
    model: Optional[str] = None
    size: Optional[str] = None              # "WxH"; None: the model's default
    seconds: Optional[float | int | str] = None     # OpenAI sends a string ("4")
    fps: Optional[float | int] = None
    num_frames: Optional[int] = None
    steps: Optional[int] = Field(None, ge=1, le=MAX_STEPS)
    seed: Optional[int] = Field(None, ge=0, le=INT64_MAX)
    negative_prompt: Optional[str] = None
    guidance_scale: Optional[float | int] = None
    input_reference: Optional[str] = None   # base64 PNG/JPEG: image-to-video
    cache: Optional[Literal["teacache", "first_block"]] = None   # step caching
    cache_threshold: Optional[float] = Field(None, ge=0)
    user: Optional[str] = None


@dataclass
class VideoJob:
    """One video request and what became of it (written by the worker thread)."""

    id: str
    model: str
    prompt: str
    params: Any
    image: Any
    size: str
    seconds: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    progress: int = 0
    completed_at: Optional[int] = None
    error: Optional[dict] = None
    mp4: Optional[bytes] = None
    cancellation: Any = None
    steps_skipped: Optional[int] = None     # with step caching, once completed

    def as_json(self) -> dict:
        body = {"id": self.id, "object": "video", "model": self.model, "status": self.status,
                "progress": self.progress, "created_at": self.created_at,
                "completed_at": self.completed_at, "size": self.size, "seconds": self.seconds,
                "prompt": self.prompt, "error": self.error}
        if self.steps_skipped is not None:      # tllm's extension
            body["steps_skipped"] = self.steps_skipped
        return body


class VideoJobs:
    """The jobs of one server, by id (kept in creation order)."""

    def __init__(self) -> None:
        self.jobs: OrderedDict[str, VideoJob] = OrderedDict()
        self.lock = threading.Lock()

    def add(self, job: VideoJob) -> None:
        with self.lock:
            self.jobs[job.id] = job
            finished = [j.id for j in self.jobs.values() if j.status in ("completed", "failed")]
            for old in finished[:max(0, len(finished) - MAX_FINISHED_JOBS)]:
                del self.jobs[old]

    def get(self, video_id: str) -> VideoJob:
        job = self.jobs.get(video_id)
        if job is None:
            raise APIError(404, f"no video with id {video_id!r}", param="video_id",
                           code="video_not_found")
        return job

    def remove(self, video_id: str) -> VideoJob:
        with self.lock:
            job = self.get(video_id)
            del self.jobs[video_id]
            return job

    @property
    def num_pending(self) -> int:
        return sum(j.status in ("queued", "in_progress") for j in list(self.jobs.values()))


def video_routes(ctx) -> APIRouter:
    """The /v1/videos routes over an ImagesContext (its model, worker thread and config)."""
    jobs = VideoJobs()
    ctx.video_jobs = jobs
    api = APIRouter(prefix="/v1")   # behind the API key: auth.ApiKeyGuard

    @api.post("/videos")
    async def create(request: Request) -> Response:
        job = await _new_job(ctx, request, jobs)
        jobs.add(job)
        ctx.pool.submit(_run_job, ctx, job)
        return JSONResponse(job.as_json())

    @api.post("/videos/generations")
    async def create_sync(request: Request) -> Response:
        job = await _new_job(ctx, request, jobs)
        async with abort_on_disconnect(request, job.cancellation):
            await asyncio.get_running_loop().run_in_executor(ctx.pool, _run_job, ctx, job)
        if job.status == "cancelled":
            raise APIError(499, "the client closed the request", code="client_closed")
        if job.status != "completed":
            raise APIError(500, job.error["message"], code=job.error["code"])
        return Response(job.mp4, media_type="video/mp4")

    @api.get("/videos")
    async def list_jobs() -> Response:
        data = [job.as_json() for job in list(jobs.jobs.values())]
        return JSONResponse({"object": "list", "data": data})

    @api.get("/videos/{video_id}")
    async def retrieve(video_id: str) -> Response:
        return JSONResponse(jobs.get(video_id).as_json())

    @api.get("/videos/{video_id}/content")
    async def content(video_id: str) -> Response:
        job = jobs.get(video_id)
        if job.status != "completed":
            raise APIError(409, f"video {video_id!r} is {job.status}, not completed",
                           param="video_id", code="video_not_ready")
        return Response(job.mp4, media_type="video/mp4",
                        headers={"content-disposition": f'attachment; filename="{job.id}.mp4"'})

    @api.delete("/videos/{video_id}")
    async def delete(video_id: str) -> Response:
        job = jobs.remove(video_id)
        job.cancellation.abort()        # a queued job is skipped, a running one stops
        return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})

    return api


async def _new_job(ctx, request: Request, jobs: VideoJobs) -> VideoJob:
    from tllm.visual_gen.pipeline import Cancellation

    body = await read_body(request, VideoGenerationRequest, ctx.config.max_body_bytes)
    if body.model is not None and body.model != ctx.config.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                       f"{ctx.config.model_name!r}", param="model", code="model_not_found")
    limit = ctx.config.max_queue_size
    if limit is not None and jobs.num_pending >= limit:
        raise APIError(429, f"too many video requests waiting ({limit})", code="queue_full",
                       headers={"retry-after": "1"})
    params = _params(ctx, body)
    image = _input_image(body, ctx.config.max_image_pixels)
    try:
        ctx.gen.check_request(body.prompt, params, image)
    except ValueError as exc:
        raise from_value_error(exc) from exc
    size = body.size or f"{params.width or 'default'}x{params.height or 'default'}"
    seconds = str(body.seconds) if body.seconds is not None else ""
    return VideoJob(f"video_{uuid.uuid4().hex}", ctx.config.model_name, body.prompt, params,
                    image, size, seconds, cancellation=Cancellation())


def _params(ctx, body: VideoGenerationRequest):
    from tllm.visual_gen.params import VisualGenParams

    width = height = None
    if body.size is not None:
        match = _SIZE.match(body.size)
        if not match:
            raise bad_request(f"size must be 'WIDTHxHEIGHT' (e.g. '1280x720'), got "
                              f"{body.size!r}", param="size")
        width, height = int(match.group(1)), int(match.group(2))
    num_frames = body.num_frames
    fps = None if body.fps is None else float(body.fps)
    if body.seconds is not None:
        seconds = _seconds(body.seconds)
        if num_frames is not None:
            raise bad_request("give seconds or num_frames, not both", param="seconds")
        num_frames = ctx.gen.frames_for_duration(seconds, fps)
    optional = {"num_inference_steps": body.steps, "cache": body.cache,
                "cache_threshold": body.cache_threshold}
    try:
        return VisualGenParams(
            height=height, width=width, seed=body.seed, negative_prompt=body.negative_prompt,
            guidance_scale=None if body.guidance_scale is None else float(body.guidance_scale),
            num_frames=num_frames, frame_rate=fps,
            **{k: v for k, v in optional.items() if v is not None})
    except ValueError as exc:
        raise from_value_error(exc) from exc


def _seconds(value) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= MAX_SECONDS:
        raise bad_request(f"seconds must be a number in (0, {MAX_SECONDS:g}], got {value!r}",
                          param="seconds")
    return seconds


def _input_image(body: VideoGenerationRequest, max_pixels: int):
    if body.input_reference is None:
        return None
    return decode_image(body.input_reference, "input_reference", max_pixels)


def _run_job(ctx, job: VideoJob) -> None:
    """In the worker thread: generate, encode the MP4, record the outcome on the job."""
    from tllm.visual_gen.pipeline import DenoiseHook, GenerationCancelled
    from tllm.visual_gen.video_io import encode_mp4

    class Progress(DenoiseHook):
        def update(self, step) -> None:
            job.progress = int(100 * (step.index + 1) / step.num_steps)

    if job.cancellation.aborted:
        job.status = "cancelled"
        return
    job.status = "in_progress"
    try:
        output = ctx.gen.generate(job.prompt, job.params, image=job.image,
                                  hooks=[job.cancellation, Progress()])
        audio = output.audio[0] if output.audio else None
        job.mp4 = encode_mp4(output.videos[0], output.frame_rate, audio, output.sample_rate)
        job.steps_skipped = output.steps_skipped[0] if output.steps_skipped else None
        job.status, job.progress = "completed", 100
    except GenerationCancelled:
        job.status = "cancelled"
        ctx.num_cancelled += 1
    except Exception as exc:    # the job fails; the server and other jobs go on
        job.status = "failed"
        job.error = {"code": "generation_failed", "message": f"{type(exc).__name__}: {exc}"}
    finally:
        job.completed_at = int(time.time())


def from_value_error(exc: ValueError) -> APIError:
    """A ValueError of VisualGenParams or of the pipeline as a 400 naming the body field."""
    message = str(exc).removeprefix("VisualGenParams.")
    match = re.match(r"(\w+)\b", message)
    param = match.group(1) if match else None
    if param in _PARAM_NAMES:
        param = _PARAM_NAMES[param]
    elif param not in VideoGenerationRequest.model_fields:
        param = None
    return bad_request(message, param=param)
