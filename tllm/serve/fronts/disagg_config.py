"""disagg.yml, the file of `tllm serve disaggregated -c`: TensorRT-LLM's disaggregated
config files as they are.

Their shape: `hostname`, `port`, then `context_servers:` and `generation_servers:`, each with
`num_instances` and `urls: [host:port, ...]`. TensorRT-LLM's files also carry the servers'
own options (`model`, `backend`, `free_gpu_memory_fraction`, `max_batch_size`,
`kv_cache_config`, `tensor_parallel_size` ...) at the top level and in each section, for the
launcher that starts the servers from the same file. This front starts no server (each is a
`tllm serve MODEL --role context|generation` of its own), so those are ignored, with one
log line naming them; so are TensorRT-LLM's front options it has no counterpart for. A key
that looks like a misspelling of one of ours, a wrong value of ours, or sections without
urls are errors."""
from __future__ import annotations

import difflib
import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from tllm.serve.fronts.proxy import normalize_url

logger = logging.getLogger(__name__)

# TensorRT-LLM's disaggregated server options that this front has nothing behind.
TRTLLM_FRONT_OPTIONS = frozenset({
    "max_retries", "perf_metrics_max_requests", "return_perf_metrics",
    "perf_metrics_output_dir", "conditional_disagg_config", "otlp_config", "node_id",
    "schedule_style", "allow_request_chat_template", "gen_strip_message_history",
    "gen_tokids_ctxbytes", "num_workers", "disagg_coordinator_url", "router"})
SECTIONS = ("context_servers", "generation_servers")


class ServerGroup(BaseModel):
    """The servers of one role, already running at these urls (`host:port` or a URL)."""

    model_config = ConfigDict(extra="forbid")

    num_instances: int | None = Field(None, ge=1)
    urls: list[str] = Field(min_length=1)

    @field_validator("urls")
    @classmethod
    def _urls_have_hosts(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not _is_host_port(str(url)):
                raise ValueError(f"{url!r} is not host:port")
        return urls

    @model_validator(mode="after")
    def _count_matches(self):
        if self.num_instances is not None and self.num_instances != len(self.urls):
            raise ValueError(f"num_instances is {self.num_instances} but {len(self.urls)} "
                             "urls are given")
        return self


class DisaggFrontConfig(BaseModel):
    """What the front reads of disagg.yml (the workers are started on their own with
    `tllm serve MODEL --role context|generation`)."""

    model_config = ConfigDict(extra="forbid")

    hostname: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    context_servers: ServerGroup
    generation_servers: ServerGroup
    api_key: str | None = None      # required from clients, and sent to the workers

    @classmethod
    def from_yaml(cls, path: str | Path) -> DisaggFrontConfig:
        """The file's config; what the front does not use is logged once and dropped.
        ValueError (naming the file and the key) for a config that is wrong."""
        import yaml
        try:
            data = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"-c {path}: not YAML: {' '.join(str(exc).split())}") from None
        return cls.from_mapping(data, source=f"-c {path}")

    @classmethod
    def from_mapping(cls, data: Any, source: str = "disagg config") -> DisaggFrontConfig:
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping of keys (hostname, port, "
                             "context_servers, generation_servers)")
        if data.get("disagg_cluster") and not any(data.get(s) for s in SECTIONS):
            raise ValueError(f"{source}: disagg_cluster (servers found through a cluster "
                             "store) is not supported; list each role's servers under "
                             "context_servers/generation_servers: urls")
        kept, ignored = _split_keys(data, source)
        if ignored:
            logger.info("%s: ignored, as this front starts no server: %s", source,
                        "; ".join(ignored))
        try:
            return cls(**kept)
        except ValidationError as exc:
            raise ValueError(f"{source}: {_one_line(exc)}") from None


def _split_keys(data: dict, source: str) -> tuple[dict, list[str]]:
    """(what the config model takes, notes on the keys left out)."""
    kept = {k: v for k, v in data.items() if k in DisaggFrontConfig.model_fields}
    notes = _notes(data, DisaggFrontConfig.model_fields, source, "")
    for section in SECTIONS:
        group = data.get(section)
        if isinstance(group, dict):
            kept[section] = {k: v for k, v in group.items() if k in ServerGroup.model_fields}
            notes += _notes(group, ServerGroup.model_fields, source, f"{section}.")
    return kept, notes


def _notes(data: dict, ours, source: str, prefix: str) -> list[str]:
    """What a note says of the keys not among `ours`: TensorRT-LLM's front options, then the
    servers' options. A key close to one of ours is a misspelling: ValueError."""
    others = [str(k) for k in data if k not in ours]
    for key in others:
        close = difflib.get_close_matches(key, list(ours), n=1, cutoff=0.85)
        if close:
            raise ValueError(f"{source}: unknown key {prefix}{key}; did you mean "
                             f"{prefix}{close[0]}?")
    front = [f"{prefix}{k}" for k in others if k in TRTLLM_FRONT_OPTIONS]
    servers = [f"{prefix}{k}" for k in others if k not in TRTLLM_FRONT_OPTIONS]
    notes = []
    if front:
        notes.append(f"TensorRT-LLM front options tllm's front does not have: "
                     f"{', '.join(front)}")
    if servers:
        notes.append(f"the servers' own options (give them to each `tllm serve MODEL "
                     f"--role ...`): {', '.join(servers)}")
    return notes


def _is_host_port(url: str) -> bool:
    try:
        parts = urlsplit(normalize_url(url))
        parts.port  # noqa: B018 - raises ValueError for a port that is no number
    except ValueError:
        return False
    return bool(parts.hostname) and not any(c.isspace() for c in url.strip())


def _one_line(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
