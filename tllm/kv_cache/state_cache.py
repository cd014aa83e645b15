"""The per-request state of state-space layers (Mamba-2: a conv state and an SSM state per
layer; gated DeltaNet: a conv state and the recurrent state, held alike), a cache of its own
kind beside the paged KV cache.

Design. Unlike KV, a request's state has a fixed size whatever its length, and one step
overwrites it: it is a slot, not a list of blocks.

- Slots. A request's state lives at the row of its batch slot (runner/batch_state.py's
  SlotAssigner: taken when the request is first scheduled, given back when it finishes or is
  preempted), in tensors of `max_batch_size` rows per layer allocated once at start-up, so
  admission never waits for state memory and the KV cache's capacity policy is unchanged.
  Every rank already receives the slots in each step's diff (AttentionMetadata's
  `request_slots_cpu`), so tensor- and pipeline-parallel ranks address the same rows.
- Lifetime. A step whose request starts at position 0 resets the slot's state before
  reading it (the mixer does, layer by layer), so "allocated on admission" needs no message,
  and preemption with recompute is correct by construction: the request comes back at
  position 0 (or at a prefix hit, restored as below) on whatever slot it gets. Finishing frees nothing beyond the slot itself.
- Prefix reuse: the state at block boundaries is checkpointed, keyed by the KV block's
  chained hash, and a prefix hit is cut back to the last block with a checkpoint, which is
  copied into the slot before the request's first step (tllm/kv_cache/state_checkpoints.py).
- Swap preemption: a swapped-out request's slot rows go to host memory beside its KV
  blocks and come back into its next slot (tllm/kv_cache/state_swap.py).
- What is not correct yet, and therefore refused: speculative decoding (rejected drafts
  would have to roll the state back), refused by `check_hybrid_args`; beam search (a forked beam needs
  its parent's state: refused per request by the executor).
- CUDA graphs. Decode steps (one token per request) reach the mixers as `DecodeSlots`: the
  slots as a device tensor and nothing from the host, so a decode graph replays them; the
  graph's padding rows use a scratch row past the last slot (`pad_slot`), and a request at
  position 0 in such a step (a one-token prompt) has its slot zeroed before the step
  (`reset_new`), outside the graph. Steps with prompt tokens replay piecewise graphs: the
  mixers' projections are captured and their state update runs between the pieces, as
  attention does (`DeferredBatch`), with the step's batch planned once for every layer.
"""
from __future__ import annotations

import logging

import torch

from tllm.kv_cache.state_checkpoints import StateCheckpoints
from tllm.layers.mamba2 import LayerStateSpec, MambaBatch, reset_new_requests
from tllm.layers.state_batch import DecodeSlots, DeferredBatch

logger = logging.getLogger(__name__)


class StateCache:
    """Every state-space layer's state for `num_slots` batch slots (see the module
    docstring); `layers[i]` is the i-th state-space layer's."""

    def __init__(self, spec: LayerStateSpec, num_slots: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.spec = spec
        self.pad_slot = num_slots   # a scratch row: a decode graph's padding rows use it
        self.layers = [spec.empty_layer(num_slots + 1, dtype, device)
                       for _ in range(spec.num_layers)]
        logger.info("state cache: %d layers x %d slots, %.2f MiB per request", spec.num_layers,
                    num_slots, spec.bytes_per_request(dtype) / 2**20)
        self.checkpoints: StateCheckpoints | None = None   # with prefix reuse on
        self.swap = None   # a StateSwap (state_swap.py) with swap preemption
        self._planned: tuple = (None, None)   # (the step's metadata, its batch)

    def batch(self, metadata) -> MambaBatch | DecodeSlots | DeferredBatch:
        """The step's requests for the mixers: a decode step's device slots (its new
        requests' slots zeroed here), or every segment with the checkpoints it saves; under
        a piecewise capture, the deferral. Planned once per step (a piecewise replay asks
        once per layer)."""
        if metadata.capture is not None:
            return DeferredBatch(metadata.capture, metadata, self.batch)
        if self._planned[0] is metadata:
            return self._planned[1]
        if metadata.max_query_len == 1 and metadata.request_slots is not None:
            self.reset_new(metadata)
            batch = DecodeSlots(metadata.request_slots)
        else:
            batch = MambaBatch.from_metadata(metadata)
            if self.checkpoints is not None:
                batch = self.checkpoints.plan(batch)
        self._planned = (metadata, batch)
        return batch

    def reset_new(self, metadata) -> None:
        """Zero the state of every request of the step that starts at position 0, in all
        layers (decode steps: the mixers do it per layer for the others). From the host
        lists alone: a graph capture's metadata has none, so nothing is captured."""
        reset_new_requests(MambaBatch.from_metadata(metadata), *self.layers)


def build_state_cache(model, args, dtype: torch.dtype,
                      device: torch.device) -> StateCache | None:
    """The model's state cache (None for a model without state-space layers), bound to it."""
    spec = getattr(model, "state_spec", None)
    if spec is None:
        return None
    check_hybrid_args(args)
    state_dtype = args.kv_cache_config.mamba_ssm_cache_dtype
    if state_dtype != "auto":
        spec = spec.with_state_dtype(getattr(torch, state_dtype))
    cache = StateCache(spec, args.max_batch_size, dtype, device)
    kv_config = args.kv_cache_config
    if kv_config.enable_block_reuse:
        cache.checkpoints = StateCheckpoints(
            cache, kv_config.max_state_checkpoints or args.max_batch_size,
            kv_config.tokens_per_block)
        logger.info("state checkpoints for prefix reuse: %d rows (%.2f MiB)",
                    cache.checkpoints.pool.num_blocks,
                    cache.checkpoints.pool.num_blocks * spec.bytes_per_request(dtype) / 2**20)
    model.bind_state_cache(cache)
    return cache


def check_hybrid_args(args) -> None:
    """Refuse what a state-space model cannot do yet (module docstring)."""
    if args.speculative_config is not None:
        raise ValueError("speculative_config: speculative decoding is not supported for "
                         "models with state-space layers yet")
