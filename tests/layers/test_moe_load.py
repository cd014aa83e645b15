"""Expert load statistics (moe_load_stats): per MoE layer, the tokens routed to each expert.
Every layer's count adds up to top_k x the tokens the engine ran, on the CPU and on a GPU
under CUDA graphs (whose padding rows must not count); the mask and the balancedness on a
counter alone; a model without MoE layers is refused naming the argument."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tllm import LLM, CudaGraphConfig, KvCacheConfig, SamplingParams
from tllm.layers.moe_load import ExpertLoad

NUM_NEW = 6


def test_padding_rows_do_not_count_and_balancedness():
    layers = [SimpleNamespace(num_experts=4, expert_load_hook=None),
              SimpleNamespace(num_experts=3, expert_load_hook=None)]
    load = ExpertLoad(layers, torch.device("cpu"))
    load.begin_step(2)   # rows 2.. are a graph's padding
    layers[0].expert_load_hook(torch.tensor([[0, 1], [1, 3], [2, 2]]))
    layers[1].expert_load_hook(torch.tensor([[2], [2], [0]]))
    stats = load.snapshot()
    assert stats["moe_expert_load"] == [[1, 2, 0, 1], [0, 0, 2]]
    # layer 0: mean 1 / max 2; layer 1: mean 2/3 / max 2
    assert stats["moe_load_balancedness"] == pytest.approx((0.5 + 1 / 3) / 2)


def _run(path, prompts, **kwargs) -> dict:
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
    with LLM(str(path), dtype="float32", max_batch_size=8, max_num_tokens=32,
             moe_load_stats=True,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=2048,
                                           enable_block_reuse=False), **kwargs) as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return llm.get_stats()


def _check_totals(stats: dict, prompts, num_layers: int, num_experts: int,
                  top_k: int) -> None:
    # every prompt token and every generated token but the last goes through the model
    tokens = sum(len(p) for p in prompts) + len(prompts) * (NUM_NEW - 1)
    load = stats["moe_expert_load"]
    assert len(load) == num_layers
    assert all(len(row) == num_experts for row in load)
    assert [sum(row) for row in load] == [top_k * tokens] * num_layers
    assert 0 < stats["moe_load_balancedness"] <= 1


def _check_mixtral(stats: dict, model, prompts) -> None:
    config = model.config
    _check_totals(stats, prompts, config.num_hidden_layers, config.num_local_experts,
                  config.num_experts_per_tok)


def _model_and_prompts(tmp_path):
    from tests.models.hf_reference import make_prompts
    from tests.models.test_moe_parity import make_tiny_moe
    model = make_tiny_moe("Mixtral", tmp_path)
    return model, make_prompts(model.config.vocab_size)[:5]


def test_counts_add_up_to_the_tokens_run(tmp_path):
    model, prompts = _model_and_prompts(tmp_path)
    _check_mixtral(_run(tmp_path, prompts, device="cpu"), model, prompts)


def test_nemotron_h_experts_count_too(tmp_path):
    """Nemotron 3's MoE blocks (their own squared-ReLU experts, not a FusedMoE)."""
    from tests.models.hf_reference import make_prompts
    from tests.models.test_nemotron_h_parity import TINY, save_tiny
    save_tiny(tmp_path, layers_block_type=["mamba", "moe", "attention", "moe"],
              n_routed_experts=8, moe_intermediate_size=32,
              moe_shared_expert_intermediate_size=48, num_experts_per_tok=2, n_group=2,
              topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)
    prompts = make_prompts(TINY["vocab_size"])[:4]
    _check_totals(_run(tmp_path, prompts, device="cpu"), prompts, 2, 8, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_padding_rows_do_not_count(tmp_path):
    """5 requests decode in graphs of 1, 2, 4, 8 (padded to 8), prompts in piecewise ones."""
    model, prompts = _model_and_prompts(tmp_path)
    stats = _run(tmp_path, prompts, cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 4, 8]))
    _check_mixtral(stats, model, prompts)


def test_a_model_without_experts_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="moe_load_stats"):
        LLM(str(tiny_llama[0]), device="cpu", moe_load_stats=True)
