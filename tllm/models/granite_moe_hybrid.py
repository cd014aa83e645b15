"""IBM Granite 4.0-H (GraniteMoeHybridForCausalLM): each layer is a Mamba-2 mixer or
attention (RoPE optional: `position_embedding_type`), then a shared SwiGLU MLP plus, when the
model has experts, a top-k softmax MoE; Granite's multipliers on the embeddings, the residual
branches, the attention scale and the logits.

Mamba layers keep their per-request state in the state cache (tllm/kv_cache/state_cache.py),
as NemotronH's do. The experts are tllm's FusedMoE (the checkpoint's stacked input_linear /
output_linear are its gate_up / down), so the fused MoE kernels and CUDA graphs serve them.
One rank only, unquantized, for now."""
from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tllm.attention.interface import AttentionBackend, AttentionMetadata, KVCache, KVCacheSpec
from tllm.kernels.moe_routing import MoeRouting, route_experts
from tllm.layers.linear import Linear
from tllm.layers.mamba2 import Mamba2Dims, Mamba2Mixer, StateSpec
from tllm.layers.moe import W2, W13, FusedMoE
from tllm.layers.norm import RMSNorm
from tllm.layers.quant import embedding_layer, lm_head_layer
from tllm.layers.rotary import rotary_embedding
from tllm.models.hybrid_weights import (check_single_rank_unquantized, expected_by_name,
                                         load_by_name)
from tllm.models.registry import register_model

# a checkpoint's stacked experts: "<layer>.block_sparse_moe.input_linear.weight" (gate_up)
_STACKED_EXPERTS = re.compile(r"^(.*\.block_sparse_moe)\.(input|output)_linear\.weight$")


def mamba_dims(config) -> Mamba2Dims:
    inner = int(config.mamba_expand * config.hidden_size)
    if inner != config.mamba_n_heads * config.mamba_d_head:
        raise ValueError(f"mamba_expand * hidden_size ({inner}) must equal mamba_n_heads * "
                         f"mamba_d_head ({config.mamba_n_heads * config.mamba_d_head})")
    limit = tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf")))
    return Mamba2Dims(
        hidden_size=config.hidden_size, num_heads=config.mamba_n_heads,
        head_dim=config.mamba_d_head, num_groups=config.mamba_n_groups,
        state_size=config.mamba_d_state, conv_kernel=config.mamba_d_conv,
        chunk_size=config.mamba_chunk_size, eps=config.rms_norm_eps,
        conv_bias=config.mamba_conv_bias, proj_bias=config.mamba_proj_bias, dt_limit=limit)


def is_mamba(kind: str) -> bool:
    return kind in ("mamba", "linear_attention")


class GraniteHybridAttention(nn.Module):
    def __init__(self, config, backend: AttentionBackend, rotary) -> None:
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads, self.num_kv_heads = (config.num_attention_heads,
                                             config.num_key_value_heads)
        bias, hidden = config.attention_bias, config.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.attn, self.rotary = backend, rotary

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        q = self.q_proj(hidden).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
        if self.rotary is None:
            out = self.attn.forward(q, k, v, kv_cache, metadata)
        else:
            out = self.attn.forward_with_rope(q, k, v, kv_cache, metadata, self.rotary)
        return self.o_proj(out.reshape(hidden.shape[0], -1))


class GraniteSharedMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        size = config.shared_intermediate_size
        self.input_linear = Linear(config.hidden_size, 2 * size)
        self.output_linear = Linear(size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(hidden).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


class GraniteMoE(nn.Module):
    """Top-k of the router's logits, softmax over those k; SwiGLU experts, which the
    checkpoint stores stacked (input_linear [E, 2I, D]: gate rows then up rows; output_linear
    [E, D, I]), loaded into a FusedMoE."""

    def __init__(self, config) -> None:
        super().__init__()
        num, hidden, size = (config.num_local_experts, config.hidden_size,
                             config.intermediate_size)
        self.top_k = config.num_experts_per_tok
        self.routing = MoeRouting(self.top_k, topk_first=True)
        self.router = nn.Module()
        self.router.layer = Linear(hidden, num)
        self.experts = FusedMoE(num, hidden, size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = route_experts(self.router.layer(hidden), self.routing)
        return self.experts(hidden, weights, ids)


class GraniteHybridLayer(nn.Module):
    def __init__(self, config, kind: str, backend: AttentionBackend, rotary) -> None:
        super().__init__()
        self.is_mamba = is_mamba(kind)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_mamba:
            self.mamba = Mamba2Mixer(mamba_dims(config))
        else:
            self.self_attn = GraniteHybridAttention(config, backend, rotary)
        self.shared_mlp = GraniteSharedMLP(config)
        if config.num_local_experts > 0:
            self.block_sparse_moe = GraniteMoE(config)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, hidden, batch, state, kv_cache, metadata):
        h = self.input_layernorm(hidden)
        h = (self.mamba(h, batch, state) if self.is_mamba
             else self.self_attn(h, kv_cache, metadata))
        hidden = hidden + h * self.residual_multiplier
        h = self.post_attention_layernorm(hidden)
        mlp = self.shared_mlp(h)
        if hasattr(self, "block_sparse_moe"):
            mlp = mlp + self.block_sparse_moe(h)
        return hidden + mlp * self.residual_multiplier


@register_model("GraniteMoeHybridForCausalLM")
class GraniteMoeHybridForCausalLM(nn.Module):
    is_first_stage = is_last_stage = True

    def __init__(self, config, backend_cls: type[AttentionBackend], max_position: int,
                 quant_config=None) -> None:
        super().__init__()
        check_single_rank_unquantized("GraniteMoeHybrid", quant_config)
        self.config, self.quant_config = config, None
        self.activation_dtype = torch.get_default_dtype()
        self.kinds = list(config.layers_block_type)
        self.stage_layers = range(len(self.kinds))
        head_dim = config.hidden_size // config.num_attention_heads
        backend = backend_cls(config.num_attention_heads, config.num_key_value_heads, head_dim,
                              config.attention_multiplier)
        rotary = (rotary_embedding(config, head_dim, max_position)
                  if config.position_embedding_type == "rope" else None)
        self.layers = nn.ModuleList(GraniteHybridLayer(config, kind, backend, rotary)
                                    for kind in self.kinds)
        self.embed_tokens = embedding_layer(None, config.vocab_size, config.hidden_size)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tied = config.tie_word_embeddings
        self.lm_head = lm_head_layer(None, config.vocab_size, config.hidden_size, self.tied)
        if self.tied:
            self.lm_head.weight = self.embed_tokens.weight
        self.state_cache = None

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        attention = [layer for layer in self.layers if not layer.is_mamba]
        if not attention:
            raise ValueError("GraniteMoeHybrid without attention layers is not supported yet")
        attn = attention[0].self_attn
        return KVCacheSpec(len(attention), attn.num_kv_heads, attn.head_dim)

    @property
    def state_spec(self) -> StateSpec:
        return StateSpec(mamba_dims(self.config), sum(map(is_mamba, self.kinds)))

    def bind_state_cache(self, cache) -> None:
        self.state_cache = cache

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache],
                metadata: AttentionMetadata, intermediate=None, mm_embeds=None) -> torch.Tensor:
        if self.state_cache is None:
            raise RuntimeError("GraniteMoeHybrid: no state cache bound (build_state_cache)")
        hidden = self.embed_tokens(input_ids) * self.config.embedding_multiplier
        batch = self.state_cache.batch(metadata)  # with checkpoints to save
        kv_iter, state_iter = iter(kv_caches), iter(self.state_cache.layers)
        for layer in self.layers:
            if layer.is_mamba:
                hidden = layer(hidden, batch, next(state_iter), None, metadata)
            else:
                hidden = layer(hidden, batch, None, next(kv_iter), metadata)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.config.logits_scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if match := _STACKED_EXPERTS.fullmatch(name):
                experts = self.get_submodule(f"{match[1]}.experts")
                keys = experts.load_stacked(W13 if match[2] == "input" else W2, tensor)
                loaded |= {f"{match[1]}.experts.{key}" for key in keys}
            else:
                loaded.add(load_by_name(self, params, name, tensor))
        return loaded

    def expected_weights(self) -> set[str]:
        """Every parameter's key, the experts' per expert and shard."""
        experts = [(n, m) for n, m in self.named_modules() if isinstance(m, FusedMoE)]
        expected = {key for key in expected_by_name(self, self.tied)
                    if not any(key.startswith(f"{n}.") for n, _ in experts)}
        for name, module in experts:
            expected |= {f"{name}.{key}" for key in module.expected_keys()}
        return expected
