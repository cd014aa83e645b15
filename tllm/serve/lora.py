"""LoRA adapters served as models: `--lora-modules name=path ...` at start and vLLM's
`POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter` at run time register a name,
listed by /v1/models with the base model as `parent`; a request whose "model" is such a name
runs with that adapter. The registry lives in the server process; each adapter gets an id of
its own, never reused, so the engine never confuses an unloaded adapter with its successor."""
from __future__ import annotations

import itertools
import threading

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import PlainTextResponse, Response

from tllm.lora.request import LoRARequest
from tllm.serve.errors import APIError, bad_request, error_responses


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


class LoraRegistry:
    """The adapters this server serves, by name. `max_rank` None: LoRA is off."""

    def __init__(self, base_model: str, max_rank: int | None) -> None:
        self.base_model = base_model
        self.max_rank = max_rank
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def is_enabled(self) -> bool:
        return self.max_rank is not None

    def load(self, name: str, path: str) -> LoRARequest:
        """Register an adapter folder (ValueError if it is not one we can serve)."""
        from tllm.lora.adapter import check_adapter_folder
        if not self.is_enabled:
            raise ValueError("this server serves no LoRA adapters (start it with "
                             "--enable-lora)")
        if name == self.base_model:
            raise ValueError(f"lora_name {name!r} is the base model's name")
        with self._lock:
            if name in self._adapters:
                raise ValueError(f"the LoRA adapter {name!r} has already been loaded")
            request = LoRARequest(name, next(self._ids), path)
        check_adapter_folder(request, self.max_rank)
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


def lora_routes(registry: LoraRegistry, with_body: list) -> APIRouter:
    """The load/unload routes (under the /v1 router: behind the API key)."""
    routes = APIRouter()

    # No response_class: it would document the JSON error bodies as text/plain too.
    @routes.post("/load_lora_adapter", dependencies=with_body, summary="Load a LoRA adapter",
                 responses={200: {"description": "The adapter is served under lora_name",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}},
                            **error_responses(400, 415)})
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        try:
            registry.load(body.lora_name, body.lora_path)
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
