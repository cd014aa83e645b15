"""tllm: LLM inference with an executor loop over a paged KV cache."""
from tllm.llmapi.llm import LLM
from tllm.llmapi.llm_args import (CapacitySchedulerPolicy, CudaGraphConfig, KvCacheConfig,
                                  LlmArgs, SchedulerConfig)
from tllm.outputs import CompletionOutput, Logprob, RequestOutput
from tllm.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "LlmArgs", "KvCacheConfig", "SchedulerConfig", "CapacitySchedulerPolicy",
           "CudaGraphConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "VisualGen", "VisualGenParams", "__version__"]


def __getattr__(name: str):
    # Visual generation is imported on first use: `import tllm` stays free of diffusers.
    if name in ("VisualGen", "VisualGenParams"):
        import tllm.visual_gen
        return getattr(tllm.visual_gen, name)
    raise AttributeError(f"module 'tllm' has no attribute {name!r}")
