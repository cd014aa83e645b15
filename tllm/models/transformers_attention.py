"""Our paged attention plugged into transformers' own modeling code.

transformers looks an attention function up by `config._attn_implementation` in its
`AttentionInterface` registry and forwards the base model's `**kwargs` to every call. We
register one function under ATTENTION_IMPL; the step's KV caches, metadata and per-layer
backends travel to it in the `tllm_step` keyword (no module-level state). No attention-mask
function is registered under that name on purpose: transformers' masking utilities then skip
building masks altogether (the hook meant for engines such as vLLM and TGI), and our backends
mask by the metadata's sequence lengths instead.

Before a model is served, `AttentionProbe` runs it once on two tokens and records what each
layer hands the attention function: head shapes, scale, window, soft-cap, causality. That is
how we learn the KV cache's shape, and how a model we cannot serve is refused at load."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from tllm.attention.interface import (AttentionBackend, AttentionMetadata, AttentionOptions,
                                      KVCache)

ATTENTION_IMPL = "tllm_paged"
STEP_KWARG = "tllm_step"
# the layer types whose keys and values our paged cache holds
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# what models pass to attention that our backends honour or that does not change the result;
# anything else set (GPT-OSS's sinks `s_aux`, sparse-attention `indices`, T5's `position_bias`)
# would be dropped silently, so the model is refused
UNDERSTOOD_KWARGS = frozenset({"sliding_window", "softcap", "is_causal", "position_ids",
                               "use_cache", "cache_position", "output_attentions"})


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q [1, heads, T, D], k/v [1, kv_heads, T,
    D] in, [1, T, heads, D] out (and no attention weights)."""
    step = kwargs.pop(STEP_KWARG, None)
    if step is None:
        raise UnservableModel(
            f"{type(module).__name__} was called without the step's KV cache: this model's "
            "layers do not pass transformers' attention kwargs down to attention")
    return step.attend(module, query, key, value, attention_mask, scaling, kwargs), None


AttentionInterface.register(ATTENTION_IMPL, paged_attention_forward)


class UnservableModel(ValueError):
    """A transformers model the fallback cannot serve correctly, and why."""


@dataclass
class PagedStep:
    """One step's paged attention, reached by every layer through the HF kwargs."""

    kv_caches: list[KVCache]
    metadata: AttentionMetadata
    backends: list[AttentionBackend]  # per layer index

    def attend(self, module, query, key, value, attention_mask, scaling, kwargs):
        layer = module.layer_idx
        # [1, heads, T, D] -> [T, heads, D]: HF's views are token-major already
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
        # each layer with its KV cache group's slots and block tables
        out = self.backends[layer].forward(q, k, v, self.kv_caches[layer],
                                           self.metadata.for_layer(layer))
        return out.unsqueeze(0)


@dataclass
class LayerAttention:
    """What one layer's attention call looked like in the probe."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    options: AttentionOptions


@dataclass
class AttentionProbe:
    """Stands in for PagedStep in a dry run: records each layer's call, attends nothing."""

    config: object
    num_tokens: int
    layers: dict[int, LayerAttention] = field(default_factory=dict)

    def attend(self, module, query, key, value, attention_mask, scaling, kwargs):
        name = type(module).__name__
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            raise UnservableModel(f"{name} has no layer_idx, so its KV cache cannot be found")
        if layer in self.layers:
            raise UnservableModel(f"layer {layer} ({name}) attends more than once per step")
        ignored = sorted(k for k, v in kwargs.items()
                         if k not in UNDERSTOOD_KWARGS and v is not None and v is not False)
        if ignored:
            raise UnservableModel(f"{name} passes {', '.join(ignored)} to attention, which our "
                                  "attention backends do not implement")
        if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
            raise UnservableModel(f"{name} attends bidirectionally (is_causal=False); the "
                                  "fallback serves causal decoders only")
        if attention_mask is not None:
            raise UnservableModel(f"{name} receives an attention mask the model builds "
                                  "itself; our paged attention cannot apply it")
        self.layers[layer] = self._shapes(name, query, key, value, LayerOptions(
            self.config, module, kwargs, scaling).resolve(layer))
        return torch.zeros_like(query.transpose(1, 2))

    def _shapes(self, name, query, key, value, options) -> LayerAttention:
        if query.dim() != 4 or query.shape[0] != 1 or query.shape[2] != self.num_tokens:
            raise UnservableModel(f"{name} hands attention a query of shape "
                                  f"{tuple(query.shape)}; expected [1, heads, tokens, dim]")
        heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[3]
        if key.shape != value.shape or key.shape[3] != head_dim or heads % kv_heads:
            raise UnservableModel(
                f"{name}: queries {tuple(query.shape)}, keys {tuple(key.shape)}, values "
                f"{tuple(value.shape)}; the paged cache needs one head size for all three and "
                "a whole number of query heads per kv head")
        return LayerAttention(heads, kv_heads, head_dim, options)


@dataclass
class LayerOptions:
    """A layer's window, scale and soft-cap, read the way its HF mask and kernels read them."""

    config: object
    module: torch.nn.Module
    kwargs: dict
    scaling: float | None

    def resolve(self, layer: int) -> AttentionOptions:
        softcap = self.kwargs.get("softcap")
        return AttentionOptions(sliding_window=self._window(layer),
                                scale=None if self.scaling is None else float(self.scaling),
                                logits_soft_cap=None if softcap is None else float(softcap))

    def _window(self, layer: int) -> int | None:
        # Most models pass `sliding_window` to attention; some keep it on the module; a few
        # (PhiMoE, Doge) only build a sliding mask from the config, which HF's masking
        # utilities do for `layer_types` "sliding_attention" or any config.sliding_window.
        if "sliding_window" in self.kwargs:
            window = self.kwargs["sliding_window"]
        elif hasattr(self.module, "sliding_window"):
            window = self.module.sliding_window
        else:
            window = getattr(self.config, "sliding_window", None)
            types = getattr(self.config, "layer_types", None)
            if types is not None and types[layer] != "sliding_attention":
                window = None
        return None if window is None else int(window)
