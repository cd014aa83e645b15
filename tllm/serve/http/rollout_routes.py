"""Routes for RL rollouts, as vLLM and SGLang name them, each off unless the operator turned
it on, and behind the API key like every route (tllm.serve.http.auth):

  --enable-sleep-mode:   POST /sleep?level=1|2, POST /wake_up[?tags=weights&tags=kv_cache],
                         GET /is_sleeping, POST /pause_generation[?abort=true],
                         POST /resume_generation
  --weight-update-dir D: POST /update_weights_from_disk {"model_path": "D/..."}: a folder
                         under D (symlinks and .. resolved first), any other path a 403
  --sleep-mode-policy:   wait | fail, for requests that come while the engine sleeps

No route takes a host to connect to (a trainer's process group is joined through the
Python API only) or loads a path outside the operator's folders."""
from __future__ import annotations

import asyncio
import os
from typing import Callable

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, Response

from tllm.executor.loop_gate import SLEEP_MODE_POLICIES
from tllm.serve.http.errors import APIError, bad_request, error_responses

SLEEP_ROUTES = ("/sleep", "/wake_up", "/is_sleeping", "/pause_generation",
                "/resume_generation")
WEIGHT_ROUTES = ("/update_weights_from_disk",)


class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's body: the HF folder of the new weights (the same architecture)."""

    model_config = ConfigDict(extra="forbid")
    model_path: str = Field(min_length=1)


def add_rollout_args(group) -> None:
    group.add_argument("--enable-sleep-mode", action="store_true",
                       help="serve POST /sleep, /wake_up, /pause_generation, "
                            "/resume_generation and GET /is_sleeping (RL rollouts; behind "
                            "--api-key)")
    group.add_argument("--weight-update-dir", nargs="+", metavar="DIR",
                       help="serve POST /update_weights_from_disk for model_path folders "
                            "under these (symlinks and .. resolved first; others get a 403)")
    group.add_argument("--sleep-mode-policy", choices=SLEEP_MODE_POLICIES, default=None,
                       help="a request that comes while the engine sleeps: waits for "
                            "/wake_up (wait, the default) or fails at once (fail)")


def rollout_llm_kwargs(args) -> dict:
    """LLM(...)'s keyword arguments of the flags above (none when not given: a --config
    file's value stands)."""
    policy = getattr(args, "sleep_mode_policy", None)
    return {} if policy is None else {"sleep_mode_policy": policy}


def rollout_server_options(args) -> dict:
    """ServerConfig's fields of the flags above."""
    return {"enable_sleep_mode": bool(getattr(args, "enable_sleep_mode", False)),
            "weight_update_dirs": tuple(getattr(args, "weight_update_dir", None) or ())}


def rollout_routes(llm, enable_sleep_mode: bool, weight_update_dirs: tuple[str, ...],
                   with_body: list) -> APIRouter:
    """The routes the server's flags turned on (none by default: 404)."""
    routes = APIRouter(responses=error_responses(400, 401))
    if enable_sleep_mode:
        _add_sleep_routes(routes, llm)
    if weight_update_dirs:
        roots = tuple(os.path.realpath(d) for d in weight_update_dirs)
        _add_weight_routes(routes, llm, roots, with_body)
    return routes


def _add_sleep_routes(routes: APIRouter, llm) -> None:
    @routes.post("/sleep", summary="Free the KV cache and the weights' GPU memory")
    async def sleep(level: int = Query(1, ge=1, le=2)) -> Response:
        return await _run(lambda: llm.sleep(level))

    @routes.post("/wake_up", summary="Restore what /sleep freed")
    async def wake_up(tags: list[str] | None = Query(None)) -> Response:
        return await _run(lambda: llm.wake_up(tags))

    @routes.get("/is_sleeping", summary="Whether the engine sleeps")
    async def is_sleeping() -> Response:
        return JSONResponse({"is_sleeping": await asyncio.to_thread(lambda: llm.is_sleeping)})

    @routes.post("/pause_generation", summary="Launch no more steps (abort=true: end every "
                 "unfinished request)")
    async def pause_generation(abort: bool = False) -> Response:
        return await _run(lambda: llm.pause_generation(abort))

    @routes.post("/resume_generation", summary="Launch steps again")
    async def resume_generation() -> Response:
        return await _run(llm.resume_generation)


def _add_weight_routes(routes: APIRouter, llm, roots: tuple[str, ...],
                       with_body: list) -> None:
    @routes.post("/update_weights_from_disk", dependencies=with_body,
                 summary="New weights from a folder under --weight-update-dir",
                 responses=error_responses(403, 415))
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> Response:
        path = os.path.realpath(body.model_path)
        if not any(os.path.commonpath([path, root]) == root for root in roots):
            raise APIError(403, f"model_path {body.model_path!r} is outside the folders this "
                           "server loads weights from (--weight-update-dir)",
                           param="model_path", code="model_path_not_allowed")
        return await _run(lambda: llm.update_weights_from_disk(path), param="model_path")


async def _run(call: Callable[[], object], param: str | None = None) -> Response:
    """The call off the event loop (it waits for the engine); its ValueError a 400."""
    try:
        await asyncio.to_thread(call)
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None
    return JSONResponse({"success": True})
