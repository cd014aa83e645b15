"""Qwen3: the Llama decoder with a per-head RMSNorm on queries and keys before RoPE."""
from tllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from tllm.models.registry import register_model


class Qwen3Attention(LlamaAttention):
    qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
