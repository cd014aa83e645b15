"""An engine's part in disaggregated serving (TensorRT-LLM's shape): requests carry
`disaggregated_params`:

    {"request_type": "context_only", "ctx_request_id": ID}
        on a context server: prefill, sample one token, keep the prompt's KV blocks under ID
    {"request_type": "generation_only", "ctx_request_id": ID, "opaque_state": SOURCE_ID}
        on a generation server: fetch the prompt's KV from the configured context server
        (`kv_sources`) that announces SOURCE_ID (its `kv_source_id`), then decode as usual

A request never names an address: one in opaque_state is refused. Requests without
disaggregated_params run whole on either kind of server."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from tllm.disagg.exporter import KVExporter
from tllm.disagg.importer import CONNECT_TIMEOUT_S, KVImporter, KVSource
from tllm.disagg.sources import KVSources
from tllm.executor.py_executor import PyExecutor
from tllm.kv_cache.manager import KVCacheManager
from tllm.config import DisaggConfig
from tllm.request import Request

REQUEST_TYPES = ("context_only", "generation_only")
MAX_ID_CHARS = 256
_SOURCE_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class DisaggregatedParams:
    request_type: str
    ctx_request_id: str
    opaque_state: str | None = None     # generation_only: the context server's source id

    @classmethod
    def parse(cls, data) -> DisaggregatedParams:
        """From the request's JSON; ValueError naming the field."""
        if not isinstance(data, dict):
            raise ValueError("disaggregated_params: expected an object")
        unknown = set(data) - {"request_type", "ctx_request_id", "opaque_state"}
        if unknown:
            raise ValueError(f"disaggregated_params: unknown fields {sorted(unknown)}")
        kind = data.get("request_type")
        if kind not in REQUEST_TYPES:
            raise ValueError(f"disaggregated_params.request_type: one of {REQUEST_TYPES}, "
                             f"got {kind!r}")
        request_id = data.get("ctx_request_id")
        if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_ID_CHARS:
            raise ValueError("disaggregated_params.ctx_request_id: a non-empty string of at "
                             f"most {MAX_ID_CHARS} characters")
        source_id = data.get("opaque_state")
        if kind == "generation_only":
            _check_source_id(source_id)
        return cls(kind, request_id, source_id)


def _check_source_id(source_id) -> None:
    if isinstance(source_id, str) and _SOURCE_ID.fullmatch(source_id):
        return
    if isinstance(source_id, str) and (":" in source_id or "/" in source_id):
        raise ValueError("disaggregated_params.opaque_state: names an address; a generation "
                         "server fetches KV only from its configured context servers "
                         "(--kv-sources), named by their kv_source_id")
    raise ValueError("disaggregated_params.opaque_state: a generation_only request needs "
                     "the context server's kv_source_id (32 hex digits)")


class DisaggAgent:
    """Marks requests for export or import, and submits and aborts them accordingly."""

    def __init__(self, config: DisaggConfig, executor: PyExecutor,
                 kv_cache: KVCacheManager) -> None:
        if kv_cache.num_groups > 1:
            raise ValueError("disaggregation: models with sliding-window KV cache groups are "
                             "not supported yet")
        self.config = config
        self.executor = executor
        self.exporter: KVExporter | None = None
        self.importer: KVImporter | None = None
        self._sources: dict[str, KVSource] = {}     # prepared, not yet submitted
        if config.transport == "cuda_ipc" and kv_cache.slot_caches[0][0].device.type != "cuda":
            raise ValueError("disaggregation.transport: cuda_ipc needs the KV cache on a GPU")
        secret = (None if config.secret is None
                  else config.secret.get_secret_value().encode())
        if config.role == "context":
            self.exporter = KVExporter(kv_cache, executor.call_soon, config.kv_host,
                                       config.kv_port, config.hold_timeout_s, secret)
            executor.add_resource_manager(self.exporter, first=True)
        else:
            sources = KVSources(config.kv_sources, secret, CONNECT_TIMEOUT_S)
            self.importer = KVImporter(kv_cache, executor.submit, executor.abort,
                                       config.transport, config.max_staging_bytes, sources)
            executor.add_resource_manager(self.importer)

    @property
    def kv_endpoint(self) -> str | None:
        """Where generation servers fetch this context server's KV."""
        return self.exporter.endpoint if self.exporter is not None else None

    @property
    def kv_source_id(self) -> str | None:
        """What a generation_only request names this context server by (new each start)."""
        return self.exporter.source_id if self.exporter is not None else None

    def prepare(self, requests: list[Request], data) -> None:
        """Mark a prompt's requests (its samples) by their disaggregated_params."""
        params = DisaggregatedParams.parse(data)
        if params.request_type == "context_only":
            if self.exporter is None:
                raise ValueError("disaggregated_params: a context_only request needs a "
                                 "context server (--role context)")
            if len(requests) != 1:
                raise ValueError("disaggregated_params: a context_only request takes n=1")
            requests[0].kv_export_id = params.ctx_request_id
            requests[0].max_new_tokens = 1
            return
        if self.importer is None:
            raise ValueError("disaggregated_params: a generation_only request needs a "
                             "generation server (--role generation)")
        self._sources[requests[0].request_id] = KVSource(params.opaque_state,
                                                         params.ctx_request_id)

    def submit(self, request: Request) -> None:
        source = self._sources.pop(request.request_id, None)
        if source is None:
            self.executor.submit(request)
        else:
            self.importer.submit(request, source)

    def abort(self, request_id: str) -> None:
        if self.importer is None or not self.importer.abort(request_id):
            self.executor.abort(request_id)

    def stats(self) -> dict[str, float]:
        part = self.exporter or self.importer
        stats = {f"disagg_{k}": v for k, v in asdict(part.stats).items()}
        if self.exporter is not None:
            stats["disagg_requests_held"] = self.exporter.num_held
        return stats

    def close(self) -> None:
        for part in (self.exporter, self.importer):
            if part is not None:
                part.close()
