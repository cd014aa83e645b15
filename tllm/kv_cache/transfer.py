"""What the KV cache needs to know of disaggregated serving: a request's KV blocks held past
its end and read out as one tensor (to send), and KV that arrived from elsewhere written into
fresh blocks when the request that carries it is admitted. The transports themselves live in
tllm.disagg."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from tllm.kv_cache.block_table import Admission, BlockTable, cdiv

if TYPE_CHECKING:
    from tllm.kv_cache.manager import KVCacheManager
    from tllm.request import Request


class ImportedKV(Protocol):
    """KV of a request's first `num_tokens` prompt tokens, computed by another engine."""

    num_tokens: int

    @property
    def is_pending(self) -> bool:
        """Not yet written into this engine's blocks."""

    def write_into(self, kv_cache: KVCacheManager, block_ids: list[int]) -> None:
        """Write the KV into these freshly allocated blocks (the executor thread, at
        admission); afterwards `is_pending` is False."""

    def discard(self) -> None:
        """The request ended before its KV was written: drop it (and tell its source)."""


def stored_tensors(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The tensors a layer's (key, value) pair really holds: one for a keys-only cache,
    whose value is the key tensor itself (MLA's latent cache)."""
    k, v = pair
    return (k,) if v is k else (k, v)


def read_blocks(slot_caches: list[tuple[torch.Tensor, torch.Tensor]],
                block_ids: list[int]) -> torch.Tensor:
    """Blocks as one tensor [num_blocks, num_slots, 2 (1: keys only), tokens_per_block,
    kv_heads, head_dim] on the cache's device."""
    index = torch.tensor(block_ids, dtype=torch.long, device=slot_caches[0][0].device)
    return torch.stack([torch.stack([c.index_select(0, index) for c in stored_tensors(pair)],
                                    1) for pair in slot_caches], 1)


def write_blocks(slot_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int],
                 data: torch.Tensor) -> None:
    """The inverse of read_blocks (data on any device; copied without waiting from pinned
    host memory)."""
    device = slot_caches[0][0].device
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    data = data.to(device, non_blocking=True)
    for slot, pair in enumerate(slot_caches):
        for i, cache in enumerate(stored_tensors(pair)):
            cache.index_copy_(0, index, data[:, slot, i])


def block_shape(kv_cache: KVCacheManager) -> tuple[int, ...]:
    """One block of every slot: [num_slots, 2 (1: keys only), tokens_per_block, kv_heads,
    head_dim]."""
    pair = kv_cache.slot_caches[0]
    return (len(kv_cache.slot_caches), len(stored_tensors(pair)), *pair[0].shape[1:])


class DisaggBlockTransfer:
    """Mixed into KVCacheManager (which has _tables, stats, slot_caches, _allocate, _take,
    _release, _available, _admission_need, _future_need, _set_reserved, _publish)."""

    # ---- the generation side: blocks written from KV another engine computed ----

    def _admit_imported(self, request: Request) -> Admission | None:
        """Admit a request whose prompt KV came from another engine (disaggregated serving):
        fresh blocks, the KV written into them and published for reuse. Its last prompt
        token is computed again all the same: its logits give the first output token."""
        imported = request.kv_import
        num_blocks = cdiv(imported.num_tokens, self.tokens_per_block)
        if self._available() < max(num_blocks, self._admission_need(request, 0, 0)):
            return None
        table = BlockTable([self._allocate(0, num_blocks)], [0])
        imported.write_into(self, table.groups[0])
        self._tables[request.request_id] = table
        num_computed = min(imported.num_tokens, request.num_tokens - 1)
        if self.reserve_full_generation:
            self._set_reserved(table, self._future_need(request, table, num_computed))
        self._publish(request, num_computed)
        self.stats.blocks_imported += num_blocks
        return Admission(num_computed)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        write_blocks(self.slot_caches, block_ids, data)

    # ---- the context side: blocks that outlive their request ----

    def retain(self, request: Request) -> list[int]:
        """Take a reference on each of the request's blocks, so they outlive it (until
        `release`): a context server keeps a prefilled prompt's KV for a generation server.
        One KV cache group only (checked when the engine is built)."""
        block_ids = list(self._tables[request.request_id].groups[0])
        for block_id in block_ids:
            self._take(0, block_id)
        return block_ids

    def release(self, block_ids: list[int]) -> None:
        """Drop the references `retain` took."""
        self._release(0, block_ids)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[num_blocks, num_slots, 2, tokens_per_block, kv_heads, head_dim]"""
        return read_blocks(self.slot_caches, block_ids)
