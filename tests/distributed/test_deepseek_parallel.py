"""DeepSeek-V3 (MLA, grouped routing, shared experts) across two ranks on the CPU (gloo): heads
split (q_b_proj, kv_b_proj by heads, o_proj by rows; the latent projection replicated) with
every expert sliced, or whole experts per rank, give the single-process greedy tokens and
logprobs on the same weights (fp32)."""
from __future__ import annotations

import pytest

from tests.models.test_deepseek_parity import make_tiny_deepseek
from tllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[1] + list(range(5 + i, 30 + 7 * i)) for i in range(4)]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)


def _generate(path: str, **kwargs):
    with LLM(path, kv_cache_config={"max_tokens": 4096}, max_num_tokens=64, **kwargs) as llm:
        return [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    make_tiny_deepseek("DeepseekV3", path)
    return str(path), _generate(str(path))


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_equal_one(single, expert_parallel):
    path, expected = single
    got = _generate(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    for ours, ref in zip(got, expected):
        assert ours.token_ids == ref.token_ids
        for step_ours, step_ref in zip(ours.logprobs, ref.logprobs):
            assert step_ours.keys() == step_ref.keys()
            assert all(abs(step_ours[t].logprob - step_ref[t].logprob) < 1e-4
                       for t in step_ref)
