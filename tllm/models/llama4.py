"""Llama 4 (text, `Llama4ForCausalLM`): the Llama decoder with
- RoPE layers that attend in chunks (`attention_chunk_size`: a token sees only the keys of its
  own chunk of positions) and L2-normalise q and k (`use_qk_norm`), and NoPE layers
  (`no_rope_layers[i] == 0`) that attend globally without rotary embeddings, their queries
  scaled by a temperature that grows with the position (`attn_temperature_tuning`);
- MoE feed-forwards on `moe_layers` (dense MLPs of `intermediate_size_mlp` elsewhere): each
  token's top-k experts by router logit, the expert's *input* scaled by the sigmoid of its
  logit, plus a shared expert on every token.
HF's rotary pairs adjacent features (x[2i], x[2i + 1]); the q and k rows of each head are
permuted at load into the halves layout our rotary kernels use, which leaves every q.k dot
product and the L2 norm unchanged."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tllm.attention.interface import (AttentionBackend, AttentionMetadata, AttentionOptions,
                                      KVCache)
from tllm.kernels.moe_routing import MoeRouting, route_experts
from tllm.layers.linear import Linear
from tllm.layers.moe import FusedMoE
from tllm.layers.quant import QuantConfig
from tllm.layers.rotary import RotaryEmbedding
from tllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, head_dim_of
from tllm.models.mixtral import MixtralForCausalLM
from tllm.models.registry import register_model


def uses_rope(config, layer: int) -> bool:
    """Whether layer `layer` applies rotary embeddings (HF's `no_rope_layers`: 1 = RoPE)."""
    return bool(config.no_rope_layers[layer])


def is_chunked(config, layer: int) -> bool:
    """Whether layer `layer` attends within its chunk (the RoPE layers, with a chunk size)."""
    if config.attention_chunk_size is None:   # older transformers still name such layers
        return False
    types = getattr(config, "layer_types", None)
    if types is not None:
        return types[layer] == "chunked_attention"
    return uses_rope(config, layer)


def temperature_scales(positions: torch.Tensor, floor_scale: float,
                       attn_scale: float) -> torch.Tensor:
    """The NoPE layers' per-token query scale, 1 + attn_scale * log1p(floor((p + 1) /
    floor_scale)), in float32 as HF computes it."""
    floors = torch.floor((positions.float() + 1.0) / floor_scale)
    return torch.log1p(floors) * attn_scale + 1.0


class Llama4Attention(LlamaAttention):
    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant_config: QuantConfig | None = None, prefix: str = "self_attn") -> None:
        super().__init__(config, rotary, backend, quant_config, prefix)
        layer = LlamaDecoderLayer.layer_index(prefix.removesuffix(".self_attn"))
        self.use_rope = uses_rope(config, layer)
        self.use_l2_norm = bool(config.use_qk_norm) and self.use_rope
        self.eps = config.rms_norm_eps
        self.temperature = ((config.floor_scale, config.attn_scale)
                            if config.attn_temperature_tuning and not self.use_rope else None)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
               metadata: AttentionMetadata) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.use_l2_norm:  # HF norms after the rotation; a rotation keeps the norm
            q, k = self._l2_norm(q), self._l2_norm(k)
        if self.use_rope:
            out = self.attn.forward_with_rope(q, k, v, kv_cache, metadata, self.rotary,
                                              self.kv_scales)
        else:
            if self.temperature is not None:
                scales = temperature_scales(metadata.positions, *self.temperature)
                q = (q * scales[:, None, None]).to(q.dtype)
            out = self.attn.forward(q, k, v, kv_cache, metadata, self.kv_scales)
        return self.o_proj(out.flatten(1))

    def _l2_norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Llama4MoE(nn.Module):
    """Routed experts (sigmoid of the top-k router logits, applied to the expert's input)
    plus a shared expert."""

    def __init__(self, config, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        num_experts, self.top_k = config.num_local_experts, config.num_experts_per_tok
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and the "
                             f"model's {num_experts} experts")
        self.routing = MoeRouting(self.top_k, scoring="sigmoid", topk_first=True)
        self.router = Linear(config.hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, config.hidden_size, config.intermediate_size,
                                quant_config, f"{prefix}.experts")
        self.shared_expert = LlamaMLP(config, quant_config, f"{prefix}.shared_expert")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores, ids = route_experts(self.router(hidden), self.routing)
        scores = scores.to(hidden.dtype)
        # one row per (token, chosen expert), scaled before the expert, weighted 1 after
        routed_in = (hidden[:, None, :] * scores[..., None]).flatten(0, 1)
        ones = torch.ones(routed_in.shape[0], 1, dtype=torch.float32, device=hidden.device)
        routed = self.experts(routed_in, ones, ids.reshape(-1, 1))
        return self.shared_expert(hidden) + routed.view(*ids.shape, -1).sum(dim=1)


class Llama4DecoderLayer(LlamaDecoderLayer):
    attention_cls = Llama4Attention

    def make_mlp(self, config, quant_config: QuantConfig | None, prefix: str) -> nn.Module:
        if self.layer_index(prefix.removesuffix(".mlp")) in config.moe_layers:
            return Llama4MoE(config, quant_config, prefix)
        return LlamaMLP(config, quant_config, prefix,
                        intermediate_size=config.intermediate_size_mlp)


@register_model("Llama4ForCausalLM")
class Llama4ForCausalLM(MixtralForCausalLM):
    layer_cls = Llama4DecoderLayer

    def attention_options(self, layer: int) -> AttentionOptions:
        """Chunked layers: the chunk, also as the window the KV cache keeps (a chunk never
        reaches further back than its size)."""
        if not is_chunked(self.config, layer):
            return AttentionOptions()
        chunk = self.config.attention_chunk_size
        return AttentionOptions(sliding_window=chunk, attention_chunk_size=chunk)

    def make_attention_backend(self, backend_cls: type[AttentionBackend], attn: nn.Module,
                               options: AttentionOptions):
        return backend_cls(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                           attn.head_dim ** -0.5, options.sliding_window,
                           attention_chunk_size=options.attention_chunk_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF's names and layouts -> Mixtral's loader: `feed_forward` is our `mlp`, the
        stacked experts [E, H, 2I] and [E, I, H] transposed, q and k rows into halves."""
        def converted():
            for name, tensor in weights:
                name = name.replace(".feed_forward.", ".mlp.")
                if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                    tensor = tensor.transpose(1, 2)
                elif ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
                    tensor = self._rope_halves(tensor)
                yield name, tensor
        return super().load_weights(converted())

    def _rope_halves(self, tensor: torch.Tensor) -> torch.Tensor:
        """A q or k projection's rows (weight, bias or per-row scale), each head's features
        from interleaved pairs to halves (even features, then odd); others as they are."""
        head_dim = head_dim_of(self.config)
        if tensor.dim() == 0 or tensor.shape[0] % head_dim or tensor.shape[0] == 1:
            return tensor
        order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
        heads = tensor.reshape(-1, head_dim, *tensor.shape[1:])
        return heads.index_select(1, order.to(tensor.device)).reshape(tensor.shape)


_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")


@register_model("Llama4ForConditionalGeneration")
class Llama4TextOfMultimodal(Llama4ForCausalLM):
    """Llama 4 as released (Scout, Maverick: Llama4ForConditionalGeneration checkpoints):
    their text model served alone. The vision tower's and projector's tensors are skipped;
    the model takes no images (a prompt with one is refused as for any text model)."""

    def __init__(self, config, backend_cls: type[AttentionBackend], max_position: int,
                 quant_config=None) -> None:
        super().__init__(config.get_text_config(), backend_cls, max_position, quant_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """transformers 5's names (model.language_model.*, lm_head.*) or the released
        checkpoints' (language_model.model.*, language_model.lm_head.*)."""
        def text_weights():
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if not name.startswith(_VISION_PREFIXES):
                    yield name.removeprefix("language_model.").removeprefix("model."), tensor
        return super().load_weights(text_weights())
