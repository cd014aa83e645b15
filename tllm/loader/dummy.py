"""`dummy:<preset>`: random weights in a real model's shape, for benchmarks (speed does not
depend on weight values). Weights are generated where the model lives."""
from __future__ import annotations

import torch
from torch import nn

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, tuple[str, dict]] = {
    "llama-3.1-8b": ("llama", dict(
        architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={**_LLAMA3_ROPE, "rope_theta": 500000.0}, dtype="bfloat16")),
    "llama-3.1-70b": ("llama", dict(
        architectures=["LlamaForCausalLM"], hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={**_LLAMA3_ROPE, "rope_theta": 500000.0}, dtype="bfloat16")),
    "qwen2.5-7b": ("qwen2", dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, dtype="bfloat16")),
    "qwen3-8b": ("qwen3", dict(
        architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, dtype="bfloat16")),
    "smollm2-135m": ("llama", dict(
        architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True, dtype="bfloat16")),
    "mixtral-8x7b": ("mixtral", dict(
        architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, dtype="bfloat16")),
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, dtype="bfloat16")),
    # MLA (kv_lora_rank 512 + rope 64 per token), 64 routed experts of which 6 a token, 2
    # shared, layer 0 dense; V2-Lite has no q_lora_rank and YaRN rope
    "deepseek-v2-lite": ("deepseek_v2", dict(
        architectures=["DeepseekV2ForCausalLM"], hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy",
        norm_topk_prob=False, routed_scaling_factor=1.0, vocab_size=102400,
        max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
        dtype="bfloat16")),
    # Moonlight-16B-A3B's shape (DeepSeek-V3 architecture: sigmoid routing with the
    # correction bias, one group)
    "moonlight-16b-a3b": ("deepseek_v3", dict(
        architectures=["DeepseekV3ForCausalLM"], hidden_size=2048, intermediate_size=11264,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, n_group=1, topk_group=1,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, norm_topk_prob=True, routed_scaling_factor=2.446,
        vocab_size=163840, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        dtype="bfloat16")),
    # GPT-OSS-20B as OpenAI ships it: 32 experts (4 a token) in MXFP4, attention sinks,
    # sliding-window (128) layers alternating with full ones, YaRN
    "gpt-oss-20b": ("gpt_oss", dict(
        architectures=["GptOssForCausalLM"], hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        swiglu_limit=7.0, attention_bias=True, vocab_size=201088,
        max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]},
        eos_token_id=200002, pad_token_id=199999, tie_word_embeddings=False,
        dtype="bfloat16")),
    # Llama-4-Scout-17B-16E's width with 24 of its 48 layers (~55B parameters, ~111 GB in
    # bf16: the whole model does not fit one H200): every layer MoE (16 experts, top-1, a
    # shared expert), chunked RoPE layers (8192) with a NoPE layer every 4th
    "llama-4-scout-24l": ("llama4_text", dict(
        architectures=["Llama4ForCausalLM"], hidden_size=5120, intermediate_size=8192,
        intermediate_size_mlp=16384, num_hidden_layers=24, num_attention_heads=40,
        num_key_value_heads=8, head_dim=128, num_local_experts=16, num_experts_per_tok=1,
        interleave_moe_layer_step=1, attention_chunk_size=8192, use_qk_norm=True,
        attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1, vocab_size=202048,
        max_position_embeddings=262144, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192}, dtype="bfloat16")),
    "gemma-2-9b": ("gemma2", dict(
        architectures=["Gemma2ForCausalLM"], hidden_size=3584, intermediate_size=14336,
        num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        vocab_size=256000, max_position_embeddings=8192, rms_norm_eps=1e-6,
        sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True, dtype="bfloat16")),
    # Nemotron-H-8B's shape: 24 Mamba-2, 4 attention and 24 squared-ReLU MLP layers
    "nemotron-h-8b": ("nemotron_h", dict(
        architectures=["NemotronHForCausalLM"], hidden_size=4096, intermediate_size=21504,
        hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, mamba_num_heads=128,
        mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4, chunk_size=128,
        mlp_hidden_act="relu2", vocab_size=131072, max_position_embeddings=8192,
        layer_norm_epsilon=1e-5, tie_word_embeddings=False, dtype="bfloat16")),
    # Qwen3-Next-80B-A3B's width with 24 of its 48 layers (~40B parameters, ~80 GB in bf16):
    # three gated DeltaNet layers to one gated attention layer, 512 experts (top-10) + shared
    "qwen3-next-80b-a3b-24l": ("qwen3_next", dict(
        architectures=["Qwen3NextForCausalLM"], hidden_size=2048, intermediate_size=5120,
        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        norm_topk_prob=True, vocab_size=151936, max_position_embeddings=262144,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                            "partial_rotary_factor": 0.25},
        tie_word_embeddings=False, dtype="bfloat16")),
}
# Half of those again (12 layers: ~20B / ~28B parameters, ~40 / ~55 GB): one H100 holds them
PRESETS["qwen3-next-80b-a3b-12l"] = ("qwen3_next", {**PRESETS["qwen3-next-80b-a3b-24l"][1],
                                                    "num_hidden_layers": 12})
PRESETS["llama-4-scout-12l"] = ("llama4_text", {**PRESETS["llama-4-scout-24l"][1],
                                                "num_hidden_layers": 12})


def dummy_config(preset: str):
    from transformers import AutoConfig
    if preset not in PRESETS:
        raise ValueError(f"model: unknown dummy preset {preset!r}; choose one of "
                         f"{', '.join(sorted(PRESETS))}")
    model_type, kwargs = PRESETS[preset]
    return AutoConfig.for_model(model_type, **kwargs)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if not param.is_floating_point() or param.element_size() == 1:
            continue  # packed or fp8 quantized weights: their method fills them, below
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)
    for module in model.modules():  # a quantization method with packed weights of its own
        method = getattr(module, "quant", None)
        if hasattr(method, "init_dummy"):
            method.init_dummy(module, generator)
