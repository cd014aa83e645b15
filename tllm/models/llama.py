"""Llama-family decoder (Llama, Mistral, SmolLM2), the base for Qwen2 and Qwen3.

Works on flattened tokens: [num_tokens] ids in, [num_tokens, hidden] states out; the paged
KV cache and the per-step AttentionMetadata are passed down explicitly."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tllm.attention.interface import AttentionBackend, AttentionMetadata, KVCache
from tllm.layers.activation import SiluAndMul
from tllm.layers.embedding import Embedding, LMHead
from tllm.layers.linear import Linear, MergedLinear
from tllm.layers.norm import RMSNorm
from tllm.layers.rotary import RotaryEmbedding, inverse_frequencies
from tllm.models.registry import register_model


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    qkv_bias = False
    qk_norm = False

    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = self.qkv_bias or getattr(config, "attention_bias", False)
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=bias)
        self.o_proj = Linear(q_size, config.hidden_size,
                             bias=getattr(config, "attention_bias", False))
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = backend

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn.forward_with_rope(q, k, v, kv_cache, metadata, self.rotary)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        inter = config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = Linear(inter, config.hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, rotary, backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, kv_cache: KVCache, metadata: AttentionMetadata):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


@register_model("LlamaForCausalLM", "MistralForCausalLM")
class LlamaForCausalLM(nn.Module):
    layer_cls = LlamaDecoderLayer
    # checkpoint projection name -> (merged parameter, shard index)
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1),
                      "v_proj": ("qkv_proj", 2), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, backend_cls: type[AttentionBackend], max_position: int) -> None:
        super().__init__()
        self.config = config
        head_dim = head_dim_of(config)
        inv_freq, scaling = inverse_frequencies(config, head_dim)
        rotary = RotaryEmbedding(inv_freq.to(torch.get_default_device()), scaling, max_position)
        window = getattr(config, "sliding_window", None)
        if not getattr(config, "use_sliding_window", True):
            window = None
        backend = backend_cls(config.num_attention_heads, config.num_key_value_heads, head_dim,
                              head_dim ** -0.5, window)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(config, rotary, backend)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache],
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, kv_cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters; returns what was loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            target, shard = self._map_name(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(self).__name__}")
            if shard is None:
                _copy_checked(params[target], tensor, name)
            else:
                module_name, param_name = target.rsplit(".", 1)
                self.get_submodule(module_name).load_shard(param_name, shard, tensor)
            loaded.add(f"{target}#{shard}")
        return loaded

    def _map_name(self, name: str) -> tuple[str, int | None]:
        for ckpt_name, (merged, shard) in self.stacked_params.items():
            if f".{ckpt_name}." in name:
                return name.replace(ckpt_name, merged), shard
        return name, None

    def expected_weights(self) -> set[str]:
        """The keys load_weights must have produced for a complete checkpoint."""
        expected = set()
        for module_name, module in self.named_modules():
            for param_name, _ in module.named_parameters(recurse=False):
                full = f"{module_name}.{param_name}"
                shards = len(module.output_sizes) if isinstance(module, MergedLinear) else 0
                expected.update({f"{full}#{i}" for i in range(shards)} or {f"{full}#None"})
        if getattr(self.config, "tie_word_embeddings", False):
            expected.discard("lm_head.weight#None")
        return expected


def _copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model "
                         f"expects {tuple(param.shape)}")
    param.data.copy_(tensor)
