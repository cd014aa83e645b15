"""EAGLE-3 draft heads (Li et al., 2025) in the layout of their public checkpoints
(yuhuili/EAGLE3-*, SpecForge, vLLM's `llama_eagle3.py`):

- `fc.weight` [H, 3 * target_H]: fuses the target's low / mid / high hidden states;
- one Llama decoder layer (`midlayer.*`, or `layers.0.*` in converted checkpoints) whose
  attention reads [input_layernorm(embedding) ; hidden_norm(fused)], 2H wide into q/k/v;
- `norm.weight`, `lm_head.weight` [draft_vocab_size, H], and the vocabulary maps `d2t`
  [draft_vocab_size] (target id = draft id + d2t[draft id]) and `t2d` [vocab_size] (bool:
  which target ids the draft vocabulary has);
- the embedding is usually the target's (a checkpoint may carry `embed_tokens.weight`).

The config is a LlamaConfig (`architectures: ["LlamaForCausalLMEagle3"]`) with
`draft_vocab_size`, optional `target_hidden_size`, and the target layers whose hidden states
it fuses: `eagle_config.eagle_aux_hidden_state_layer_ids` (or the same key at top level),
counted as vLLM counts them: id j is the residual stream entering target layer j."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tllm.attention.interface import AttentionBackend, AttentionMetadata, KVCache
from tllm.distributed import comm
from tllm.layers.linear import Linear, QKVLinear
from tllm.layers.norm import RMSNorm
from tllm.layers.quant import QuantConfig, lm_head_layer, linear_method
from tllm.layers.rotary import RotaryEmbedding
from tllm.models.llama import (QKV_SHARDS, LlamaAttention, LlamaDecoderLayer,
                               LlamaForCausalLM)

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def captured_target_layers(config, target_num_layers: int,
                           override: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The target layers whose outputs (residual added) the head fuses, low to high:
    `override` (TensorRT-LLM's `eagle3_layers_to_capture`), else the config's vLLM-style ids
    minus one (id j is the stream entering layer j, i.e. layer j - 1's output), else
    EAGLE-3's default (1, L // 2 - 1, L - 4)."""
    if override:
        layers = tuple(int(i) for i in override)
    else:
        eagle = getattr(config, "eagle_config", None) or {}
        ids = (eagle.get("eagle_aux_hidden_state_layer_ids")
               or getattr(config, "eagle_aux_hidden_state_layer_ids", None))
        layers = (tuple(int(j) - 1 for j in ids) if ids else
                  (1, target_num_layers // 2 - 1, target_num_layers - 4))
    if len(layers) != 3 or not all(0 <= i < target_num_layers for i in layers):
        raise ValueError(f"eagle3_layers_to_capture: expected three target layers in "
                         f"0..{target_num_layers - 1}, got {list(layers)} (a target of "
                         f"{target_num_layers} layers)")
    return layers


class Eagle3Attention(LlamaAttention):
    """Llama attention whose q/k/v projection reads [embedding ; fused hidden] (2H)."""

    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant_config: QuantConfig | None = None, prefix: str = "self_attn") -> None:
        super().__init__(config, rotary, backend, quant_config, prefix)
        self.qkv_proj = QKVLinear(
            2 * config.hidden_size, self.head_dim, config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            bias=getattr(config, "attention_bias", False),
            quant=linear_method(quant_config, f"{prefix}.qkv_proj", QKV_SHARDS))


class Eagle3DecoderLayer(LlamaDecoderLayer):
    """The head's one layer: the fused hidden state (normed by `hidden_norm`) beside the
    normed token embedding goes into attention; the residual is the fused state (normed
    too with `norm_before_residual`)."""

    attention_cls = Eagle3Attention

    def __init__(self, config, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant_config: QuantConfig | None = None, prefix: str = "layers.0") -> None:
        super().__init__(config, rotary, backend, quant_config, prefix)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = self.self_attn(x, kv_cache, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3LlamaHead(LlamaForCausalLM):
    """An EAGLE-3 head: `fuse` the target's three hidden states, then `forward` one draft
    position per token; `compute_logits` gives draft-vocabulary logits, `to_target_ids` maps
    draft ids to the target's."""

    layer_cls = Eagle3DecoderLayer

    def __init__(self, config, backend_cls: type[AttentionBackend], max_position: int,
                 quant_config: QuantConfig | None = None) -> None:
        if config.num_hidden_layers != 1:
            raise ValueError(f"EAGLE-3 head: num_hidden_layers must be 1 (the public heads' "
                             f"layout), got {config.num_hidden_layers}")
        if comm.mapping().pp_size > 1:
            raise ValueError("EAGLE-3 heads do not run under pipeline parallelism")
        config.tie_word_embeddings = False  # the head's lm_head is over its own vocabulary
        # (the parent builds a full-vocabulary head first; it is replaced below)
        super().__init__(config, backend_cls, max_position, quant_config)
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.fc = Linear(3 * target_hidden, config.hidden_size, quant=linear_method(
            quant_config, "fc"))
        self.lm_head = lm_head_layer(quant_config, self.draft_vocab_size, config.hidden_size,
                                     False)
        # target id = draft id + d2t[draft id]; identity until a checkpoint says otherwise
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.has_own_embedding = False

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[T, 3 * target_H] (low ; mid ; high) -> [T, H]."""
        return self.fc(target_hidden.to(self.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, kv_caches: list[KVCache],
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Token i of the flat batch is the *next* token after position i, `hidden[i]` the
        fused (or previous draft step's) hidden state of position i. Returns the normed
        states (for logits) and the pre-norm ones (the next draft step's `hidden`)."""
        out, residual = self.layers[0](self.embed(input_ids), hidden, kv_caches[0],
                                       metadata.for_layer(0))
        normed, prenorm = self.norm(out, residual)
        return normed, prenorm

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The public names: `midlayer.*` is layer 0; `d2t` loads, `t2d` (its inverse) is
        not needed; `embed_tokens.weight` is optional (else the target's is shared)."""
        own: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
            if name == "d2t":
                if tensor.shape != self.d2t.shape:
                    raise ValueError(f"EAGLE-3 head: d2t has shape {tuple(tensor.shape)}, "
                                     f"expected ({self.draft_vocab_size},)")
                self.d2t.copy_(tensor.to(torch.long))
            elif name != "t2d":
                self.has_own_embedding |= name == "embed_tokens.weight"
                own.append((name, tensor))
        return super().load_weights(own)

    def expected_weights(self) -> set[str]:
        return super().expected_weights() - {"embed_tokens.weight#None"}

    def share_embedding(self, embedding: nn.Module) -> None:
        """Use the target's token embedding (public heads ship without one)."""
        if not self.has_own_embedding:
            self.embed_tokens = embedding
