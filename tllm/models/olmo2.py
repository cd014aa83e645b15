"""OLMo 2: the Llama decoder with its norms after the sublayers instead of before them,
h = x + post_attention_norm(attn(x)), out = h + post_feedforward_norm(mlp(h)), and an
RMSNorm over the whole q and k projections (all heads at once, not per head) before RoPE.

Under tensor parallelism that q/k norm spans the ranks' heads: each rank sums its squares
and one all-reduce gives every rank the whole projection's mean."""
from __future__ import annotations

import torch
from torch import nn

from tllm.attention.interface import AttentionBackend, AttentionMetadata, KVCache
from tllm.distributed import comm
from tllm.layers.linear import _copy_checked
from tllm.layers.norm import RMSNorm
from tllm.layers.quant import QuantConfig
from tllm.layers.rotary import RotaryEmbedding
from tllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from tllm.models.registry import register_model


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a projection whose features are split across the tp ranks: this rank
    holds `size` of them from `start` (its slice of the weight), and the mean of squares is
    taken over all `full_size` (an all-reduce of each token's partial sum; features held by
    `replicas` ranks each, as replicated kv heads are, are counted once)."""

    def __init__(self, full_size: int, start: int, size: int, eps: float,
                 replicas: int = 1) -> None:
        super().__init__()
        self.full_size, self.start, self.eps, self.replicas = full_size, start, eps, replicas
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.is_sharded = size != full_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if self.is_sharded:
            squares = comm.tp_all_reduce(h.pow(2).sum(-1, keepdim=True)) / self.replicas
            variance = squares / self.full_size
        else:  # HF's arithmetic, bit for bit
            variance = h.pow(2).mean(-1, keepdim=True)
        return (self.weight * (h * torch.rsqrt(variance + self.eps))).to(x.dtype)

    def load_weight(self, param_name: str, tensor: torch.Tensor) -> None:
        _copy_checked(self.weight, tensor.narrow(0, self.start, self.weight.shape[0]),
                      param_name)


class Olmo2Attention(LlamaAttention):
    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant_config: QuantConfig | None = None, prefix: str = "self_attn") -> None:
        super().__init__(config, rotary, backend, quant_config, prefix)
        qkv, eps, tp_size = self.qkv_proj, config.rms_norm_eps, comm.tp_rank_and_size()[1]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        total_kv_heads = config.num_key_value_heads
        self.q_norm = ShardedRMSNorm(q_size * tp_size, qkv.tp_rank * q_size, q_size, eps)
        self.k_norm = ShardedRMSNorm(total_kv_heads * self.head_dim,
                                     qkv.kv_head_start * self.head_dim, kv_size, eps,
                                     replicas=max(1, tp_size // total_kv_heads))

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.attend(self.q_norm(q), self.k_norm(k), v, kv_cache, metadata)


class Olmo2DecoderLayer(nn.Module):
    """In the (hidden, residual) form of the Llama layers: the layer's input is hidden +
    residual; it returns (the normed MLP output, the residual stream before it)."""

    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant_config: QuantConfig | None = None, prefix: str = "layers.0") -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, rotary, backend, quant_config,
                                        f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config, quant_config, f"{prefix}.mlp")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, kv_cache: KVCache, metadata: AttentionMetadata):
        x = hidden if residual is None else hidden + residual
        x = x + self.post_attention_layernorm(self.self_attn(x, kv_cache, metadata))
        return self.post_feedforward_layernorm(self.mlp(x)), x


@register_model("Olmo2ForCausalLM")
class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_cls = Olmo2DecoderLayer
