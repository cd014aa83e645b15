"""The attention-backend interface: the metadata every backend reads, and a registry."""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner. Tokens of all requests are flattened into one
    dimension; request i owns tokens query_start_loc[i]:query_start_loc[i+1], which sit at
    the last query_lens[i] positions of its seq_lens[i]-token context."""

    positions: torch.Tensor        # [num_tokens] int64, position of each token in its sequence
    slot_mapping: torch.Tensor     # [num_tokens] int64, block_id * tokens_per_block + offset
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor         # [num_seqs] int32, context length including this step
    block_tables: torch.Tensor     # [num_seqs, max_blocks_per_seq] int32, padded
    max_query_len: int
    max_seq_len: int
    tokens_per_block: int
    # Host-side copies, so a backend that loops over sequences need not sync the device.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Several KV cache groups (full and sliding-window layers keep separate block tables):
    # the group of each model layer, and the views of groups 1.. (this object is group 0's),
    # which differ from it only in slot_mapping and block_tables. Empty: one group.
    layer_groups: tuple[int, ...] = ()
    group_views: list[AttentionMetadata] = field(default_factory=list)
    # decode_prefix()'s answer once asked (False: none)
    _decode_prefix: DecodePrefix | bool | None = field(default=None, repr=False, compare=False)
    # While piecewise CUDA graphs are captured (tllm.runner.piecewise): the recorder an
    # attention backend hands its call to (`capture.defer(method, q, k, v, kv_cache,
    # metadata, *rest)`) instead of attending, so that attention runs eagerly between the
    # captured pieces. None otherwise.
    capture: object | None = field(default=None, repr=False, compare=False)
    # M-RoPE models (Qwen2.5-VL): each token's (temporal, height, width) positions [3, T]
    mrope_positions: torch.Tensor | None = None
    # Gemma 3 steps with images: the last key position each token sees [T] int64 (an image
    # token sees its whole image), for tllm.attention.causal_limits; None: its own position
    causal_limits: torch.Tensor | None = None
    # each request's batch slot, where layers with per-request state (state-space models'
    # Mamba layers: tllm/kv_cache/state_cache.py) keep it; host-side, and on the device
    # ([num_seqs] int64: decode steps' mixers read it, so that a CUDA graph can replay them)
    request_slots_cpu: list[int] = field(default_factory=list)
    request_slots: torch.Tensor | None = None

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata model layer `layer` (model-wide index) attends with."""
        if not self.layer_groups:
            return self
        group = self.layer_groups[layer]
        return self if group == 0 else self.group_views[group - 1]

    def add_group_views(self, layer_groups: tuple[int, ...],
                        tables: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Give KV cache groups 1.. their (slot_mapping, block_tables); every other field
        is this object's."""
        self.layer_groups = layer_groups
        self.group_views = [dataclasses.replace(self, slot_mapping=slots, block_tables=table,
                                                layer_groups=(), group_views=[],
                                                _decode_prefix=None)
                            for slots, table in tables]

    def decode_prefix(self) -> DecodePrefix | None:
        """A mixed step's leading run of one-token requests (decodes), which a backend may
        attend with its decode kernel and the rest with its prefill kernel; None when the
        step has no such run or nothing after it. Computed once per step (and group view)."""
        if self._decode_prefix is None:
            self._decode_prefix = DecodePrefix.of(self)
        return self._decode_prefix or None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True)
class DecodePrefix:
    """The first `num_seqs` requests of a step each compute one token (rows 0..num_seqs-1);
    the others start at row num_seqs, with `rest_query_start_loc` counted from there."""
    num_seqs: int
    max_seq_len: int                    # the longest context among the decodes
    rest_query_start_loc: torch.Tensor  # [num_rest + 1] int32, from 0
    rest_max_query_len: int

    @staticmethod
    def of(metadata: AttentionMetadata) -> DecodePrefix | bool:
        lens = metadata.query_lens_cpu
        count = next((i for i, q in enumerate(lens) if q != 1), len(lens))
        if count == 0 or count == len(lens):
            return False
        return DecodePrefix(count, max(metadata.seq_lens_cpu[:count]),
                            metadata.query_start_loc[count:] - count, max(lens[count:]))


# [num_blocks, tokens_per_block, kv_heads, head_dim]; a keys-only cache (KVCacheSpec) holds
# the same tensor twice
KVCache = tuple[torch.Tensor, torch.Tensor]
NO_KV_SCALES = (1.0, 1.0)


@dataclass(frozen=True)
class KVCacheSpec:
    """What a model's paged KV cache holds on this rank: one (key, value) pair per local
    layer, each token with num_kv_heads x head_dim values. `layer_windows` gives every
    model layer's sliding window (all pipeline stages; None: full attention; empty: all
    full), so the cache can drop the blocks a window has passed; this rank's layers are
    `num_layers` from `first_layer` on. `keys_only`: one tensor per layer, whose "key" is
    all a token stores and the value is read from it (MLA's latent cache: kv_lora_rank +
    rope dims, one head); the pair's value is then the key tensor itself."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple[int | None, ...] = ()
    first_layer: int = 0
    keys_only: bool = False

    @property
    def tensors_per_layer(self) -> int:
        return 1 if self.keys_only else 2

    def bytes_per_token(self, element_size: int) -> int:
        """What one token costs in one layer's cache."""
        return self.tensors_per_layer * self.num_kv_heads * self.head_dim * element_size


@dataclass(frozen=True)
class AttentionOptions:
    """How one layer attends, beyond its head shape: the layers of a model that share these
    share one backend object."""

    sliding_window: int | None = None    # keys within the last `sliding_window` positions
    scale: float | None = None           # softmax scale; None: head_dim ** -0.5
    logits_soft_cap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    # False: every query sees its whole sequence (BERT), or with a sliding window the keys
    # less than `sliding_window` positions away on either side (ModernBERT's local layers)
    causal: bool = True
    # chunked local attention (Llama 4): a query sees only keys of its own chunk of positions
    attention_chunk_size: int | None = None


class AttentionBackend(ABC):
    """Writes this step's keys and values into the paged cache, then attends. `causal`
    False (encoder-only models): each query attends every key of its sequence up to
    `seq_lens` (the whole prompt must then be computed in one step)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, causal: bool = True,
                 attention_chunk_size: int | None = None) -> None:
        if attention_chunk_size is not None and attention_chunk_size < 1:
            raise ValueError(f"attention_chunk_size must be positive, got "
                             f"{attention_chunk_size}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.causal = causal
        self.attention_chunk_size = attention_chunk_size

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata,
                kv_scales: tuple[float, float] = NO_KV_SCALES,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
        Returns [num_tokens, num_heads, head_dim]. An fp8 cache stores k / k_scale and
        v / v_scale (`kv_scales`, this layer's per-tensor scales). `sinks`: this layer's
        learned logit per head (GPT-OSS's attention sinks, [num_heads] float32), added to
        each softmax's denominator; a per-call argument since every layer has its own."""

    def forward_with_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          kv_cache: KVCache, metadata: AttentionMetadata, rotary,
                          kv_scales: tuple[float, float] = NO_KV_SCALES,
                          sinks: torch.Tensor | None = None,
                          qk_norm: tuple[Callable, Callable] | None = None) -> torch.Tensor:
        """Rotary embedding, then forward; a backend may fuse the rotation into its cache
        write (the rotary module holds cos/sin tables [max_position, head_dim]).
        `qk_norm`: (q_norm, k_norm), per-head norms applied to q and k before the rotation
        (Qwen3's; a backend may fuse them too)."""
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        q, k = rotary(metadata.positions, q, k)
        return self.forward(q, k, v, kv_cache, metadata, kv_scales, sinks)


# name -> "module:Class", imported only when the backend is chosen.
_BACKENDS: dict[str, str] = {"torch": "tllm.attention.torch_ref:TorchAttentionBackend",
                              "triton": "tllm.attention.triton_backend:TritonAttentionBackend",
                              # deterministic mode's (LlmArgs.deterministic), on any device
                              "batch_invariant":
                                  "tllm.attention.invariant:BatchInvariantAttentionBackend"}


def register_attention_backend(name: str, target: str) -> None:
    _BACKENDS[name] = target


def has_attention_backend(name: str) -> bool:
    return name in _BACKENDS


def get_attention_backend(name: str) -> Callable[..., AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"attn_backend: unknown attention backend {name!r}; "
                         f"choose one of {sorted(_BACKENDS)}")
    module_name, class_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
