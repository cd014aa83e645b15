"""Rotary position embedding (the rotate-half form HF uses) with every rope scaling HF reads
from a config, over the whole head or only its first `rotary_dim` dims.

Inverse frequencies come from transformers' own RoPE initialisers (ROPE_INIT_FUNCTIONS), so
the static scalings (`linear`, `yarn`, `llama3`, ...) are HF's exactly, at every position.

Two scalings depend on the sequence's length in HF, which recomputes them at each step from
`seq_len = max(position) + 1` (`dynamic_rope_update`): `dynamic` (NTK) raises the rope base
once a sequence exceeds `max_position_embeddings`, and `longrope` switches from
`short_factor` to `long_factor` once it exceeds `original_max_position_embeddings` (Phi-3
even drops its cache at that point and recomputes the whole sequence with the long factors).

Our rule: **position p rotates as HF rotates the newest token of a (p + 1)-token sequence**
(one table row per position). Within the original length that is HF's rotation of every
token, at any step. Beyond it, each token gets the rotation HF gives it when it is decoded,
while tokens before it keep the rotation of their own position; HF instead re-rotates the
whole sequence by its current length. An engine cannot: a cached key must not depend on how
long its sequence grows later, since prefix caching shares it between requests of any length
and chunked prefill computes it before the prompt's end is seen (a choice per request by its
length at the step would make outputs depend on chunking and on which request cached a
prefix). vLLM and TensorRT-LLM choose engine-wide instead: long factors everywhere when the
maximum model length exceeds the original length, which is not HF's rotation for the short
sequences; TensorRT-LLM's earlier long-rope table was per position, as here. The rows stay a
plain [max_position, rotary_dim] table, so the fused rope + cache-write kernel and CUDA
graphs serve them as they serve any rope.

Partial rotary (`partial_rotary_factor`, GPT-NeoX's `rotary_pct`): only the first
rotary_dim = int(head_dim * factor) dims of each head rotate; the rest pass through."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The rope settings of an HF config, in the transformers 5 layout; `layer_type`: the
    entry of a config that gives each kind of layer its own (Gemma 3)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    scaling = getattr(config, "rope_scaling", None)
    if scaling and not params.get("rope_type"):
        params.update(scaling)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rotary_dim_of(config, head_dim: int, layer_type: str | None = None) -> int:
    """How many leading dims of each head rotate: head_dim times the partial rotary factor."""
    params = rope_parameters(config, layer_type)
    factor = params.get("partial_rotary_factor",
                        getattr(config, "partial_rotary_factor", None) or 1.0)
    dim = int(head_dim * factor)
    if not 0 < dim <= head_dim or dim % 2:
        raise ValueError(f"partial_rotary_factor {factor} gives {dim} rotary dims of a "
                         f"{head_dim}-dim head; they must be even and between 2 and head_dim")
    return dim


def inverse_frequencies(config, head_dim: int, layer_type: str | None = None,
                        seq_len: int | torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, float]:
    """HF's inverse frequencies [rotary_dim / 2] (or [n, rotary_dim / 2] for a [n, 1]
    `seq_len`) and cos/sin scaling; `seq_len`: the sequence length a length-dependent
    scaling is computed for (None: its value at load, HF's for short sequences)."""
    params = rope_parameters(config, layer_type)
    if params["rope_type"] == "default":
        dim, base = rotary_dim_of(config, head_dim, layer_type), params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if params["rope_type"] not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {params['rope_type']!r}; tllm supports "
                         f"default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    with torch.device("cpu"):  # HF makes some tensors on the default device (meta, when
        # a model is built there) and copies them to the one it was given
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](
            config, torch.device("cpu"), seq_len=seq_len, **kwargs)
    return inv_freq.float(), float(scaling)


def position_inverse_frequencies(config, head_dim: int, max_position: int,
                                 layer_type: str | None = None
                                 ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for the rotary table: [rotary_dim / 2] for a static scaling, or
    [max_position, rotary_dim / 2] for a length-dependent one, row p being HF's for the
    newest token of a (p + 1)-token sequence (the rule in the module docstring)."""
    params = rope_parameters(config, layer_type)
    if params["rope_type"] == "longrope":
        _check_longrope_factors(params, rotary_dim_of(config, head_dim, layer_type) // 2)
    inv_freq, scaling = inverse_frequencies(config, head_dim, layer_type)
    switch = _length_switch(config, params)
    if switch is None or max_position <= switch:
        return inv_freq, scaling
    if params["rope_type"] == "longrope":  # the long factors, for any longer sequence
        longer, _ = inverse_frequencies(config, head_dim, layer_type, seq_len=switch + 1)
    else:  # dynamic: HF's base for each sequence length of switch + 1 .. max_position
        lengths = torch.arange(switch + 1, max_position + 1)[:, None]
        longer, _ = inverse_frequencies(config, head_dim, layer_type, seq_len=lengths)
    rows = inv_freq.expand(max_position, -1).clone()
    rows[switch:] = longer  # position p >= switch: the newest token of p + 1 > switch
    return rows, scaling


def _length_switch(config, params: dict) -> int | None:
    """The sequence length past which a length-dependent scaling changes (None: static)."""
    if params["rope_type"] == "dynamic":
        return config.max_position_embeddings
    if params["rope_type"] != "longrope":
        return None
    switch = (params.get("original_max_position_embeddings")
              or getattr(config, "original_max_position_embeddings", None))
    if not switch:
        raise ValueError("longrope rope scaling needs original_max_position_embeddings")
    return int(switch)


def _check_longrope_factors(params: dict, num_frequencies: int) -> None:
    for name in ("short_factor", "long_factor"):
        if len(params.get(name) or ()) != num_frequencies:
            raise ValueError(f"longrope {name} needs {num_frequencies} entries (rotary dims "
                             f"/ 2), got {len(params.get(name) or ())}")


def rotary_embedding(config, head_dim: int, max_position: int,
                     layer_type: str | None = None) -> RotaryEmbedding:
    """The rotary table of a config (of one layer type's rope parameters), on the default
    device."""
    inv_freq, scaling = position_inverse_frequencies(config, head_dim, max_position, layer_type)
    return RotaryEmbedding(inv_freq.to(torch.get_default_device()), scaling, max_position)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    dim = cos.shape[-1]
    # HF's rotate_half(x) * sin == roll(x, half) * [-sin, sin] exactly (a sign flip is exact)
    if dim == x.shape[-1]:
        return x * cos + x.roll(dim // 2, -1) * signed_sin
    rot = x[..., :dim]
    return torch.cat((rot * cos + rot.roll(dim // 2, -1) * signed_sin, x[..., dim:]), dim=-1)


def step_cached(module: nn.Module, positions: torch.Tensor, dtype: torch.dtype,
                make: Callable[[], tuple]) -> tuple:
    """`make()`'s rope tables, kept on `module` for the step: every layer gets the step's one
    positions tensor, so they are gathered once per step, not once per layer. Never across
    a CUDA graph capture: a graph's warm-up and capture share one positions buffer, so
    tables kept from the warm-up would be read by the graph as constants (a replay would
    rotate by the warm-up's positions), and tables made in one captured piece are not remade
    by the others; under capture each layer gathers its own."""
    capturing = positions.is_cuda and torch.cuda.is_current_stream_capturing()
    cached = module.__dict__.get("_step_tables")
    if not capturing and cached is not None and cached[0] is positions and cached[1] == dtype:
        return cached[2]
    tables = make()
    if not capturing:
        module.__dict__["_step_tables"] = (positions, dtype, tables)
    return tables


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, heads, D] and k [T, kv_heads, D] at the given positions, to the
    first `rotary_dim` dims of each head. `inv_freq`: [rotary_dim / 2] for every position,
    or one row per position ([max_position, rotary_dim / 2])."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float,
                 max_position: int) -> None:
        super().__init__()
        self.rotary_dim = 2 * inv_freq.shape[-1]
        positions = torch.arange(max_position, dtype=torch.float)
        freqs = positions[:, None] * (inv_freq if inv_freq.dim() == 2 else inv_freq[None, :])
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, signed_sin = self._tables(positions, q.dtype)
        return _rotate(q, cos, signed_sin), _rotate(k, cos, signed_sin)

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and [-sin, sin] at these positions, once per step (step_cached)."""
        def gather():
            cos = self.cos[positions].to(dtype).unsqueeze(1)
            sin = self.sin[positions].to(dtype).unsqueeze(1)
            half = sin.shape[-1] // 2
            return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return step_cached(self, positions, dtype, gather)
