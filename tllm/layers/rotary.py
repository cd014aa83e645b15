"""Rotary position embedding (the rotate-half form HF uses), with inverse frequencies from
transformers' own RoPE initialisers so that every scaling type matches HF exactly."""
from __future__ import annotations

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


def inverse_frequencies(config, head_dim: int,
                        layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config, layer_type)
    if params["rope_type"] == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if params["rope_type"] not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {params['rope_type']!r}")
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"),
                                                                 **kwargs)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, heads, D] and k [T, kv_heads, D] at the given positions."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float,
                 max_position: int) -> None:
        super().__init__()
        positions = torch.arange(max_position, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, signed_sin = self._tables(positions, q.dtype)
        half = q.shape[-1] // 2
        # HF's rotate_half(x) * sin == roll(x, half) * [-sin, sin] exactly (a sign flip is exact)
        return (q * cos + q.roll(half, -1) * signed_sin,
                k * cos + k.roll(half, -1) * signed_sin)

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and [-sin, sin] at these positions: gathered once per step (every layer gets
        the step's one positions tensor), not once per layer."""
        cached = self.__dict__.get("_step_tables")
        if cached is not None and cached[0] is positions and cached[1] == dtype:
            return cached[2]
        cos = self.cos[positions].to(dtype).unsqueeze(1)
        sin = self.sin[positions].to(dtype).unsqueeze(1)
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        self.__dict__["_step_tables"] = (positions, dtype, (cos, signed_sin))
        return cos, signed_sin
