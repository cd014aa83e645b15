"""DeepseekV2ForCausalLM and DeepseekV3ForCausalLM: the Llama-family decoder (pre-norm
residual blocks, RMSNorm, SiLU MLPs, LM head) with MLA attention over a latent cache and
DeepSeek's mixture of experts. V2 and V3 differ only in routing (tllm.models.deepseek.moe).

Checkpoint names are HF's: `self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj},
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj`, `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias` (V3), `mlp.experts...` (per expert or stacked, as Mixtral
loads them), `mlp.shared_experts.*`. A V3 checkpoint's multi-token-prediction layers
(`layers.<num_hidden_layers>.*`) are skipped here; MTPDecodingConfig loads the first
as a drafter (mtp.py)."""
from __future__ import annotations

from tllm.attention.interface import AttentionBackend, AttentionOptions, KVCacheSpec
from tllm.attention.mla import MlaAttentionBackend
from tllm.layers.quant import QuantConfig
from tllm.layers.rotary import RotaryEmbedding, rotary_embedding
from tllm.models.deepseek.attention import DeepseekAttention, mla_softmax_scale
from tllm.models.deepseek.moe import DeepseekMoE, is_moe_layer, v2_routing, v3_routing
from tllm.models.llama import LlamaDecoderLayer, LlamaMLP
from tllm.models.mixtral import MixtralForCausalLM
from tllm.models.registry import register_model


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    attention_cls = DeepseekAttention
    has_correction_bias = False

    @staticmethod
    def routing(config):
        return v2_routing(config)

    def make_mlp(self, config, quant_config: QuantConfig | None, prefix: str):
        if is_moe_layer(config, self.layer_index(prefix.removesuffix(".mlp"))):
            return DeepseekMoE(config, self.routing(config), self.has_correction_bias,
                               quant_config, prefix)
        return LlamaMLP(config, quant_config, prefix)

    def forward(self, hidden, residual, kv_cache, metadata):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekV3DecoderLayer(DeepseekV2DecoderLayer):
    has_correction_bias = True

    @staticmethod
    def routing(config):
        return v3_routing(config)


@register_model("DeepseekV2ForCausalLM")
class DeepseekV2ForCausalLM(MixtralForCausalLM):
    layer_cls = DeepseekV2DecoderLayer
    # MLA's projections load one to one; only the MLPs' gate and up are merged
    stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def make_rotary(self, kind: str | None, max_position: int) -> RotaryEmbedding:
        return rotary_embedding(self.config, self.config.qk_rope_head_dim, max_position, kind)

    def attention_options(self, layer: int) -> AttentionOptions:
        return AttentionOptions(scale=mla_softmax_scale(self.config))

    def make_attention_backend(self, backend_cls: type[AttentionBackend], attn,
                               options: AttentionOptions) -> MlaAttentionBackend:
        """MLA's own backend, whichever backend the engine chose (the torch path runs on a
        GPU too; CUDA graphs are turned off for it)."""
        return MlaAttentionBackend(attn.num_heads, attn.kv_lora_rank, attn.qk_rope_head_dim,
                                   options.scale)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """One latent "head" of kv_lora_rank + qk_rope_head_dim per token and layer, keys
        only: e.g. 576 values for DeepSeek-V3, against 2 x 128 heads x 192 / 128 expanded."""
        width = self.config.kv_lora_rank + self.config.qk_rope_head_dim
        return KVCacheSpec(self.num_local_layers, 1, width, (), self.stage_layers.start,
                           keys_only=True)


@register_model("DeepseekV3ForCausalLM")
class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    layer_cls = DeepseekV3DecoderLayer
