"""How a step's requests reach the state-space mixers when no host list may be read: a
decode step under a CUDA graph (`DecodeSlots`), and a step captured into piecewise graphs
(`DeferredBatch`). The eager form, every request's segment on the host, is
layers/mamba2.py's MambaBatch; the state cache (kv_cache/state_cache.py) picks the form."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class DecodeSlots:
    """A decode step (one token per request) as the mixers read it under a CUDA graph: each
    row's state slot as a device tensor [B] int64, with no host list, so one capture serves
    every batch of its size. Padding rows name the state cache's scratch slot; new requests'
    slots were zeroed before the step (StateCache.reset_new)."""
    slots: torch.Tensor

    def cu_seqlens(self) -> torch.Tensor:
        """One token per request: 0, 1, ..., B (int32, on the slots' device)."""
        return torch.arange(self.slots.numel() + 1, dtype=torch.int32,
                            device=self.slots.device)


@dataclass(frozen=True)
class DeferredBatch:
    """A step being captured into piecewise CUDA graphs (runner/piecewise.py): a mixer's
    projections are captured, its state update (whose launches follow the step's segments)
    is handed to the recorder as attention calls are, and runs eagerly between the pieces
    at each replay with that step's own batch (`batch_of(metadata)`, planned once a step)."""
    recorder: object             # the PiecewiseRecorder
    metadata: object             # the capture's AttentionMetadata
    batch_of: Callable           # StateCache.batch

    def defer(self, core: Callable, inputs: tuple[torch.Tensor, ...], state,
              like: torch.Tensor) -> torch.Tensor:
        """`core(*inputs, state, batch)` at replay (1 to 3 inputs, sliced to the step's
        rows); returns the buffer it writes, shaped and typed as `like`."""
        count, batch_of = len(inputs), self.batch_of

        def run(a, b, c, layer_state, metadata):
            return core(*(a, b, c)[:count], layer_state, batch_of(metadata))
        padded = (*inputs, *[inputs[-1]] * (3 - count))
        return self.recorder.defer(run, *padded, state, self.metadata, like=like)
