"""Checkpoints of the state-space layers' state at KV block boundaries, so that prefix reuse
works for hybrid models (the design is in state_cache.py's docstring).

- Saving. A step's prompt segment (more than one token) that crosses a block boundary has
  its state at the LAST boundary it crosses saved into a row of the checkpoint pool (every
  layer's conv + SSM state): the mixer runs the segment in two passes split there. So a
  prompt prefilled in chunks keeps the last full block boundary of each chunk, and a prompt
  prefilled in one step its last full block; decode steps save nothing (with the overlap
  scheduler their tokens are often not on the host when the block's hash is taken, and they
  would evict prompt checkpoints). After the step the row is keyed by the chained hash of
  the block it ends (the prefix cache's), and left in a BlockPool of its own: LRU, bounded
  by its row count. A row whose block is already checkpointed, or whose hash is not known,
  is given back unkeyed.
- Using. The prefix index cuts a hit back to the last block whose hash has a checkpoint
  (`has`); when the request takes its batch slot, just before its first step's forward,
  the checkpoint is copied into the slot. Admission and that first step come in one launch
  with no forward between, so no save can evict the checkpoint in between.
"""
from __future__ import annotations

import dataclasses

from tllm.kv_cache.block_pool import BlockPool
from tllm.layers.mamba2 import MambaBatch
from tllm.scheduler.interface import ResourceManager, ScheduledBatch


class StateCheckpoints(ResourceManager):
    """`num_rows` saved states of every state-space layer, found by block hash. It is a
    resource manager (update keys the step's saves) and a batch-slot listener
    (assign_slot restores a prefix hit's state); `connect` wires it to the KV cache."""

    def __init__(self, cache, num_rows: int, tokens_per_block: int) -> None:
        self.cache = cache
        self.tokens_per_block = tokens_per_block
        self.pool = BlockPool(num_rows)
        spec = cache.spec
        for layer in cache.layers:
            layer.saved = spec.empty_layer(num_rows, layer.conv.dtype, layer.conv.device)
        self.kv_cache = None
        self.slots = None   # the runner's SlotAssigner (slot -> request after a step)
        self.swap = None    # a StateSwap (state_swap.py) with swap preemption
        self._pending: dict[int, tuple[int, int]] = {}  # slot -> (boundary, row) this step
        self.num_saved = 0
        self.num_restored = 0

    def connect(self, kv_cache) -> None:
        """Prefix hits of `kv_cache` now end only where a checkpoint is."""
        self.kv_cache = kv_cache
        kv_cache.prefixes.saved_states = self

    def has(self, block_hash: int) -> bool:
        return self.pool.lookup(block_hash) is not None

    def forget(self) -> None:
        """Every checkpoint goes (the weights changed: the prefix cache was reset)."""
        self.pool.forget_cached()

    @property
    def num_rows_held(self) -> int:
        """Rows taken by a step's saves not keyed yet (0 between steps)."""
        return self.pool.num_blocks - self.pool.num_free_blocks

    # ---- saving (the model's forward asks, then update keys) ----

    def plan(self, batch: MambaBatch) -> MambaBatch:
        """The batch with a checkpoint row for each prompt segment crossing a boundary."""
        self._give_back(self._pending)  # a failed step's rows: never keyed
        self._pending = {}
        bs = self.tokens_per_block
        save_after, save_rows = [], []
        for length, start, slot in zip(batch.seq_lens, batch.starts, batch.slots):
            boundary = (start + length) // bs * bs
            if length > 1 and boundary > start and self.pool.num_free_blocks:
                [row] = self.pool.allocate(1)
                self._pending[slot] = (boundary, row)
                save_after.append(boundary - start)
                save_rows.append(row)
            else:
                save_after.append(0)
                save_rows.append(-1)
        if not self._pending:
            return batch
        return dataclasses.replace(batch, save_after=save_after, save_rows=save_rows)

    def update(self, batch: ScheduledBatch) -> None:
        """Key the step's saves by their blocks' hashes (the KV cache has just published
        them: it updates first)."""
        pending, self._pending = self._pending, {}
        if not pending:
            return
        request_at = {self.slots.slot_of(r): r for r in batch.requests}
        for slot, (boundary, row) in pending.items():
            request = request_at.get(slot)
            hashes = (self.kv_cache.block_hashes_of(request.request_id)
                      if request is not None else [])
            index = boundary // self.tokens_per_block - 1
            if index < len(hashes) and not self.has(hashes[index]):
                self.pool.cache_full_block(row, hashes[index])
                self.num_saved += 1
        self._give_back(pending)

    def _give_back(self, pending: dict[int, tuple[int, int]]) -> None:
        self.pool.free([row for _, row in pending.values()])

    def free(self, request) -> None:
        """Nothing per request: saves are keyed (or given back) at the end of each step."""

    # ---- restoring (the SlotAssigner tells) ----

    def assign_slot(self, slot: int, request) -> None:
        """A request admitted past position 0 (a prefix hit) starts from its checkpoint."""
        num_computed = request.num_computed_tokens
        if num_computed == 0 or (self.swap is not None and self.swap.holds(request)):
            return  # the mixer zeroes the slot, or the swapped-out state comes back
        num_blocks, rest = divmod(num_computed, self.tokens_per_block)
        hashes = self.kv_cache.block_hashes_of(request.request_id)
        row = self.pool.lookup(hashes[num_blocks - 1]) if not rest and hashes else None
        if row is None:
            raise RuntimeError(f"request {request.request_id!r} starts at token "
                               f"{num_computed} with no saved state there")
        self.pool.take_cached(row)   # and back: now the most recently used
        self.pool.free([row])
        for layer in self.cache.layers:
            layer.conv[slot] = layer.saved.conv[row]
            layer.ssm[slot] = layer.saved.ssm[row]
        self.num_restored += 1

    def release_slot(self, slot: int, request=None) -> None:
        """(A slot given back holds nothing of ours.)"""

    def state_stats(self) -> dict[str, int]:
        return {"state_checkpoints_saved": self.num_saved,
                "state_checkpoints_restored": self.num_restored,
                "state_checkpoint_rows": self.pool.num_blocks}

