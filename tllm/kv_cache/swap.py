"""Swap preemption's part of the KV cache manager: a preempted request's blocks go to host
memory and are freed on the device (swap_out); when it is admitted again they are written
into newly allocated blocks (_swap_in, which try_admit calls)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tllm.kv_cache.block_table import Admission, BlockTable

if TYPE_CHECKING:
    from tllm.request import Request


@dataclass
class Swapped:
    data: list[list[torch.Tensor | None]]  # per group, block contents in host memory
    num_computed_tokens: int

    @property
    def num_blocks(self) -> int:
        return sum(d is not None for group in self.data for d in group)


class BlockSwapping:
    """Mixed into KVCacheManager (which has _tables, _swapped, host_capacity_blocks, stats,
    free, _read_block, _write_block, _allocate, _available, _admission_need, _future_need,
    _set_reserved and _publish)."""

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self._swapped

    def swap_out(self, request: Request) -> bool:
        """Move a request's blocks to host memory and free them on the device; False when the
        host tier has no room (the caller then recomputes instead)."""
        table = self._tables[request.request_id]
        num_live = sum(table.num_live(g) for g in range(self.num_groups))
        num_swapped = sum(s.num_blocks for s in self._swapped.values())
        if num_swapped + num_live > self.host_capacity_blocks:
            return False
        data = [[None if b == self.null_block else self._read_block(b).to("cpu") for b in t]
                for t in table.groups]
        self.free(request)
        self._swapped[request.request_id] = Swapped(data, request.num_computed_tokens)
        self.stats.blocks_swapped_out += num_live
        return True

    def _swap_in(self, request: Request) -> Admission | None:
        swapped = self._swapped[request.request_id]
        num_computed = swapped.num_computed_tokens
        live = [sum(d is not None for d in group) for group in swapped.data]
        # without a reservation, room for the tokens it computes next must be there now
        room = sum(max(0, self._admission_need(request, g, num_computed) - live[g])
                   for g in range(self.num_groups))
        if self._available() < sum(live) + room:
            return None
        del self._swapped[request.request_id]
        groups = []
        for g, group in enumerate(swapped.data):
            block_ids = iter(self._allocate(g, live[g]))
            groups.append([self.null_block if d is None else next(block_ids) for d in group])
            for block_id, contents in zip(groups[-1], group):
                if contents is not None:
                    self._write_block(block_id, contents)
        num_null = [sum(d is None for d in group) for group in swapped.data]
        table = BlockTable(groups, num_null)
        self._tables[request.request_id] = table
        if self.reserve_full_generation:
            self._set_reserved(table, self._future_need(request, table, num_computed))
        self._publish(request, num_computed)
        self.stats.blocks_swapped_in += sum(live)
        return Admission(num_computed)
