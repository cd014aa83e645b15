"""Qwen2: the Llama decoder with biases on the q/k/v projections."""
from tllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from tllm.models.registry import register_model


class Qwen2Attention(LlamaAttention):
    qkv_bias = True


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer
