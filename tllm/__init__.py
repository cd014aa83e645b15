"""tllm: LLM inference with an executor loop over a paged KV cache.

Names are imported on first use, so `import tllm.request` (or the visual-generation API)
does not pull in the whole engine."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tllm.llmapi.llm import LLM
    from tllm.config import (CapacitySchedulerPolicy, CudaGraphConfig,
                                      DraftTargetDecodingConfig, EagleDecodingConfig,
                                      KvCacheConfig, LlmArgs, MTPDecodingConfig,
                                      NGramDecodingConfig, SchedulerConfig,
                                      TorchCompileConfig)
    from tllm.lora.request import LoRARequest
    from tllm.outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestOutput
    from tllm.pooling_params import PoolingParams
    from tllm.sampling_params import GuidedDecodingParams, SamplingParams
    from tllm.visual_gen import VisualGen, VisualGenParams

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "tllm.llmapi.llm",
    "LlmArgs": "tllm.config", "KvCacheConfig": "tllm.config",
    "SchedulerConfig": "tllm.config", "CapacitySchedulerPolicy": "tllm.config",
    "CudaGraphConfig": "tllm.config", "TorchCompileConfig": "tllm.config",
    "NGramDecodingConfig": "tllm.config",
    "DraftTargetDecodingConfig": "tllm.config",
    "EagleDecodingConfig": "tllm.config",
    "MTPDecodingConfig": "tllm.config",
    "SamplingParams": "tllm.sampling_params", "GuidedDecodingParams": "tllm.sampling_params",
    "RequestOutput": "tllm.outputs", "CompletionOutput": "tllm.outputs", "Logprob": "tllm.outputs",
    "VisualGen": "tllm.visual_gen", "VisualGenParams": "tllm.visual_gen",
    "LoRARequest": "tllm.lora.request",
    "PoolingParams": "tllm.pooling_params", "PoolingRequestOutput": "tllm.outputs",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
