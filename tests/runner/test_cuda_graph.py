"""CUDA-graph decode gives the same tokens as eager decode (runs where a GPU exists)."""
from __future__ import annotations

import pytest
import torch

from tllm import LLM, CudaGraphConfig, KvCacheConfig, SamplingParams

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def prompts(vocab: int, count: int) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    return [{"prompt_token_ids": torch.randint(3, vocab, (int(n),), generator=g).tolist()}
            for n in torch.randint(1, 70, (count,), generator=g)]


def run(path, batch, **kwargs):
    params = SamplingParams(max_tokens=24, temperature=0, min_tokens=24)
    with LLM(str(path), dtype="float32", max_batch_size=16, max_num_tokens=64,
             kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=8192),
             **kwargs) as llm:
        used_graphs = llm._engine.executor.runner.cuda_graphs is not None
        outs = llm.generate(batch, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], used_graphs


@cuda
@pytest.mark.parametrize("count", [1, 3, 13])  # 3 and 13 are padded to captured sizes
def test_cuda_graphs_on_and_off_agree(tiny_llama, count):
    path, model = tiny_llama
    batch = prompts(model.config.vocab_size, count)
    eager, used = run(path, batch, cuda_graph_config=None)
    assert not used
    graphed, used = run(path, batch, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4, 8]))
    assert used
    assert graphed == eager  # 13 > 8 also exercises the eager fallback for large batches


def test_cuda_graph_config_is_ignored_on_cpu(tiny_llama):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")
    _, used = run(tiny_llama[0], prompts(384, 2), cuda_graph_config=CudaGraphConfig())
    assert not used


@cuda
@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
def test_hybrid_graphs_agree_with_eager(tmp_path, family):
    """Mamba-2 / gated DeltaNet decode replayed from graphs: the state slots come from a
    device buffer, padding rows (3 and 13 requests against sizes 1, 2, 4, 8) update the
    scratch row only, and a one-token prompt (position 0 inside a decode step) starts from
    a zeroed slot; prompt steps replay piecewise graphs with the mixers' state updates run
    between the pieces. The same tokens as eager steps, which reuse the same slots."""
    import importlib
    module = importlib.import_module(f"tests.models.test_{family}_parity")
    model = module.save_tiny(tmp_path)
    vocab = model.config.vocab_size
    for count in (3, 13):
        batch = prompts(vocab, count) + [{"prompt_token_ids": [7]}]
        eager, used = run(tmp_path, batch, cuda_graph_config=None)
        assert not used
        graphed, used = run(tmp_path, batch,
                            cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4, 8]))
        assert used
        assert graphed == eager
    with LLM(str(tmp_path), dtype="float32", max_batch_size=16, max_num_tokens=64,
             kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=8192)) as llm:
        assert llm._engine.executor.runner.piecewise is not None  # captured, not refused
