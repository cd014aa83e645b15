"""LTX-2's block stack for step caching (step_cache.py): the state between blocks is the two
streams (video, audio), each with its pending gated residual; a cached residual is handed to
the output layer as a pending residual with gate 1."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from tllm.kernels.triton.ltx2_norms import per_token
from tllm.visual_gen.models.ltx2.blocks import StreamState, modulate
from tllm.visual_gen.step_cache import BlockStack


def block_stack(layers: nn.ModuleList, embeddings: Sequence[torch.Tensor], text, rope,
                split: int | None, cross_rows: torch.Tensor | None) -> BlockStack:
    """The blocks over the state (video, audio); `embeddings` are the timestep modulations
    every block adds its tables to (LTX2Block.modulations' arguments)."""
    masks = (text.video_mask, text.audio_mask)
    pairs = list(zip(layers, text.layers))

    def run(blocks, state):
        video, audio = state
        for block, text_kv in blocks:
            vmod, amod = block.modulations(*embeddings)
            video, audio = block(video, audio, vmod, amod, text_kv, masks, rope, split,
                                 cross_rows)
        return video, audio

    def modulated_input(state) -> torch.Tensor:
        first = layers[0]
        vmod, _ = first.modulations(*embeddings)
        _, (h,) = modulate(state[0].x, [vmod.main[:2]], first.eps, split)
        return h

    def hidden(state) -> list[torch.Tensor]:
        return [_materialize(state[0], split), _materialize(state[1], None)]

    def with_residuals(state, residuals) -> tuple[StreamState, StreamState]:
        return tuple(StreamState(h, (r, None)) for h, r in zip(hidden(state), residuals))

    return BlockStack(first=lambda state: run(pairs[:1], state),
                      rest=lambda state: run(pairs[1:], state),
                      modulated_input=modulated_input, hidden=hidden,
                      with_residuals=with_residuals)


def _materialize(stream: StreamState, split: int | None) -> torch.Tensor:
    """The stream's hidden states with its pending residual added."""
    if stream.pending is None:
        return stream.x
    y, gate = stream.pending
    if gate is None:
        return stream.x + y
    return stream.x + y * per_token(gate, stream.x.shape[1], split)
