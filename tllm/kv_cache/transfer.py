"""What the KV cache needs to know of disaggregated serving: a request's KV blocks read out
as one tensor (to send), and KV that arrived from elsewhere written into fresh blocks when the
request that carries it is admitted. The transports themselves live in tllm.disagg."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from tllm.kv_cache.manager import KVCacheManager


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


def read_blocks(slot_caches: list[tuple[torch.Tensor, torch.Tensor]],
                block_ids: list[int]) -> torch.Tensor:
    """Blocks as one tensor [num_blocks, num_slots, 2, tokens_per_block, kv_heads, head_dim]
    on the cache's device."""
    index = torch.tensor(block_ids, dtype=torch.long, device=slot_caches[0][0].device)
    return torch.stack([torch.stack((k.index_select(0, index), v.index_select(0, index)), 1)
                        for k, v in slot_caches], 1)


def write_blocks(slot_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int],
                 data: torch.Tensor) -> None:
    """The inverse of read_blocks (data on any device; copied without waiting from pinned
    host memory)."""
    device = slot_caches[0][0].device
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    data = data.to(device, non_blocking=True)
    for slot, (k, v) in enumerate(slot_caches):
        k.index_copy_(0, index, data[:, slot, 0])
        v.index_copy_(0, index, data[:, slot, 1])


def block_shape(kv_cache: KVCacheManager) -> tuple[int, ...]:
    """One block of every slot: [num_slots, 2, tokens_per_block, kv_heads, head_dim]."""
    k = kv_cache.slot_caches[0][0]
    return (len(kv_cache.slot_caches), 2, *k.shape[1:])
