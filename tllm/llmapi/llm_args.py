"""User-written configuration of the LLM API (pydantic: bad values raise ValueError naming
the field)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class KvCacheConfig(BaseModel):
    """Size and layout of the paged KV cache.

    Capacity is `max_tokens` when given; otherwise `free_memory_fraction` of the memory left
    after the weights (on a CPU: of the available RAM, at most 4 GiB of it).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens_per_block: int = Field(32, ge=1, le=1024)
    max_tokens: int | None = Field(None, ge=1)
    free_memory_fraction: float = Field(0.9, gt=0.0, le=1.0)
    enable_block_reuse: bool = True


class LlmArgs(BaseModel):
    """Arguments of LLM(...), in TensorRT-LLM's style."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    model: str
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: str | None = None
    max_batch_size: int = Field(256, ge=1)
    max_num_tokens: int = Field(8192, ge=1)
    max_seq_len: int | None = Field(None, ge=2)
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    enable_chunked_prefill: bool = True
    attn_backend: Literal["auto", "torch", "triton"] = "auto"
    seed: int = 0
