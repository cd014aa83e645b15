"""Qwen3-Next (gated DeltaNet + gated attention + MoE with a shared expert) against HF
transformers (fp32): greedy tokens equal and top-5 logprobs within 1e-3 over a continuous
batch with chunked prefill (24-token steps, prompts up to 60 tokens); 3 requests at a time so
state slots are reused (the DeltaNet decay is slowed so that a state left in a slot would
change the tokens); requests finishing at different steps; prompts sharing prefixes (block
reuse is on by default: a hit restores the state saved at its block, or is not taken);
preemption with recompute under a small KV cache; a dense-MLP layer (`mlp_only_layers`);
both checkpoint layouts of the experts; the dummy preset's state beside its KV."""
from __future__ import annotations

import pytest
import torch

from tests.models.hf_reference import TOP, assert_greedy_matches_hf, make_prompts
from tllm import LLM, CapacitySchedulerPolicy, KvCacheConfig, SamplingParams, SchedulerConfig

transformers = pytest.importorskip("transformers")

NUM_NEW = 10
TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention",
                         "full_attention"],
            max_position_embeddings=256, eos_token_id=2, bos_token_id=1, pad_token_id=0)


def save_tiny(path, seed: int = 0, **extra):
    config = transformers.Qwen3NextConfig(**{**TINY, **extra})
    config.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():     # HF starts these at 0 or 1, which would hide a misplaced one
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".dt_bias"):
                param.copy_(param.mean() + 0.2 * torch.randn_like(param))
            if ".experts" in name or name.endswith(("gate.weight", "shared_expert_gate.weight")):
                param.mul_(10)   # else the experts barely show
            if name.endswith(".A_log"):  # slow decay: a state left in a slot would show
                param.copy_((0.01 + 0.05 * torch.rand_like(param)).log())
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None
    return model


def _generate(path, prompts, max_tokens, **engine):
    with LLM(str(path), **engine) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=TOP)
             for n in max_tokens], use_tqdm=False)
        stats = llm.get_kv_cache_stats()
        checkpoints = llm._engine.executor.runner.model.state_cache.checkpoints
        assert checkpoints is None or checkpoints.num_rows_held == 0
    return outputs, stats, checkpoints


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                     reason="needs a CUDA GPU"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_greedy_matches_hf_in_continuous_batch(tmp_path, device):
    """On a GPU (untested so far): Triton attention, the fused MoE kernels, the Triton
    DeltaNet kernels (conv and delta rule), in fp32."""
    hf_model = save_tiny(tmp_path)
    prompts = make_prompts(TINY["vocab_size"])   # the last two share a prefix with the third
    max_tokens = [NUM_NEW - i % 3 for i in range(len(prompts))]   # finish at different steps
    outputs, stats, checkpoints = _generate(
        tmp_path, prompts, max_tokens, max_num_tokens=24, max_batch_size=3, device=device,
        dtype="float32", kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=2048))
    assert stats["blocks_reused"] > 0 and checkpoints.num_restored > 0   # hits were taken
    # a GPU's matmuls may round apart: tokens only there, as elsewhere
    assert_greedy_matches_hf(hf_model, prompts, outputs, max_tokens, logprobs=device == "cpu")


def test_preemption_with_recompute_and_dense_layer(tmp_path):
    hf_model = save_tiny(tmp_path, seed=1, mlp_only_layers=[2])
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist()
               for n in (20, 9, 31, 14, 25, 6)]
    policy = SchedulerConfig(capacity_scheduler_policy=CapacitySchedulerPolicy.MAX_UTILIZATION)
    outputs, stats, _ = _generate(
        tmp_path, prompts, [NUM_NEW] * len(prompts), max_num_tokens=64, max_batch_size=4,
        scheduler_config=policy, kv_cache_config=KvCacheConfig(tokens_per_block=4,
                                                               max_tokens=48))
    assert stats["preemptions"] > 0
    assert_greedy_matches_hf(hf_model, prompts, outputs, NUM_NEW)


def test_stacked_and_per_expert_checkpoints_load_alike(tmp_path):
    """transformers 5's in-memory layout (stacked experts) and its saved one (per expert)
    fill every parameter, the same way; the MTP head's tensors are skipped."""
    from safetensors.torch import load_file

    from tllm.attention.torch_ref import TorchAttentionBackend
    from tllm.models.qwen3_next import Qwen3NextForCausalLM
    hf_model = save_tiny(tmp_path, seed=2)
    models = []
    for weights in (hf_model.state_dict(), load_file(tmp_path / "model.safetensors")):
        model = Qwen3NextForCausalLM(hf_model.config, TorchAttentionBackend, 256)
        mtp = {"mtp.fc.weight": torch.zeros(2, 2)}
        assert model.load_weights({**weights, **mtp}.items()) == model.expected_weights()
        models.append(model)
    stacked, per_expert = (dict(m.named_parameters()) for m in models)
    assert any(".experts." in name for name in stacked)
    for name, param in stacked.items():
        assert torch.equal(param, per_expert[name]), name


def test_dummy_preset_state_beside_kv():
    """Qwen3-Next-80B-A3B's width (24 layers): 18 DeltaNet layers' state per request (fixed)
    against 6 attention layers' KV at 8k tokens."""
    from tllm.layers.gated_deltanet import DeltaNetStateSpec
    from tllm.loader.dummy import dummy_config
    from tllm.models.qwen3_next import LINEAR, deltanet_dims, layer_kinds
    config = dummy_config("qwen3-next-80b-a3b-24l")
    kinds = layer_kinds(config)
    assert (kinds.count(LINEAR), len(kinds)) == (18, 24)
    state = DeltaNetStateSpec(deltanet_dims(config), 18).bytes_per_request(torch.bfloat16)
    kv_8k = 8192 * 6 * 2 * config.num_key_value_heads * config.head_dim * 2
    assert round(state / 2**20, 2) == 36.84 and kv_8k == 96 * 2**20
