"""Gemma 2: the Llama decoder with Gemma's RMSNorm (x * (1 + w), in float32), a norm after
each sublayer as well as before it, a GELU-tanh gated MLP, embeddings scaled by
sqrt(hidden_size), soft-capped attention scores and final logits, and sliding-window layers
alternating with global ones (`layer_types`). Also the base of Gemma 3."""
from __future__ import annotations

import torch

from tllm.attention.interface import (AttentionBackend, AttentionMetadata, AttentionOptions,
                                      KVCache)
from tllm.kernels.paged import soft_cap
from tllm.layers.activation import GeluAndMul
from tllm.layers.norm import GemmaRMSNorm
from tllm.layers.quant import QuantConfig
from tllm.layers.rotary import RotaryEmbedding
from tllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from tllm.models.registry import register_model

# HF activation name -> torch's gelu approximation
_GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


def gelu_approximation(config) -> str:
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if name not in _GELU_APPROXIMATIONS:
        raise ValueError(f"hidden_activation {name!r} is not supported for Gemma; tllm runs "
                         f"{', '.join(_GELU_APPROXIMATIONS)}")
    return _GELU_APPROXIMATIONS[name]


def positive_cap(config, name: str) -> float | None:
    """A soft-cap from the config: None (off) or a positive number."""
    cap = getattr(config, name, None)
    if cap is not None and not cap > 0:
        raise ValueError(f"{name} must be positive or None, got {cap}")
    return cap


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Pre- and post-norms around both sublayers: h = x + post_norm(attn(input_norm(x))),
    out = h + post_ff_norm(mlp(pre_ff_norm(h)))."""

    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant_config: QuantConfig | None = None, prefix: str = "layers.0") -> None:
        super().__init__(config, rotary, backend, quant_config, prefix)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def make_mlp(self, config, quant_config: QuantConfig | None, prefix: str) -> LlamaMLP:
        mlp = LlamaMLP(config, quant_config, prefix)
        mlp.act = GeluAndMul(gelu_approximation(config))
        return mlp

    def forward(self, hidden, residual, kv_cache: KVCache, metadata: AttentionMetadata):
        """(hidden, residual) as in Llama: the layer's input is their sum. Each sublayer's
        output is normed before it joins the residual."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, kv_cache, metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


@register_model("Gemma2ForCausalLM")
class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_cls = GemmaDecoderLayer

    def __init__(self, config, backend_cls: type[AttentionBackend], max_position: int,
                 quant_config: QuantConfig | None = None) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"{type(self).__name__}: use_bidirectional_attention (an "
                             "embedding model) cannot be served: tllm attends causally")
        super().__init__(config, backend_cls, max_position, quant_config)
        self.final_logit_soft_cap = positive_cap(config, "final_logit_softcapping")
        if self.is_last_stage:
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # HF multiplies by sqrt(hidden) rounded to the weights' dtype (55.5 for 3072 in bf16)
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5,
                                              dtype=self.activation_dtype))

    def attention_soft_cap(self) -> float | None:
        return positive_cap(self.config, "attn_logit_softcapping")

    def attention_options(self, layer: int) -> AttentionOptions:
        """The base's window per `layer_types`; the scale from query_pre_attn_scalar."""
        return AttentionOptions(sliding_window=super().attention_options(layer).sliding_window,
                                scale=self.config.query_pre_attn_scalar ** -0.5,
                                logits_soft_cap=self.attention_soft_cap())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(super().compute_logits(hidden), self.final_logit_soft_cap)
