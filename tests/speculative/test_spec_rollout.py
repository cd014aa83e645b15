"""RL rollouts with speculative decoding on (tiny random models, fp32, CPU): sleep frees the
drafter's KV cache too and wake gives the same tokens and the same drafts; after a level-2
sleep and update_weights the engine drafts and verifies exactly as a fresh one on the new
weights (a layer-skip draft and an EAGLE-3 head see the target's new tensors; a separate
draft model keeps its own); DeepSeek's MTP module takes its layer's tensors from the
target's names."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import make_tiny_model
from tests.speculative.test_eagle3 import head_tensors, save_head
from tllm import LLM, DraftTargetDecodingConfig, EagleDecodingConfig, SamplingParams
from tllm.loader.hf import iter_weights, weight_files

PROMPTS = [[1, 5, 9, 14, 3, 7, 22, 40, 11], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ENGINE = dict(kv_cache_config={"max_tokens": 512, "tokens_per_block": 4}, max_num_tokens=64,
              max_batch_size=3, dtype="float32", device="cpu")
KINDS = ("layer_skip", "draft_model", "eagle3")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Two random Llamas of one shape and an EAGLE-3 head for them."""
    out = {}
    for seed, name in ((0, "first"), (1, "second")):
        path = tmp_path_factory.mktemp(f"llama{seed}")
        make_tiny_model("Llama", path, seed=seed)
        out[name] = str(path)
    out["head"] = save_head(tmp_path_factory.mktemp("head"), head_tensors())
    return out


def spec_config(kind: str, models: dict[str, str]):
    if kind == "layer_skip":
        return DraftTargetDecodingConfig(speculative_model="self:layers=1", max_draft_len=3)
    if kind == "draft_model":   # the first model drafts, whatever the target becomes
        return DraftTargetDecodingConfig(speculative_model=models["first"], max_draft_len=3)
    return EagleDecodingConfig(speculative_model=models["head"], max_draft_len=3)


def run(llm) -> tuple[list[list[int]], dict[str, int]]:
    """Greedy tokens and this run's drafted and accepted counts."""
    before = llm.get_stats()
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    after = llm.get_stats()
    counts = {k: after[k] - before[k] for k in ("spec_draft_tokens", "spec_accepted_tokens")}
    return [o.outputs[0].token_ids for o in out], counts


def tensors_of(path: str) -> dict[str, torch.Tensor]:
    return dict(iter_weights(weight_files(Path(path))))


@pytest.mark.parametrize("kind", KINDS)
def test_sleep_wake_frees_the_draft_cache_and_drafts_the_same(models, kind):
    with LLM(models["first"], speculative_config=spec_config(kind, models), **ENGINE) as llm:
        expected = run(llm)
        assert expected[1]["spec_draft_tokens"] > 0
        drafter = llm._engine.executor.speculation.drafter
        draft_kv = drafter.kv_cache.slot_caches[0][0]
        llm.sleep(level=1)
        assert draft_kv.untyped_storage().nbytes() == 0
        llm.wake_up()
        assert draft_kv.untyped_storage().nbytes() > 0
        assert run(llm) == expected


@pytest.mark.parametrize("kind", KINDS)
def test_update_weights_with_speculation_equals_a_fresh_engine(models, kind):
    config = spec_config(kind, models)
    with LLM(models["second"], speculative_config=config, **ENGINE) as llm:
        expected = run(llm)
    with LLM(models["first"], speculative_config=config, **ENGINE) as llm:
        assert run(llm) != expected
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        llm.update_weights(tensors_of(models["second"]))
        llm.wake_up(tags=["kv_cache"])
        assert run(llm) == expected


def test_mtp_module_takes_its_layer_from_the_target_update(tmp_path):
    from tests.models.test_deepseek_parity import make_tiny_deepseek
    from tests.speculative.test_mtp import add_mtp_module
    from tllm import MTPDecodingConfig
    paths = [tmp_path / "a", tmp_path / "b"]
    new = {}
    for seed, path in enumerate(paths):
        new = add_mtp_module(path, make_tiny_deepseek("DeepseekV3", path, seed=seed))
    config = MTPDecodingConfig(max_draft_len=2)
    engine = dict(ENGINE, max_num_tokens=32)
    with LLM(str(paths[1]), speculative_config=config, **engine) as llm:
        expected = run(llm)
    with LLM(str(paths[0]), speculative_config=config, **engine) as llm:
        llm.update_weights(tensors_of(str(paths[1])))
        head = llm._engine.executor.speculation.drafter.head
        assert torch.equal(head.block.self_attn.kv_b_proj.weight,
                           new["model.layers.3.self_attn.kv_b_proj.weight"])
        assert run(llm) == expected
