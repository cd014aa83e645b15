"""NVIDIA Nemotron-H: a hybrid of Mamba-2 layers, attention layers without positional
embedding, and squared-ReLU MLP layers, one mixer per block (`layers_block_type`), each
block pre-normed with a residual around it.

Attention layers keep paged KV (the KV cache holds only them); Mamba layers keep a
per-request state in the state cache (tllm/kv_cache/state_cache.py), at each request's batch
slot. MoE blocks (Nemotron 3) are in nemotron_h_moe.py. One rank only for now."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tllm.attention.interface import AttentionBackend, AttentionMetadata, KVCache, KVCacheSpec
from tllm.layers.linear import Linear
from tllm.layers.mamba2 import Mamba2Dims, Mamba2Mixer, StateSpec
from tllm.layers.norm import RMSNorm
from tllm.layers.quant import embedding_layer, lm_head_layer
from tllm.models.nemotron_h_moe import NemotronHMoE, load_per_expert
from tllm.models.hybrid_weights import (check_single_rank_unquantized, expected_by_name,
                                         load_by_name)
from tllm.models.registry import register_model

MAMBA, ATTENTION, MLP, MOE = "mamba", "attention", "mlp", "moe"
_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION,
          "full_attention": ATTENTION, "mlp": MLP, "moe": MOE}


def block_kinds(config) -> list[str]:
    """Each layer's mixer: mamba, attention, mlp or moe (the config's names vary by
    version)."""
    names = getattr(config, "layers_block_type", None) or config.layer_types
    unknown = sorted({n for n in names if n not in _KINDS})
    if unknown:
        raise ValueError(f"NemotronH: unknown block kinds {unknown}")
    return [_KINDS[n] for n in names]


def mamba_dims(config) -> Mamba2Dims:
    limit = tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf")))
    return Mamba2Dims(
        hidden_size=config.hidden_size, num_heads=config.mamba_num_heads,
        head_dim=config.mamba_head_dim, num_groups=config.n_groups,
        state_size=config.ssm_state_size, conv_kernel=config.conv_kernel,
        chunk_size=config.chunk_size, eps=config.layer_norm_epsilon,
        conv_bias=config.use_conv_bias, proj_bias=config.use_bias, dt_limit=limit)


class NemotronHAttention(nn.Module):
    """Causal attention over the paged cache, no rotary embedding."""

    def __init__(self, config, backend: AttentionBackend) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        self.num_heads, self.num_kv_heads = (config.num_attention_heads,
                                             config.num_key_value_heads)
        bias = getattr(config, "attention_bias", False)
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.attn = backend

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        q = self.q_proj(hidden).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache, metadata)
        return self.o_proj(out.reshape(hidden.shape[0], -1))


class NemotronHMLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        size = intermediate_size or config.intermediate_size
        self.up_proj = Linear(config.hidden_size, size, bias=bias)
        self.down_proj = Linear(size, config.hidden_size, bias=bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(hidden)).square())


class NemotronHBlock(nn.Module):
    def __init__(self, config, kind: str, backend: AttentionBackend) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(mamba_dims(config))
        elif kind == ATTENTION:
            self.mixer = NemotronHAttention(config, backend)
        elif kind == MOE:
            self.mixer = NemotronHMoE(config, NemotronHMLP)
        else:
            self.mixer = NemotronHMLP(config)


@register_model("NemotronHForCausalLM")
class NemotronHForCausalLM(nn.Module):
    is_first_stage = is_last_stage = True

    def __init__(self, config, backend_cls: type[AttentionBackend], max_position: int,
                 quant_config=None) -> None:
        super().__init__()
        check_single_rank_unquantized("NemotronH", quant_config)
        self.config = config
        self.quant_config = None
        self.activation_dtype = torch.get_default_dtype()
        self.kinds = block_kinds(config)
        self.stage_layers = range(len(self.kinds))
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        backend = backend_cls(config.num_attention_heads, config.num_key_value_heads,
                              head_dim, head_dim ** -0.5)
        self.layers = nn.ModuleList(NemotronHBlock(config, kind, backend)
                                    for kind in self.kinds)
        self.embeddings = embedding_layer(None, config.vocab_size, config.hidden_size)
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.tied = getattr(config, "tie_word_embeddings", False)
        self.lm_head = lm_head_layer(None, config.vocab_size, config.hidden_size, self.tied)
        if self.tied:
            self.lm_head.weight = self.embeddings.weight
        self.state_cache = None   # bound at start-up (bind_state_cache)

    def _indices(self, kind: str) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == kind]

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Only the attention layers keep KV."""
        attention = self._indices(ATTENTION)
        if not attention:
            raise ValueError("NemotronH without attention layers is not supported yet")
        attn = self.layers[attention[0]].mixer
        return KVCacheSpec(len(attention), attn.num_kv_heads, attn.head_dim)

    @property
    def state_spec(self) -> StateSpec:
        dtype = getattr(self.config, "mamba_ssm_cache_dtype", "float32")
        return StateSpec(mamba_dims(self.config), len(self._indices(MAMBA)),
                         getattr(torch, dtype) if isinstance(dtype, str) else dtype)

    def bind_state_cache(self, cache) -> None:
        self.state_cache = cache

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache],
                metadata: AttentionMetadata, intermediate=None, mm_embeds=None) -> torch.Tensor:
        if self.state_cache is None:
            raise RuntimeError("NemotronH: no state cache bound (build_state_cache)")
        hidden = self.embeddings(input_ids)
        batch = self.state_cache.batch(metadata)  # with checkpoints to save
        kv_iter, state_iter = iter(kv_caches), iter(self.state_cache.layers)
        for layer in self.layers:
            h = layer.norm(hidden)
            if layer.kind == MAMBA:
                h = layer.mixer(h, batch, next(state_iter))
            elif layer.kind == ATTENTION:
                h = layer.mixer(h, next(kv_iter), metadata)
            else:
                h = layer.mixer(h)
            hidden = hidden + h
        return self.norm_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names (`backbone.` as NVIDIA's checkpoints write them, or `model.`)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("backbone.").removeprefix("model.")
            stacked = load_per_expert(self, name, tensor)
            if stacked is not None:
                loaded.add(f"{stacked}#None")
                continue
            loaded.add(load_by_name(self, params, name, tensor))
        return loaded

    def expected_weights(self) -> set[str]:
        return expected_by_name(self, self.tied)
