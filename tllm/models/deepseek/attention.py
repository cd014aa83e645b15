"""Multi-head latent attention (MLA): queries through a low-rank q_a/q_b pair (or one q_proj,
as in DeepSeek-V2-Lite), keys and values from one shared latent of kv_lora_rank dims
(kv_a_proj_with_mqa, then kv_a_layernorm) expanded per head by kv_b_proj, plus a rope part of
qk_rope_head_dim dims that all heads share.

The cache stores per token only the latent and the rotated rope part of the key
(tllm.attention.mla). Attention runs in the absorbed form: W_UK (kv_b_proj's key rows) is
folded into each head's query, attention runs over the latents, and W_UV (its value rows)
takes the output back to v_head_dim per head before o_proj. The products equal the expanded
form's (q_nope . W_UK c = (W_UK^T q_nope) . c).

DeepSeek's rope pairs dims (2i, 2i+1) (`rope_interleave`, always in V2): q and k are
de-interleaved first, which turns it into the rotate-half rope the rotary table applies; the
scores are unchanged since q and k are permuted alike."""
from __future__ import annotations

import math

import torch
from torch import nn

from tllm.attention.interface import AttentionMetadata, KVCache
from tllm.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from tllm.layers.norm import RMSNorm
from tllm.layers.quant import QuantConfig, linear_method
from tllm.layers.rotary import RotaryEmbedding, rope_parameters

# HF's q_a_layernorm and kv_a_layernorm keep RMSNorm's default eps, not rms_norm_eps
_LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(config) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(mscale_all_dim) squared where the rope
    scaling sets one (DeepSeek's scale for every dim, rope or not)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        return scale
    mscale_all_dim, factor = params.get("mscale_all_dim") or 0, params.get("factor", 1.0)
    if mscale_all_dim and factor > 1:   # YaRN's mscale (older transformers lack a helper)
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return float(scale)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] with pairs (2i, 2i+1) -> [..., d] with evens first, then odds."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class DeepseekAttention(nn.Module):
    """One layer's MLA (module docstring); `attn` is the model's MlaAttentionBackend."""

    def __init__(self, config, rotary: RotaryEmbedding, backend,
                 quant_config: QuantConfig | None = None, prefix: str = "self_attn") -> None:
        super().__init__()
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        heads, hidden = config.num_attention_heads, config.hidden_size
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = getattr(config, "attention_bias", False)

        def method(name: str):
            return linear_method(quant_config, f"{prefix}.{name}")

        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias, method("q_a_proj"))
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_head_dim,
                                                 quant=method("q_b_proj"))
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_head_dim,
                                               quant=method("q_proj"))
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim,
                                         bias, method("kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        # read as W_UK / W_UV, never multiplied as a layer: kept unquantized
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim))
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias,
                                        method("o_proj"))
        self.num_heads = self.kv_b_proj.out_features // (self.qk_nope_head_dim
                                                         + self.v_head_dim)  # this rank's
        self.is_interleaved = getattr(config, "rope_interleave", True)
        self.kv_scales = (1.0, 1.0)
        self.rotary = rotary
        self.attn = backend

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        k_pe = k_pe.view(num_tokens, 1, self.qk_rope_head_dim)
        if self.is_interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = self.rotary(metadata.positions, q_pe, k_pe)
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        query = torch.cat((q_latent, q_pe), dim=-1)
        entry = torch.cat((latent[:, None], k_pe), dim=-1)                 # [T, 1, rank+rope]
        # the backend returns [T, H, rank] (or, deferred by a piecewise graph, q's width)
        out = self.attn.forward(query, entry, kv_cache, metadata, self.kv_scales)
        out = out[..., :self.kv_lora_rank]
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))          # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, -1))

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, nope, rank], W_UV [heads, v, rank]): views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, -1, self.kv_lora_rank)
        return w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]
