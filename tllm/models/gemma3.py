"""Gemma 3 (text only, `Gemma3TextConfig`): Gemma 2's decoder with a per-head Gemma RMSNorm on
queries and keys before RoPE, local (sliding-window) and global layers in a 5:1 pattern from
`layer_types`, each kind with its own rope base (`rope_parameters[layer_type]`, through the
base's rope_kind/make_rotary), and no attention soft-cap."""
from __future__ import annotations

from tllm.layers.norm import GemmaRMSNorm
from tllm.models.gemma2 import GemmaDecoderLayer, Gemma2ForCausalLM
from tllm.models.llama import LlamaAttention
from tllm.models.registry import register_model


class Gemma3Attention(LlamaAttention):
    qk_norm = True

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class Gemma3DecoderLayer(GemmaDecoderLayer):
    attention_cls = Gemma3Attention


@register_model("Gemma3ForCausalLM")
class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls = Gemma3DecoderLayer

    def attention_soft_cap(self) -> float | None:
        # HF's Gemma 3 attention never applies its config's attn_logit_softcapping
        return None
