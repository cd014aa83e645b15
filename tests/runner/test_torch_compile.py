"""cuda_graph_config.torch_compile: decode graphs captured from the torch.compile'd model
(our kernels as custom ops) give the eager graphs' greedy tokens (GPU only)."""
from __future__ import annotations

import pytest
import torch

from tllm import LLM, KvCacheConfig, SamplingParams
from tllm.config import CudaGraphConfig

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def greedy_tokens(path, prompts, compiled: bool, dtype: str) -> tuple[list, bool]:
    graphs = CudaGraphConfig(batch_sizes=[1, 2, 4], torch_compile=compiled)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(str(path), dtype=dtype, device="cuda", max_batch_size=4,
             kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=4096),
             cuda_graph_config=graphs) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        has_graphs = llm._engine.executor.runner.cuda_graphs is not None
    return [o.outputs[0].token_ids for o in outputs], has_graphs


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_graphs_give_the_eager_tokens(tiny_llama, dtype):
    path, model = tiny_llama
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 17, 9)]
    eager, _ = greedy_tokens(path, prompts, compiled=False, dtype=dtype)
    compiled, has_graphs = greedy_tokens(path, prompts, compiled=True, dtype=dtype)
    assert has_graphs, "capturing from the compiled model failed: graphs are off"
    assert compiled == eager


def test_torch_compile_is_off_by_default():
    assert CudaGraphConfig().torch_compile is False
    assert CudaGraphConfig(torch_compile=True).torch_compile
