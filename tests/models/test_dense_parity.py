"""Phi-3 (longrope, partial rotary, sliding window), GPT-NeoX (parallel residual, partial
rotary) and OLMo 2 against HF transformers (fp32): greedy tokens equal and top-5 logprobs
within 1e-3 over 16 tokens, 10 prompts in one continuous batch with chunked prefill, prefix
reuse and small KV blocks; and Llama with each static rope scaling end to end.

Phi-3's prompts that stay within original_max_position_embeddings (with their 16 tokens)
match HF as it is. The others cannot, under any rule an engine with a reusable KV cache
can serve: HF recomputes the whole sequence with the long factors once it crosses the
original length (tllm/layers/rotary.py explains). They are checked against HF's model code
rotating by our documented rule, each position as HF rotates the newest token, with tables
taken from HF's own rotary module (tests/layers/test_rotary.py checks them)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY
from tests.layers.test_rotary import (ORIGINAL, PositionTableRotary, hf_newest_token_tables,
                                      phi3_longrope_config)
from tests.models.hf_reference import assert_greedy_matches_hf, generate_batch, make_prompts
from tllm import LLM, KvCacheConfig, SamplingParams

NUM_NEW = 16
TINY_NEOX = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=256, initializer_range=0.1,
                 eos_token_id=2, bos_token_id=1, pad_token_id=0)
STATIC_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}


def hf_config(arch: str, **extra):
    import transformers
    if arch == "Phi3":  # sliding window shorter than the longest prompts
        return phi3_longrope_config(initializer_range=0.1, sliding_window=32, **extra)
    if arch == "GPTNeoX":
        return transformers.GPTNeoXConfig(**{**TINY_NEOX, **extra})
    return getattr(transformers, f"{arch}Config")(**{**TINY, **extra})


def save_tiny(arch: str, path, seed: int = 0, **extra):
    """A random HF model saved to `path`; norms and biases random too (HF starts them at
    1 and 0, which would hide a missing or misplaced one)."""
    import transformers
    config = hf_config(arch, **extra)
    config.architectures = [f"{arch}ForCausalLM"]
    torch.manual_seed(seed)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.copy_(param.mean() + 0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None  # all NUM_NEW tokens (ours: ignore_eos)
    return model


def run_batch(path, prompts: list[list[int]]):
    outputs = generate_batch(path, prompts, NUM_NEW, ignore_eos=True)
    return [output.outputs[0] for output in outputs]


def check_against(hf_model, prompt: list[int], completion) -> None:
    assert len(completion.token_ids) == NUM_NEW
    assert_greedy_matches_hf(hf_model, [prompt], [completion], NUM_NEW)


@pytest.mark.parametrize("arch,extra", [
    ("GPTNeoX", dict(use_parallel_residual=True, rotary_pct=0.25)),
    ("GPTNeoX", dict(use_parallel_residual=False, rotary_pct=0.5, hidden_act="gelu_new")),
    ("Olmo2", {}),
    *[("Llama", dict(rope_scaling=scaling)) for scaling in STATIC_SCALINGS.values()],
], ids=["neox-parallel", "neox-sequential", "olmo2", *STATIC_SCALINGS])
def test_greedy_matches_hf_in_continuous_batch(arch, extra, tmp_path):
    hf_model = save_tiny(arch, tmp_path, **extra)
    prompts = make_prompts(hf_model.config.vocab_size)
    for prompt, completion in zip(prompts, run_batch(tmp_path, prompts)):
        check_against(hf_model, prompt, completion)


def test_phi3_longrope_matches_hf(tmp_path):
    hf_model = save_tiny("Phi3", tmp_path)
    prompts = make_prompts(hf_model.config.vocab_size)
    within = [len(p) + NUM_NEW <= ORIGINAL for p in prompts]
    assert 3 <= sum(within) < len(prompts)
    assert max(map(len, prompts)) > hf_model.config.sliding_window
    completions = run_batch(tmp_path, prompts)
    for prompt, completion, is_within in zip(prompts, completions, within):
        if is_within:  # short factors throughout: HF as it is
            check_against(hf_model, prompt, completion)
    # past the original length: HF's model code with each position rotated as the newest token
    # (the tables from HF's own longrope update, which transformers rewrote in 5.18-5.24; with
    # 5.17's the 40-token prompts depart at position 48, on any device)
    import transformers
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24):
        pytest.skip("the past-the-original-length reference needs transformers >= 5.24's "
                    "longrope update")
    tables = hf_newest_token_tables(hf_model.config, hf_model.config.max_position_embeddings)
    hf_model.model.rotary_emb = PositionTableRotary(*tables)
    for prompt, completion, is_within in zip(prompts, completions, within):
        if not is_within:
            check_against(hf_model, prompt, completion)


def test_phi3_fused_checkpoint_tensors_must_have_their_parts_rows(tmp_path):
    from safetensors.torch import load_file, save_file
    save_tiny("Phi3", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    weights[name] = weights[name][:-16]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="qkv_proj"):
        LLM(str(tmp_path), kv_cache_config=KvCacheConfig(max_tokens=256))


@pytest.mark.slow
@pytest.mark.parametrize("arch,extra", [("Phi3", {}), ("GPTNeoX", {}), ("Olmo2", {}),
                                        ("Olmo2", dict(num_key_value_heads=1))],
                         ids=["phi3", "neox", "olmo2", "olmo2-replicated-kv"])
def test_tensor_parallel_equals_one_rank(arch, extra, tmp_path):
    """TP=2 on gloo: the fused Phi-3 / GPT-NeoX tensors split by heads and columns, OLMo 2's
    q/k norm across both ranks' heads (one kv head: replicated, each rank normalises alone)."""
    save_tiny(arch, tmp_path, **extra)
    prompts = make_prompts(384)[:6]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        with LLM(str(tmp_path), tensor_parallel_size=tp, max_num_tokens=24,
                 kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024)) as llm:
            runs.append([o.outputs[0].token_ids
                         for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]
