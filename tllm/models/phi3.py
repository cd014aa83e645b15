"""Phi-3 (and Phi-3.5 / Phi-4-mini): the Llama decoder. Its checkpoint stores q/k/v as one
`qkv_proj` and gate/up as one `gate_up_proj`; they are cut into their parts at load, so
each tensor-parallel rank keeps its heads and columns as for Llama. Longrope scaling,
`partial_rotary_factor` and `sliding_window` come from the config through the base."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from tllm.attention.interface import AttentionBackend
from tllm.layers.quant import QuantConfig
from tllm.models.llama import (GATE_UP_SHARDS, QKV_SHARDS, LlamaForCausalLM, head_dim_of)
from tllm.models.registry import register_model


def split_fused(name: str, tensor: torch.Tensor, fused: str, parts: tuple[str, ...],
                sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    """A fused projection's tensor as its parts' tensors, rows cut in order of `parts`; a
    one-element tensor (a per-tensor scale) goes to every part."""
    if tensor.numel() == 1:
        return [(name.replace(fused, part), tensor) for part in parts]
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; the fused "
                         f"{fused} should have {sum(sizes)} ({' + '.join(map(str, sizes))})")
    return [(name.replace(fused, part), piece)
            for part, piece in zip(parts, tensor.split(sizes, dim=0))]


@register_model("Phi3ForCausalLM")
class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, backend_cls: type[AttentionBackend], max_position: int,
                 quant_config: QuantConfig | None = None) -> None:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"Phi3ForCausalLM: hidden_act {config.hidden_act!r} is not "
                             "supported; tllm runs Phi-3's silu gated MLP")
        super().__init__(config, backend_cls, max_position, quant_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        config, head_dim = self.config, head_dim_of(self.config)
        kv_rows = (getattr(config, "num_key_value_heads", None)
                   or config.num_attention_heads) * head_dim
        qkv_sizes = [config.num_attention_heads * head_dim, kv_rows, kv_rows]
        gate_up_sizes = [config.intermediate_size] * 2
        for name, tensor in weights:
            if ".qkv_proj." in name:
                yield from split_fused(name, tensor, "qkv_proj", QKV_SHARDS, qkv_sizes)
            elif ".gate_up_proj." in name:
                yield from split_fused(name, tensor, "gate_up_proj", GATE_UP_SHARDS,
                                       gate_up_sizes)
            else:
                yield name, tensor
