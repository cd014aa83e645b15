"""Qwen3-Next (Qwen3NextForCausalLM): a hybrid of gated DeltaNet layers (`linear_attention`,
layers/gated_deltanet.py) and gated attention (`full_attention`: per-head q/k norms, partial
rotary, an output gate from q_proj), as `layer_types` orders them; each followed by a MoE
feed-forward (routed experts plus a shared expert behind a sigmoid gate, Qwen2-MoE's block)
or, for `mlp_only_layers`, a dense SwiGLU MLP. Its RMSNorms scale by (1 + weight).

Attention layers keep paged KV; DeltaNet layers keep a per-request state (conv + recurrent
state) in the state cache (tllm/kv_cache/state_cache.py), at each request's batch slot, as
the Mamba hybrids do. One rank, unquantized, torch DeltaNet for now."""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from tllm.attention.interface import AttentionBackend, AttentionMetadata, KVCache, KVCacheSpec
from tllm.layers.gated_deltanet import DeltaNetStateSpec, GatedDeltaNet, GatedDeltaNetDims
from tllm.layers.linear import Linear, MergedLinear
from tllm.layers.moe import FusedMoE
from tllm.layers.norm import GemmaRMSNorm
from tllm.layers.quant import embedding_layer, lm_head_layer
from tllm.layers.rotary import rotary_embedding
from tllm.models.hybrid_weights import check_single_rank_unquantized, load_by_name
from tllm.models.llama import LlamaMLP
from tllm.models.mixtral import EXPERT_PROJECTIONS, STACKED_PROJECTIONS
from tllm.models.qwen2_moe import Qwen2MoeSparseBlock, is_sparse_layer
from tllm.models.registry import register_model

LINEAR, FULL = "linear_attention", "full_attention"
_EXPERT = re.compile(
    r"(layers\.\d+\.mlp\.experts)\.(?:(\d+)\.(\w+)\.weight|(gate_up_proj|down_proj))")
_GATE_UP = re.compile(r"(layers\.\d+\.mlp(?:\.shared_expert)?)\.(gate_proj|up_proj)\.weight")


def layer_kinds(config) -> list[str]:
    kinds = list(config.layer_types)
    unknown = sorted(set(kinds) - {LINEAR, FULL})
    if unknown:
        raise ValueError(f"Qwen3-Next: unknown layer_types {unknown}")
    return kinds


def deltanet_dims(config) -> GatedDeltaNetDims:
    return GatedDeltaNetDims(
        hidden_size=config.hidden_size, num_k_heads=config.linear_num_key_heads,
        num_v_heads=config.linear_num_value_heads, head_k_dim=config.linear_key_head_dim,
        head_v_dim=config.linear_value_head_dim, conv_kernel=config.linear_conv_kernel_dim,
        eps=config.rms_norm_eps)


class Qwen3NextAttention(nn.Module):
    """q_proj gives each head its query and an output gate side by side; q and k are
    RMS-normed per head before the (partial) rotary embedding; the attention output is
    scaled by sigmoid(gate) before o_proj."""

    def __init__(self, config, backend: AttentionBackend, rotary) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = (config.num_attention_heads,
                                             config.num_key_value_heads)
        bias, hidden, eps = config.attention_bias, config.hidden_size, config.rms_norm_eps
        self.q_proj = Linear(hidden, 2 * self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps)
        self.attn, self.rotary = backend, rotary

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        q, gate = self.q_proj(hidden).view(-1, self.num_heads, 2 * self.head_dim).chunk(2, -1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(hidden).view(-1, self.num_kv_heads, self.head_dim))
        v = self.v_proj(hidden).view(-1, self.num_kv_heads, self.head_dim)
        out = self.attn.forward_with_rope(q, k, v, kv_cache, metadata, self.rotary)
        out = out.reshape(hidden.shape[0], -1) * torch.sigmoid(gate.reshape(hidden.shape[0], -1))
        return self.o_proj(out)


class Qwen3NextLayer(nn.Module):
    def __init__(self, config, index: int, backend: AttentionBackend, rotary) -> None:
        super().__init__()
        self.is_linear = config.layer_types[index] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(deltanet_dims(config))
        else:
            self.self_attn = Qwen3NextAttention(config, backend, rotary)
        prefix = f"layers.{index}.mlp"
        self.mlp = (Qwen2MoeSparseBlock(config, None, prefix) if is_sparse_layer(config, index)
                    else LlamaMLP(config, None, prefix))
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, batch, state, kv_cache, metadata) -> torch.Tensor:
        h = self.input_layernorm(hidden)
        h = (self.linear_attn(h, batch, state) if self.is_linear
             else self.self_attn(h, kv_cache, metadata))
        h, hidden = self.post_attention_layernorm(h, hidden)
        return hidden + self.mlp(h)


@register_model("Qwen3NextForCausalLM")
class Qwen3NextForCausalLM(nn.Module):
    is_first_stage = is_last_stage = True

    def __init__(self, config, backend_cls: type[AttentionBackend], max_position: int,
                 quant_config=None) -> None:
        super().__init__()
        check_single_rank_unquantized("Qwen3-Next", quant_config)
        self.config, self.quant_config = config, None
        self.activation_dtype = torch.get_default_dtype()
        self.kinds = layer_kinds(config)
        self.stage_layers = range(len(self.kinds))
        backend = backend_cls(config.num_attention_heads, config.num_key_value_heads,
                              config.head_dim, config.head_dim ** -0.5)
        rotary = rotary_embedding(config, config.head_dim, max_position)
        self.layers = nn.ModuleList(Qwen3NextLayer(config, i, backend, rotary)
                                    for i in range(len(self.kinds)))
        self.embed_tokens = embedding_layer(None, config.vocab_size, config.hidden_size)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tied = config.tie_word_embeddings
        self.lm_head = lm_head_layer(None, config.vocab_size, config.hidden_size, self.tied)
        if self.tied:
            self.lm_head.weight = self.embed_tokens.weight
        self.state_cache = None   # bound at start-up (bind_state_cache)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Only the full-attention layers keep KV."""
        attention = [layer.self_attn for layer in self.layers if not layer.is_linear]
        if not attention:
            raise ValueError("Qwen3-Next without full_attention layers is not supported yet")
        return KVCacheSpec(len(attention), attention[0].num_kv_heads, attention[0].head_dim)

    @property
    def state_spec(self) -> DeltaNetStateSpec:
        return DeltaNetStateSpec(deltanet_dims(self.config), self.kinds.count(LINEAR))

    def bind_state_cache(self, cache) -> None:
        self.state_cache = cache

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache],
                metadata: AttentionMetadata, intermediate=None, mm_embeds=None) -> torch.Tensor:
        if self.state_cache is None:
            raise RuntimeError("Qwen3-Next: no state cache bound (build_state_cache)")
        hidden = self.embed_tokens(input_ids)
        batch = self.state_cache.batch(metadata)  # with checkpoints to save
        kv_iter, state_iter = iter(kv_caches), iter(self.state_cache.layers)
        for layer in self.layers:
            if layer.is_linear:
                hidden = layer(hidden, batch, next(state_iter), None, metadata)
            else:
                hidden = layer(hidden, batch, None, next(kv_iter), metadata)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names; the multi-token-prediction head (`mtp.*`) is not used."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("mtp."):
                continue
            keys = self._load_merged(name, tensor)
            loaded |= keys if keys is not None else {load_by_name(self, params, name, tensor)}
        return loaded

    def _load_merged(self, name: str, tensor: torch.Tensor) -> set[str] | None:
        """Experts into the stacked FusedMoE, gate/up into an MLP's merged gate_up_proj;
        None for any other tensor."""
        if match := _EXPERT.fullmatch(name):
            experts = self.get_submodule(match[1])
            if match[4]:
                keys = experts.load_stacked(STACKED_PROJECTIONS[match[4]], tensor)
            elif match[3] in EXPERT_PROJECTIONS:
                param, shard = EXPERT_PROJECTIONS[match[3]]
                keys = experts.load_expert(param, int(match[2]), shard, tensor)
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in Qwen3-Next")
            return {f"{match[1]}.{key}" for key in keys}
        if match := _GATE_UP.fullmatch(name):
            shard = 0 if match[2] == "gate_proj" else 1
            self.get_submodule(f"{match[1]}.gate_up_proj").load_shard("weight", shard, tensor)
            return {f"{match[1]}.gate_up_proj.weight#{shard}"}
        return None

    def expected_weights(self) -> set[str]:
        """Every parameter once; merged gate/up per shard, experts per expert and shard."""
        expected: set[str] = set()
        experts = [(n, m) for n, m in self.named_modules() if isinstance(m, FusedMoE)]
        for module_name, module in experts:
            expected |= {f"{module_name}.{key}" for key in module.expected_keys()}
        for module_name, module in self.named_modules():
            if any(module_name.startswith(name) for name, _ in experts):
                continue
            for param_name, _ in module.named_parameters(recurse=False):
                full = f"{module_name}.{param_name}" if module_name else param_name
                shards = len(module.output_sizes) if isinstance(module, MergedLinear) else 0
                expected |= {f"{full}#{i}" for i in range(shards)} or {f"{full}#None"}
        if self.tied:
            expected.discard("lm_head.weight#None")
        return expected
