"""Beam search's part of the KV cache manager: beams that share their blocks. A beam that
continues another beam's prefix takes references on that beam's blocks instead of copies;
the one block it writes next, if shared, is copied on write (promised by try_grow, copied
by prepare, before the step writes it)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tllm.kv_cache.block_table import BlockTable
    from tllm.request import Request


class BeamBlockSharing:
    """Mixed into KVCacheManager (which has _tables, pool, slot_caches, _take, _release)."""

    def fork(self, targets: list[Request], sources: list[Request]) -> None:
        """Each target's table becomes a copy of its source's (as all are before the call):
        a reference taken on each of the source's blocks, the target's own released. The
        block a target writes next, if shared, is copied on write (see try_grow)."""
        copies = [self._tables[s.request_id] for s in sources]
        for table in copies:  # their blocks gain holders
            table.exclusive_index = -1
        copies = [([list(b) for b in t.groups], list(t.num_null), list(t.block_hashes))
                  for t in copies]
        for groups, _, _ in copies:
            for g, blocks in enumerate(groups):
                for block_id in blocks:
                    if block_id != self.null_block:
                        self._take(g, block_id)
        for target, (groups, num_null, hashes) in zip(targets, copies):
            table = self._tables[target.request_id]
            for g, blocks in enumerate(table.groups):
                self._release(g, [b for b in blocks if b != self.null_block])
            table.groups, table.num_null, table.block_hashes = groups, num_null, hashes
            table.copy_index = None
            table.exclusive_index = -1
            self._mark_changed(target.request_id, 0)
            if self.reserve_full_generation:
                self._set_reserved(table, self._future_need(target, table,
                                                            target.num_computed_tokens))

    def _needs_copy(self, request: Request, table: BlockTable) -> bool:
        """Whether the block the request writes next is shared (and not promised a copy)."""
        index = request.num_computed_tokens // self.tokens_per_block
        if (index == table.exclusive_index or table.copy_index is not None
                or index >= len(table.groups[0])):
            return False
        blocks = self.pool.blocks
        if any(blocks[group[index]].ref_count > 1 for group in table.groups
               if group[index] != self.null_block):
            return True
        table.exclusive_index = index
        return False

    def _copy_on_write(self, table: BlockTable) -> None:
        """The promised copy: the shared block replaced by a fresh one with its contents."""
        index, table.copy_index = table.copy_index, None
        for g, blocks in enumerate(table.groups):
            old = blocks[index]
            if old == self.null_block or self.pool.blocks[old].ref_count == 1:
                continue  # the other holders have copied it already
            [new] = self._allocate(g, 1)
            for k, v in self.slot_caches:
                k[new].copy_(k[old])
                v[new].copy_(v[old])
            blocks[index] = new
            self._release(g, [old])
        self._set_reserved(table, max(0, table.reserved - self.num_groups))
