"""MoE models across two ranks on the CPU (gloo, one process per rank): every expert sliced
(tensor parallelism) and whole experts per rank (expert parallelism) both give the greedy
tokens and logprobs of the single-process run on the same weights (fp32)."""
from __future__ import annotations

import pytest

from tests.models.test_moe_parity import make_tiny_moe
from tllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[1] + list(range(5 + i, 30 + 7 * i)) for i in range(6)]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2)


def _generate(path: str, **kwargs):
    with LLM(path, kv_cache_config={"max_tokens": 4096}, max_num_tokens=64, **kwargs) as llm:
        experts = llm._engine.executor.runner.model.layers[0].mlp.experts
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    return outputs, tuple(experts.w13_weight.shape)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(path, single-process outputs) of a Qwen2-MoE (shared expert, a dense layer, 4
    experts) and a Qwen3-MoE (8 experts)."""
    out = {}
    for arch in ("Qwen2Moe", "Qwen3Moe"):
        path = tmp_path_factory.mktemp(arch)
        make_tiny_moe(arch, path)
        out[arch] = (str(path), *_generate(str(path)))
    return out


@pytest.mark.parametrize("arch,expert_parallel", [
    ("Qwen2Moe", False), ("Qwen2Moe", True), ("Qwen3Moe", True)])
def test_two_ranks_equal_one(models, arch, expert_parallel):
    path, expected, (num_experts, rows, hidden) = models[arch]
    got, shape = _generate(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    # rank 0 holds half the experts whole, or every expert's half
    assert shape == ((num_experts // 2, rows, hidden) if expert_parallel
                     else (num_experts, rows // 2, hidden))
    for ours, ref in zip(got, expected):
        assert ours.token_ids == ref.token_ids
        for step_ours, step_ref in zip(ours.logprobs, ref.logprobs):
            assert step_ours.keys() == step_ref.keys()
            assert all(abs(step_ours[t].logprob - step_ref[t].logprob) < 1e-4
                       for t in step_ref)
