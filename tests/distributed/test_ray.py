"""The Ray orchestrator on the CPU: TP=2 with rank 1 in a Ray actor gives the single-process
greedy tokens, shutdown leaves no actor behind, and a killed actor fails `generate`."""
from __future__ import annotations

import time

import pytest
import torch

from tllm import LLM, SamplingParams

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

PROMPTS = [[1] + list(range(5 + i, 30 + 7 * i)) for i in range(6)]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0)
KV = {"max_tokens": 4096}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=387, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.1, eos_token_id=2, bos_token_id=1, pad_token_id=0,
        architectures=["LlamaForCausalLM"])
    torch.manual_seed(2)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module (the launcher then joins it instead of starting one)."""
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def _tokens(llm: LLM, params: SamplingParams = PARAMS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _assert_all_dead(actors) -> None:
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.gpu_id.remote(), timeout=30)
    states = [pg["state"] for pg in ray.util.placement_group_table().values()]
    assert set(states) <= {"REMOVED"}  # the ranks' slots were given back too


def test_ray_tp2_greedy_equals_single_process(tiny_llama, local_ray):
    with LLM(tiny_llama, kv_cache_config=KV, max_num_tokens=64) as llm:
        expected = _tokens(llm)
    llm = LLM(tiny_llama, kv_cache_config=KV, max_num_tokens=64, tensor_parallel_size=2,
              orchestrator="ray")
    actors = list(llm._engine.workers.actors)
    assert len(actors) == 1
    try:
        assert _tokens(llm) == expected
    finally:
        llm.shutdown()
    _assert_all_dead(actors)


def test_killed_actor_fails_generate(tiny_llama, local_ray):
    llm = LLM(tiny_llama, kv_cache_config=KV, tensor_parallel_size=2, orchestrator="ray")
    actors = list(llm._engine.workers.actors)
    ray.kill(actors[0])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1"):
        _tokens(llm, SamplingParams(max_tokens=200, ignore_eos=True))
    assert time.monotonic() - start < 60
    llm.shutdown()
    _assert_all_dead(actors)
