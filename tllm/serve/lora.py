"""LoRA adapters served as models: `--lora-modules name=path ...` at start and vLLM's
`POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter` at run time register a name,
listed by /v1/models with the base model as `parent` (never a server path); a request whose
"model" is such a name runs with that adapter. The registry lives in the server process; each
adapter gets an id of its own, never reused, so the engine never confuses an unloaded adapter
with its successor.

A client may load adapters only from the `--lora-modules` folders and the folders named by
`--lora-allowed-paths` (and below them), compared after resolving `..` and symlinks; an
adapter is read and checked against the engine's layers (files, rank, target modules,
shapes) when it is registered, so a bad one is refused there, not at every request."""
from __future__ import annotations

import asyncio
import itertools
import os
import threading

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import PlainTextResponse, Response

from tllm.lora.request import LoRARequest
from tllm.lora.targets import LoraTargets
from tllm.serve.http.errors import APIError, bad_request, error_responses


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body: the name clients will send as "model", and the PEFT adapter folder."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # accepted as vLLM does; the name decides


def parse_lora_modules(values: list[str] | None) -> tuple[tuple[str, str], ...]:
    """`name=path` pairs of --lora-modules (ValueError naming the bad one)."""
    modules = []
    for value in values or ():
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: expected name=path, got {value!r}")
        modules.append((name, path))
    return tuple(modules)


class LoraPathNotAllowed(ValueError):
    """A lora_path outside the folders this server loads adapters from."""


class LoraRegistry:
    """The adapters this server serves, by name. `targets` None: LoRA is off."""

    def __init__(self, base_model: str, targets: LoraTargets | None,
                 allowed_paths: tuple[str, ...] = ()) -> None:
        self.base_model = base_model
        self.targets = targets
        self.allowed_roots = tuple(os.path.realpath(p) for p in allowed_paths)
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def is_enabled(self) -> bool:
        return self.targets is not None

    def load(self, name: str, path: str) -> LoRARequest:
        """A client's adapter: a folder under an allowed one (LoraPathNotAllowed), checked
        as `add` does."""
        self._check_enabled()
        resolved = os.path.realpath(path)
        if not any(_is_within(resolved, root) for root in self.allowed_roots):
            raise LoraPathNotAllowed(
                f"lora_path {path!r} is outside the folders this server loads adapters from "
                "(--lora-modules and --lora-allowed-paths)")
        try:  # the engine reads the resolved folder: a link cannot be pointed elsewhere later
            return self.add(name, resolved)
        except ValueError as exc:  # say the client's path, not where its links lead
            raise ValueError(str(exc).replace(resolved, path)) from None

    def add(self, name: str, path: str) -> LoRARequest:
        """Register an adapter folder (ValueError if the engine could not serve it)."""
        self._check_enabled()
        if name == self.base_model:
            raise ValueError(f"lora_name {name!r} is the base model's name")
        with self._lock:
            if name in self._adapters:
                raise ValueError(f"the LoRA adapter {name!r} has already been loaded")
            request = LoRARequest(name, next(self._ids), path)
        from tllm.lora.adapter import check_adapter  # torch and peft: only once one is loaded
        check_adapter(request, self.targets)
        with self._lock:
            if name in self._adapters:
                raise ValueError(f"the LoRA adapter {name!r} has already been loaded")
            self._adapters[name] = request
        return request

    def unload(self, name: str) -> bool:
        with self._lock:
            return self._adapters.pop(name, None) is not None

    def get(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._adapters.get(name)

    def all(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._adapters.values())

    def _check_enabled(self) -> None:
        if not self.is_enabled:
            raise ValueError("this server serves no LoRA adapters (start it with "
                             "--enable-lora)")


def _is_within(path: str, root: str) -> bool:
    """Both resolved: `path` is `root` or below it."""
    return os.path.commonpath([path, root]) == root


def lora_routes(registry: LoraRegistry, with_body: list) -> APIRouter:
    """The load/unload routes (under the /v1 router: behind the API key)."""
    routes = APIRouter()

    # No response_class: it would document the JSON error bodies as text/plain too.
    @routes.post("/load_lora_adapter", dependencies=with_body, summary="Load a LoRA adapter",
                 responses={200: {"description": "The adapter is served under lora_name",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}},
                            **error_responses(400, 403, 415)})
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        try:  # reading the adapter's files takes a while: off the event loop
            await asyncio.to_thread(registry.load, body.lora_name, body.lora_path)
        except LoraPathNotAllowed as exc:
            raise APIError(403, str(exc), param="lora_path",
                           code="lora_path_not_allowed") from None
        except ValueError as exc:
            raise bad_request(str(exc), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    @routes.post("/unload_lora_adapter", dependencies=with_body,
                 summary="Unload a LoRA adapter",
                 responses={200: {"description": "The adapter is no longer served",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}},
                            **error_responses(400, 404, 415)})
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        if not registry.unload(body.lora_name):
            raise APIError(404, f"the LoRA adapter {body.lora_name!r} cannot be found",
                           param="lora_name", code="model_not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")

    return routes
