"""GPT-NeoX (Pythia, GPT-NeoX-20B): Llama's attention over a partial rotary (`rotary_pct`),
biases everywhere, LayerNorm (with bias) instead of RMSNorm, a plain GELU MLP, and a
parallel residual (`use_parallel_residual`): attention and MLP both read the layer's input,
x + attn(ln1(x)) + mlp(ln2(x)). The checkpoint's fused `query_key_value` holds each head's
q, k and v together ([heads, 3, head_dim] rows); it is reordered into q/k/v at load."""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

from tllm.attention.interface import AttentionBackend, AttentionMetadata, KVCache
from tllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from tllm.layers.quant import QuantConfig, linear_method
from tllm.layers.rotary import RotaryEmbedding
from tllm.models.llama import QKV_SHARDS, LlamaAttention, LlamaForCausalLM, head_dim_of
from tllm.models.registry import register_model

# checkpoint name pieces -> ours (after the "gpt_neox." prefix is dropped)
_RENAMES = [(r"^embed_in\.", "embed_tokens."), (r"^final_layer_norm\.", "norm."),
            (r"^embed_out\.", "lm_head."), (r"\.attention\.dense\.", ".self_attn.o_proj."),
            (r"\.attention\.", ".self_attn.")]
# buffers old checkpoints saved next to the weights
_IGNORED = re.compile(r"\.attention\.(bias|masked_bias)$|rotary_emb\.inv_freq$")


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm; with `residual`, adds it first and returns the sum as the new
    residual, as RMSNorm does."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return super().forward(x)
        x = x + residual
        return super().forward(x), x


class GeluMLP(nn.Module):
    """dense_4h_to_h(act(dense_h_to_4h(x))), split across the tp ranks by columns then
    rows; `act` is HF's activation of the config's name."""

    def __init__(self, config, quant_config: QuantConfig | None = None,
                 prefix: str = "mlp") -> None:
        super().__init__()
        from transformers.activations import ACT2FN
        if config.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act {config.hidden_act!r} is not an HF activation")
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, config.intermediate_size, bias=True,
            quant=linear_method(quant_config, f"{prefix}.dense_h_to_4h"))
        self.dense_4h_to_h = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=True,
            quant=linear_method(quant_config, f"{prefix}.dense_4h_to_h"))
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    """One block in the (hidden, residual) form of the Llama layers: the block's input is
    hidden + residual, and it returns (its sublayers' output, that input)."""

    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant_config: QuantConfig | None = None, prefix: str = "layers.0") -> None:
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.self_attn = LlamaAttention(config, rotary, backend, quant_config,
                                        f"{prefix}.self_attn")
        self.mlp = GeluMLP(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden, residual, kv_cache: KVCache, metadata: AttentionMetadata):
        x = hidden if residual is None else hidden + residual
        attn = self.self_attn(self.input_layernorm(x), kv_cache, metadata)
        if self.use_parallel_residual:
            return self.mlp(self.post_attention_layernorm(x)) + attn, x
        x = attn + x
        return self.mlp(self.post_attention_layernorm(x)), x


@register_model("GPTNeoXForCausalLM")
class GPTNeoXForCausalLM(LlamaForCausalLM):
    layer_cls = GPTNeoXLayer

    def make_final_norm(self, config) -> nn.Module:
        return LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._renamed(weights))

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        heads, head_dim = self.config.num_attention_heads, head_dim_of(self.config)
        for name, tensor in weights:
            name = name.removeprefix("gpt_neox.")
            if _IGNORED.search(name):
                continue
            for pattern, replacement in _RENAMES:
                name = re.sub(pattern, replacement, name)
            if ".query_key_value." not in name:
                yield name, tensor
                continue
            if tensor.shape[0] != 3 * heads * head_dim:
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, "
                                 f"expected 3 x {heads} heads x {head_dim}")
            per_head = tensor.unflatten(0, (heads, 3, head_dim))  # each head's q, k, v rows
            for i, part in enumerate(QKV_SHARDS):
                yield (name.replace("query_key_value", part),
                       per_head.select(1, i).flatten(0, 1))
