"""The images server: `POST /v1/images/generations` in OpenAI's images format over one
VisualGen, plus /v1/models, /health, /version, and generated files under /files (for
response_format "url"; with --api-key their URLs are signed and expire with the file).

Generation runs in one worker thread (one image batch on the device at a time), so the event
loop keeps answering while it runs. Compatible requests (same size, steps, guidance...) run as
one transformer batch (batcher.py: up to `max_batch_size`, collected for `window_s`), each
getting the images it gets alone; requests beyond `max_queue_size` pending get 429. A client
that disconnects cancels its request: removed if still queued, stopped at the next denoising
step if running (a batch stops once all of its clients have left). Files behind "url"
responses are deleted `image_url_ttl_s` after they were written (OpenAI's image URLs also
expire, after an hour). GET /metrics has the batch sizes.
Extensions to OpenAI's body: steps, seed, negative_prompt, true_cfg_scale, guidance_scale;
for the layered model, `image` (base64 input image), layers, resolution and caption_language
(a blank prompt asks the model to caption the image, where its folder has a processor), and
each generated image gives `layers` entries of `data`, in order. With step caching (`cache`),
the response's `steps_skipped` lists the denoising steps each generated image skipped.
"""
from __future__ import annotations

import base64
import io
import re
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from fastapi import APIRouter, FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.staticfiles import StaticFiles

from tllm import __version__
from tllm.serve.http.auth import Grant, UrlSigner, install_api_key_guard
from tllm.serve.context import ServerConfig
from tllm.serve.http.errors import APIError, bad_request, install_error_handlers, internal_error
from tllm.serve.openai.image_input import decode_image
from tllm.serve.openai.generation import abort_on_disconnect
from tllm.serve.http.limits import install_request_limits
from tllm.serve.http.server import run_uvicorn
from tllm.serve.http.app import read_body
from tllm.serve.openai.protocol import INT64_MAX, ModelCard, ModelList
from tllm.serve.http.request_ids import RequestIdMiddleware
from tllm.serve.visual.batcher import (BatchMetrics, BatchingConfig, ImageBatcher, QueueFull,
                                       QueuedRequest)

MAX_N = 10              # OpenAI's cap on images per request
MAX_STEPS = 200
FILES_ROUTE = "/files"
_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
_FILE_NAME = re.compile(r"^[0-9a-f]{32}\.png$")     # what save() writes: all sweeps remove
# VisualGenParams' field names as the request spells them.
_PARAM_NAMES = {"height": "size", "width": "size", "num_inference_steps": "steps",
                "num_images_per_prompt": "n"}


class ImageGenerationRequest(BaseModel):
    """OpenAI's images/generations body (its unused styling fields are accepted and ignored)
    and tllm's extensions."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str = Field(min_length=1)
    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_N)
    size: Optional[str] = None          # "WxH"; None or "auto": the model's default
    response_format: Literal["b64_json", "url"] = "b64_json"
    quality: Optional[str] = None
    style: Optional[str] = None
    user: Optional[str] = None
    # extensions
    steps: Optional[int] = Field(None, ge=1, le=MAX_STEPS)
    seed: Optional[int] = Field(None, ge=0, le=INT64_MAX)
    negative_prompt: Optional[str] = None
    true_cfg_scale: Optional[float] = None
    guidance_scale: Optional[float] = None
    image: Optional[str] = None         # base64 input image (layered model)
    layers: Optional[int] = None
    resolution: Optional[int] = None
    caption_language: Optional[str] = None     # layered model, prompt " ": caption it
    cache: Optional[Literal["teacache", "first_block"]] = None   # step caching
    cache_threshold: Optional[float] = Field(None, ge=0)


@dataclass
class ImagesContext:
    """What the image endpoints share: the model, the worker thread, the files folder."""

    gen: Any
    config: ServerConfig
    files_dir: Path
    owns_files_dir: bool = False        # a temporary folder, removed on close()
    batching: BatchingConfig = BatchingConfig()
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tllm-visual"))
    signer: UrlSigner = field(default_factory=UrlSigner)
    num_cancelled: int = 0

    def __post_init__(self) -> None:
        self.metrics = BatchMetrics(self.config.model_name)
        self.batcher = ImageBatcher(
            lambda batch, stop: _generate_batch_pngs(self.gen, batch, stop), self.pool,
            self.batching.max_batch_size, self.batching.window_s, self.config.max_queue_size,
            self.metrics)

    @property
    def num_pending(self) -> int:
        """Image requests waiting or running."""
        return self.batcher.num_pending

    def save(self, png: bytes) -> str:
        """Write a PNG for a "url" response, first deleting the expired ones; its name."""
        self.remove_expired_files()
        name = f"{uuid.uuid4().hex}.png"
        (self.files_dir / name).write_bytes(png)
        return name

    def file_url(self, base_url: str, name: str) -> str:
        """A saved file's URL: signed, expiring with the file, when the API key guards the
        server (a browser or downloader fetches it without the key, as OpenAI's)."""
        path = f"{FILES_ROUTE}/{name}"
        if self.config.api_key is None:
            return base_url + path
        return f"{base_url}{path}?{self.signer.sign(path, self.config.image_url_ttl_s)}"

    def files_grant(self) -> Grant:
        return Grant(FILES_ROUTE + "/",
                     lambda request: self.signer.verify(request.url.path, request.query_params),
                     hint="or the signed URL a response_format=url answer gave")

    def remove_expired_files(self) -> None:
        deadline = time.time() - self.config.image_url_ttl_s
        for path in self.files_dir.iterdir():
            try:
                if _FILE_NAME.match(path.name) and path.stat().st_mtime < deadline:
                    path.unlink()
            except FileNotFoundError:     # removed meanwhile (e.g. by another server)
                pass

    def close(self) -> None:
        self.batcher.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.owns_files_dir:
            shutil.rmtree(self.files_dir, ignore_errors=True)


def build_images_app(gen, config: ServerConfig, files_dir: str | Path | None = None,
                     batching: BatchingConfig = BatchingConfig()) -> FastAPI:
    """The server's ASGI app over a loaded VisualGen; call `app.state.ctx.close()` once the
    server has stopped. Files for "url" responses go to files_dir (by default a new temporary
    folder, removed on close)."""
    owns_files_dir = files_dir is None
    files_dir = Path(files_dir or tempfile.mkdtemp(prefix="tllm-images-"))
    files_dir.mkdir(parents=True, exist_ok=True)
    ctx = ImagesContext(gen, config, files_dir, owns_files_dir, batching)
    app = FastAPI(title="tllm", version=__version__)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_exception_handler(Exception, _internal_error)
    install_request_limits(app, config.http_limits)
    install_api_key_guard(app, config.api_key, config.protect_metrics,
                          grants=[ctx.files_grant()])
    app.add_middleware(RequestIdMiddleware)     # outermost: every response names its id
    app.include_router(_api_routes(ctx))
    if getattr(gen, "makes_video", False):
        from tllm.serve.visual.videos import video_routes
        app.include_router(video_routes(ctx))
    app.include_router(_ops_routes(ctx))
    app.mount(FILES_ROUTE, StaticFiles(directory=files_dir), name="files")
    return app


def serve_images(args, config: ServerConfig) -> int:
    """`tllm serve` for a visual model: load it, then serve until interrupted."""
    from tllm.visual_gen.api import VisualGen

    gen = VisualGen(config.model, dtype=args.dtype or "auto", device=args.device)
    batching = BatchingConfig(args.visual_max_batch_size, args.visual_batch_window_ms / 1000)
    app = build_images_app(gen, config, batching=batching)
    print(f"serving {config.model_name} on http://{args.host}:{args.port}/v1 (images)",
          file=sys.stderr)
    try:
        run_uvicorn(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        app.state.ctx.close()
    return 0


def _api_routes(ctx: ImagesContext) -> APIRouter:
    config = ctx.config
    api = APIRouter(prefix="/v1")

    @api.post("/images/generations")
    async def generations(request: Request) -> Response:
        body = await read_body(request, ImageGenerationRequest, config.max_body_bytes)
        return JSONResponse(await create_images(ctx, request, body))

    @api.get("/models")
    async def models() -> Response:
        card = ModelCard(id=config.model_name, root=config.model_name)  # no server path
        return JSONResponse(ModelList(data=[card]).model_dump())

    return api


def _ops_routes(ctx: ImagesContext) -> APIRouter:
    ops = APIRouter()

    @ops.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @ops.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @ops.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    return ops


async def create_images(ctx: ImagesContext, request: Request,
                        body: ImageGenerationRequest) -> dict:
    if body.model is not None and body.model != ctx.config.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                       f"{ctx.config.model_name!r}", param="model", code="model_not_found")
    if getattr(ctx.gen, "makes_video", False):
        raise bad_request("this model generates videos: POST /v1/videos", param="model")
    params = _params(body)
    image = _input_image(ctx, body)
    queued = QueuedRequest(body.prompt, params, image, _batch_key(ctx.gen, params, image))
    generated = await _run_generation(ctx, request, queued)
    if body.response_format == "b64_json":
        data = [{"b64_json": base64.b64encode(png).decode()} for png in generated.pngs]
    else:
        base_url = str(request.base_url).rstrip("/")
        data = [{"url": ctx.file_url(base_url, ctx.save(png))} for png in generated.pngs]
    response = {"created": int(time.time()), "data": data}
    if generated.steps_skipped is not None:     # tllm's extension, with step caching
        response["steps_skipped"] = generated.steps_skipped
    return response


@dataclass
class GeneratedImages:
    """A request's PNGs, and with step caching the steps each generated image skipped."""

    pngs: list[bytes]
    steps_skipped: list[int] | None = None


async def _run_generation(ctx: ImagesContext, request: Request,
                          queued: QueuedRequest) -> GeneratedImages:
    """The images from the batcher; cancelled if the client disconnects meanwhile."""
    from tllm.visual_gen.pipeline import GenerationCancelled

    try:
        async with abort_on_disconnect(request, queued):
            return await ctx.batcher.submit(queued)
    except QueueFull as exc:
        raise APIError(429, str(exc), code="queue_full", headers={"retry-after": "1"}) from exc
    except ValueError as exc:
        raise _from_value_error(exc) from exc
    except GenerationCancelled as exc:
        ctx.num_cancelled += 1      # nobody reads the answer: the client has gone
        raise APIError(499, "the client closed the request", code="client_closed") from exc


def _batch_key(gen, params, image):
    """The request's batch key, or None where it runs alone (a model that does not batch, an
    input image, step caching)."""
    from tllm.visual_gen.batching import batch_key

    if image is not None or params.cache is not None or not getattr(gen, "can_batch", False):
        return None     # step caching decides skips per batch: alone, its image is its own
    return batch_key(params)


def _params(body: ImageGenerationRequest):
    from tllm.visual_gen.params import VisualGenParams

    width = height = None
    if body.size not in (None, "auto"):
        match = _SIZE.match(body.size)
        if not match:
            raise bad_request(f"size must be 'WIDTHxHEIGHT' (e.g. '1024x1024'), got "
                              f"{body.size!r}", param="size")
        width, height = int(match.group(1)), int(match.group(2))
    optional = {"num_inference_steps": body.steps, "true_cfg_scale": body.true_cfg_scale,
                "layers": body.layers, "resolution": body.resolution,
                "caption_language": body.caption_language, "cache": body.cache,
                "cache_threshold": body.cache_threshold}
    try:
        return VisualGenParams(
            height=height, width=width, seed=body.seed, negative_prompt=body.negative_prompt,
            guidance_scale=body.guidance_scale, num_images_per_prompt=body.n,
            **{k: v for k, v in optional.items() if v is not None})
    except ValueError as exc:
        raise _from_value_error(exc) from exc


def _input_image(ctx: ImagesContext, body: ImageGenerationRequest):
    if not ctx.gen.takes_image:
        if body.image is not None:
            raise bad_request("this model generates from text only: send no image",
                              param="image")
        return None
    if body.image is None:
        raise bad_request("this model decomposes an input image into layers: send it as "
                          "base64 in `image`", param="image")
    return decode_image(body.image, "image", ctx.config.max_image_pixels)


def _generate_batch_pngs(gen, batch: list[QueuedRequest], stop) -> list:
    """Each request's GeneratedImages, or the exception that failed it (in the worker thread)."""
    from tllm.visual_gen.batching import ImageRequest

    if len(batch) == 1:
        (queued,) = batch
        return [_generate_pngs(gen, queued.prompt, queued.params, queued.image,
                               queued.cancellation)]
    outputs = gen.generate_batch([ImageRequest(q.prompt, q.params) for q in batch],
                                 hooks=[stop])
    return [out if isinstance(out, Exception)
            else GeneratedImages([_png(image) for image in out.images]) for out in outputs]


def _generate_pngs(gen, prompt: str, params, image, cancellation) -> GeneratedImages:
    cancellation.check()        # the client left while the request was queued
    output = gen.generate(prompt, params, image=image, hooks=[cancellation])
    images = [layer for item in output.images
              for layer in (item if isinstance(item, list) else [item])]
    return GeneratedImages([_png(image) for image in images], output.steps_skipped)


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _from_value_error(exc: ValueError) -> APIError:
    """A ValueError of VisualGenParams or of the pipeline, as a 400 naming the request's
    field."""
    message = str(exc).removeprefix("VisualGenParams.")
    match = re.match(r"(\w+)\b", message)
    param = match.group(1) if match else None
    if param in _PARAM_NAMES:
        param = _PARAM_NAMES[param]
    elif param not in ImageGenerationRequest.model_fields:
        param = None
    return bad_request(message, param=param)


async def _internal_error(_: Request, exc: Exception) -> Response:
    return internal_error(exc).response()
