"""KV cache manager: the paged K/V tensors, per-request block tables, prefix reuse across
device/host/disk tiers, swapping for preemption, and admission under the capacity policy.

It is a resource manager (tllm.scheduler.interface): the scheduler asks it to admit a request
(`try_admit`, which answers with the tokens it already holds) and to make room for a step's
tokens (`try_grow`); the loop then calls `prepare(batch)` (blocks are allocated), `update(batch)`
(newly full blocks become reusable) and `free(request)`. Its state is keyed by request id; it
reads requests and never writes them.

A model with sliding-window layers has several KV cache groups (tllm.kv_cache.groups): each
request holds one block table per group, and a window group's table gives the blocks its
window has passed back to the pool, leaving the null block (never written, never read: the
attention mask hides those positions) in their place.

Three parts are mixed in from modules of their own: beams sharing blocks with copy-on-write
(tllm.kv_cache.beam_blocks), disaggregated serving's KV import and export
(tllm.kv_cache.transfer) and swap preemption (tllm.kv_cache.swap)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from tllm.kv_cache.beam_blocks import BeamBlockSharing
from tllm.kv_cache.block_pool import BlockPool
from tllm.kv_cache.block_table import Admission, BlockTable, cdiv
from tllm.kv_cache.groups import (KVCacheLayout, first_live_block, plan_layout,
                                  window_peak_blocks)
from tllm.kv_cache.offload import DiskBlockStore, HostBlockStore
from tllm.kv_cache.prefix import PrefixHit, PrefixIndex, chain_hash, group_key
from tllm.kv_cache.swap import BlockSwapping, Swapped
from tllm.kv_cache.transfer import DisaggBlockTransfer, stored_tensors
from tllm.request import Request
from tllm.scheduler.interface import ResourceManager, ScheduledBatch

_NO_NULL_BLOCK = -1  # the null block's id when no group has a window (never in a table)


@dataclass
class KVCacheStats:
    blocks_needed: int = 0       # full prefix blocks looked up when requests were admitted
    blocks_reused: int = 0       # of those, found in some tier instead of recomputed
    blocks_onboarded: int = 0    # brought back from host memory or disk
    blocks_offloaded: int = 0    # evicted from the device into the host tier
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    blocks_freed_by_window: int = 0  # returned to the pool once a sliding window passed them
    blocks_imported: int = 0     # written from KV another engine computed (disaggregated)
    peak_requests: int = 0       # the most requests holding blocks in one step

    @property
    def hit_rate(self) -> float:
        return self.blocks_reused / self.blocks_needed if self.blocks_needed else 0.0


class KVCacheManager(BeamBlockSharing, DisaggBlockTransfer, BlockSwapping,
                     ResourceManager):
    """Owns the (key, value) tensors, each shaped [num_blocks, tokens_per_block,
    num_kv_heads, head_dim]: one pair per layer, or with several groups one pair per slot
    (`kv_caches` lists each layer's pair either way). With `keys_only` a pair holds one
    tensor twice (KVCacheSpec.keys_only): half the memory, the same interface.

    With `reserve_full_generation` (GUARANTEED_NO_EVICT) admission reserves every block a
    request could need, so a running request never runs out; without it (MAX_UTILIZATION)
    requests are admitted greedily and the scheduler preempts when `try_grow` fails. A window
    group's need is bounded by its window plus the largest step (`max_step_tokens`, the
    scheduler's token budget; None: the request's remaining tokens).
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 tokens_per_block: int, dtype: torch.dtype, device: torch.device | str,
                 enable_block_reuse: bool = True, reserve_full_generation: bool = True,
                 host_cache_blocks: int = 0, disk_cache_dir: str | None = None,
                 disk_cache_blocks: int = 0, layout: KVCacheLayout | None = None,
                 max_step_tokens: int | None = None, keys_only: bool = False) -> None:
        self.tokens_per_block = tokens_per_block
        self.reserve_full_generation = reserve_full_generation
        self.layout = layout or plan_layout(num_layers)
        if len(self.layout.layer_slots) != num_layers:
            raise ValueError(f"layout: {len(self.layout.layer_slots)} layers, expected "
                             f"{num_layers}")
        self.windows = self.layout.windows
        self.num_groups = self.layout.num_groups
        self.has_windows = any(w is not None for w in self.windows)
        self.max_step_tokens = max_step_tokens
        shape = (num_blocks, tokens_per_block, num_kv_heads, head_dim)
        # (Not written here: on a CPU, writing a pool of gigabytes costs seconds of start-up,
        # so its pages join the resident memory as steps first touch them.)
        # keys only (MLA's latent cache): the pair's value is the key tensor itself
        self.slot_caches = []
        for _ in range(self.layout.num_slots):
            k = torch.empty(shape, dtype=dtype, device=device)
            self.slot_caches.append((k, k if keys_only else torch.empty_like(k)))
        self.kv_caches = [self.slot_caches[s] for s in self.layout.layer_slots]
        self.host_capacity_blocks = host_cache_blocks
        disk = DiskBlockStore(disk_cache_dir, disk_cache_blocks) if disk_cache_dir else None
        self.host_store = (HostBlockStore(host_cache_blocks, torch.device(device).type == "cuda",
                                          disk) if host_cache_blocks or disk is not None else None)
        self.pool = BlockPool(num_blocks, enable_caching=enable_block_reuse,
                              on_evict=self._offload if self.host_store is not None else None)
        self.prefixes = PrefixIndex(self.pool, self.host_store, self.windows, tokens_per_block)
        self.null_block = _NO_NULL_BLOCK
        if self.has_windows:
            if num_blocks < 2:
                raise ValueError("a KV cache with sliding-window groups needs at least two "
                                 f"blocks (one is the null block), got {num_blocks}")
            [self.null_block] = self.pool.allocate(1)  # held forever
            for pair in self.slot_caches:  # kernels may load it; it must hold numbers
                for cache in stored_tensors(pair):
                    cache[self.null_block].zero_()
        self.stats = KVCacheStats()
        self._tables: dict[str, BlockTable] = {}
        self._num_reserved = 0
        self._swapped: dict[str, Swapped] = {}
        self._group_blocks = [0] * self.layout.num_groups  # distinct blocks each group holds
        # Tables changed in place since the model runner last asked (request id -> first
        # changed index), and those with blocks or a copy promised for the coming step.
        self._table_changes: dict[str, int] = {}
        self._to_prepare: dict[str, BlockTable] = {}
        # requests that held blocks when the prefix cache was reset: their KV mixes old and
        # new weights, so none of their blocks is ever published
        self._unpublishable: set[str] = set()

    # ---- capacity queries ----

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (the null block aside)."""
        return self.pool.num_blocks - int(self.has_windows)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def layer_groups(self) -> tuple[int, ...]:
        return self.layout.layer_groups

    @property
    def dtype(self) -> torch.dtype:
        return self.kv_caches[0][0].dtype if self.kv_caches else torch.float32

    @property
    def capacity_tokens(self) -> int:
        """Tokens of every layer the cache memory holds (with several groups, as if every
        layer attended fully)."""
        num_layers = len(self.layout.layer_slots)
        return self.num_blocks * self.tokens_per_block * self.layout.num_slots // num_layers

    def max_blocks(self, request: Request) -> int:
        """The most blocks the request holds at once, over all groups."""
        return sum(self._peak_blocks(request, g, 0) for g in range(self.num_groups))

    def fits_ever(self, request: Request) -> bool:
        return self.max_blocks(request) <= self.num_blocks

    def block_ids(self, request: Request) -> list[int]:
        """The request's block table (of the first group; the model runner reads it; do not
        modify)."""
        return self._tables[request.request_id].groups[0]

    def group_block_ids(self, request: Request) -> list[list[int]]:
        """The request's block table of every group (do not modify)."""
        return self._tables[request.request_id].groups

    def group_block_ids_of(self, request_id: str) -> list[list[int]]:
        return self._tables[request_id].groups

    def block_hashes_of(self, request_id: str) -> list[int]:
        """The chained hashes of the request's blocks published so far (do not modify)."""
        table = self._tables.get(request_id)
        return table.block_hashes if table is not None else []

    def take_table_changes(self) -> dict[str, int]:
        """The tables changed in place since the last call (grown, truncated, a block
        copied on write or passed by a window, forked), each with its first changed index:
        the model runner's persistent batch copies only those entries."""
        changes, self._table_changes = self._table_changes, {}
        return changes

    def _mark_changed(self, request_id: str, index: int) -> None:
        changes = self._table_changes
        changes[request_id] = min(index, changes.get(request_id, index))

    # ---- admission and growth (the scheduler asks) ----

    def try_admit(self, request: Request) -> Admission | None:
        """Attach the longest cached prefix (or swapped-out blocks) and, under
        GUARANTEED_NO_EVICT, reserve blocks for the request's whole life; None when there is
        no room."""
        if request.request_id in self._swapped:
            return self._swap_in(request)
        if request.request_id in self._tables:
            raise RuntimeError(f"request id {request.request_id!r} is already admitted")
        if request.kv_import is not None and request.kv_import.is_pending:
            return self._admit_imported(request)
        prefix = self.prefixes.find(request)
        num_computed = len(prefix.block_hashes) * self.tokens_per_block
        on_device = [h.block_id for hits in prefix.hits for h in hits
                     if h is not None and h.block_id is not None]
        num_cached_free = sum(1 for b in on_device if self.pool.is_free(b))
        need = sum(self._admission_need(request, g, num_computed)
                   for g in range(self.num_groups))
        if self._available() < need - len(on_device) + num_cached_free:
            return None
        self.stats.blocks_needed += (request.num_tokens - 1) // self.tokens_per_block
        self.stats.blocks_reused += len(prefix.block_hashes)
        table = BlockTable(self._attach_prefix(prefix.hits),
                            [self._first_live(g, num_computed) for g in range(self.num_groups)],
                            prefix.block_hashes)
        self._tables[request.request_id] = table
        if self.reserve_full_generation:
            self._set_reserved(table, self._future_need(request, table, num_computed))
        return Admission(num_computed)

    def try_grow(self, request: Request, num_new_tokens: int) -> bool:
        """Room for the request's next `num_new_tokens` tokens this step: promised now (from
        its own reservation first), allocated by prepare(); False when there is none."""
        table = self._tables[request.request_id]
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.tokens_per_block)
        num_new = max(0, needed - len(table.groups[0]) - table.num_pending)  # per group
        copy = self._needs_copy(request, table)
        if not num_new and not copy:  # the common case: its blocks have room already
            return True
        groups = self.num_groups
        num_promised = table.num_pending + (table.copy_index is not None)
        extra = max(0, (num_new + copy) * groups - (table.reserved - num_promised * groups))
        if extra > self._available():
            return False
        self._set_reserved(table, table.reserved + extra)
        table.num_pending += num_new
        if copy:
            table.copy_index = request.num_computed_tokens // self.tokens_per_block
        if num_new or copy:
            self._to_prepare[request.request_id] = table
        return True

    # ---- the resource-manager hooks (the loop calls) ----

    def prepare(self, batch: ScheduledBatch) -> None:
        """Allocate the blocks promised for this step (by try_grow)."""
        self.stats.peak_requests = max(self.stats.peak_requests, len(self._tables))
        to_prepare, self._to_prepare = self._to_prepare, {}
        for request_id, table in to_prepare.items():
            if self._tables.get(request_id) is not table:
                continue  # freed since
            if table.copy_index is not None:
                self._mark_changed(request_id, table.copy_index)
                self._copy_on_write(table)
            if table.num_pending:
                self._mark_changed(request_id, len(table.groups[0]))
                for g, blocks in enumerate(table.groups):
                    blocks.extend(self._allocate(g, table.num_pending))
                self._set_reserved(table, table.reserved - table.num_pending * self.num_groups)
                table.num_pending = 0

    def update(self, batch: ScheduledBatch) -> None:
        """The step's tokens are computed: publish newly full blocks for prefix reuse, at
        once, whatever the request does next (it may finish in this very step); window
        groups give back the blocks their window has passed."""
        bs, tables, windows = self.tokens_per_block, self._tables, self.has_windows
        for request in batch.requests:
            table = tables.get(request.request_id)
            if table is None:
                continue
            # (most steps fill no block: one comparison each)
            if min(request.num_computed_tokens, len(request.token_ids)) >= bs * (
                    len(table.block_hashes) + 1):
                self._publish(request, request.num_computed_tokens)
            if windows:
                self._free_behind_windows(request, table)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks wholly past its first `num_tokens` tokens (KV of
        rejected speculative tokens); under a reservation they are promised to it again.
        Window groups lose nothing here: their blocks behind the window were freed only up
        to the tokens known before the drafts (see update)."""
        table = self._tables[request.request_id]
        keep = cdiv(num_tokens, self.tokens_per_block)
        if table.num_pending or len(table.groups[0]) <= keep:
            return
        for g, blocks in enumerate(table.groups):
            self._release(g, [b for b in blocks[keep:] if b != self.null_block])
            del blocks[keep:]
        table.exclusive_index = -1
        self._mark_changed(request.request_id, keep)
        if self.reserve_full_generation:
            self._set_reserved(table, self._future_need(request, table, num_tokens))

    def free(self, request: Request) -> None:
        """Release the request's blocks; the full ones it computed stay reusable (unless it
        failed: a failed step may have left them half written)."""
        self._swapped.pop(request.request_id, None)
        self._table_changes.pop(request.request_id, None)
        if request.request_id not in self._tables:  # never admitted
            return
        if request.error is None:
            self._publish(request, request.num_computed_tokens)
        self._unpublishable.discard(request.request_id)
        table = self._tables.pop(request.request_id)
        for g, blocks in enumerate(table.groups):
            self._release(g, [b for b in blocks if b != self.null_block])
        self._set_reserved(table, 0)

    # ---- how many blocks a group needs ----

    def _first_live(self, group: int, num_computed: int) -> int:
        return first_live_block(self.windows[group], num_computed, self.tokens_per_block)

    def _peak_blocks(self, request: Request, group: int, num_computed: int) -> int:
        """The most blocks `group` holds at once for the rest of the request's life: all of
        its tokens' for full attention; for a window, what the window and one step span
        (the largest step left is the rest of its known tokens, at most max_step_tokens)."""
        bs = self.tokens_per_block
        whole_life = cdiv(request.num_prompt_tokens + request.max_new_tokens, bs)
        window = self.windows[group]
        if window is None:
            return whole_life
        step = max(1, request.num_tokens - num_computed)
        if self.max_step_tokens is not None:
            step = min(step, self.max_step_tokens)
        return min(whole_life, window_peak_blocks(window, step, bs))

    def _admission_need(self, request: Request, group: int, num_computed: int) -> int:
        """Blocks `group` must have room for to admit the request with `num_computed` tokens
        in hand: its whole life's peak under a reservation, else the blocks its known tokens
        span once computed."""
        if self.reserve_full_generation:
            return self._peak_blocks(request, group, num_computed)
        return (cdiv(request.num_tokens, self.tokens_per_block)
                - self._first_live(group, num_computed))

    def _future_need(self, request: Request, table: BlockTable, num_computed: int) -> int:
        """What a reservation must still promise: each group's peak beyond what it holds."""
        return sum(max(0, self._peak_blocks(request, g, num_computed) - table.num_live(g))
                   for g in range(self.num_groups))

    def _free_behind_windows(self, request: Request, table: BlockTable) -> None:
        """Blocks wholly behind a window (as of the tokens computed, drafts not counted: a
        rollback may take those back) go back to the pool; a reservation shrinks to the peak
        still ahead."""
        num_computed = request.num_computed_tokens - len(request.draft_token_ids)
        for g, blocks in enumerate(table.groups):
            first = min(self._first_live(g, num_computed), len(blocks))
            if first > table.num_null[g]:
                self._mark_changed(request.request_id, table.num_null[g])
                self._release(g, blocks[table.num_null[g]:first])
                self.stats.blocks_freed_by_window += first - table.num_null[g]
                blocks[table.num_null[g]:first] = [self.null_block] * (first - table.num_null[g])
                table.num_null[g] = first
        if self.reserve_full_generation and not table.num_pending:
            self._set_reserved(table, self._future_need(request, table, num_computed))

    # ---- internals ----

    def _allocate(self, group: int, num_blocks: int) -> list[int]:
        self._group_blocks[group] += num_blocks
        return self.pool.allocate(num_blocks)

    def _take(self, group: int, block_id: int) -> None:
        """Add a reference to a cached block (found free or held by another request)."""
        self._group_blocks[group] += self.pool.is_free(block_id)
        self.pool.take_cached(block_id)

    def _release(self, group: int, block_ids: list[int]) -> None:
        self.pool.free(block_ids)
        self._group_blocks[group] -= sum(map(self.pool.is_free, block_ids))

    def _available(self) -> int:
        return self.pool.num_free_blocks - self._num_reserved

    def _set_reserved(self, table: BlockTable, num_blocks: int) -> None:
        self._num_reserved += num_blocks - table.reserved
        table.reserved = num_blocks

    def _publish(self, request: Request, num_computed_tokens: int) -> None:
        """Hash and publish the request's full blocks of computed tokens not published yet.
        A token sampled but not yet on the host ends what is known."""
        if request.request_id in self._unpublishable:
            return
        table = self._tables[request.request_id]
        num_full = min(num_computed_tokens, len(request.token_ids)) // self.tokens_per_block
        hashes = table.block_hashes
        for i in range(len(hashes), num_full):
            block_hash = chain_hash(request, hashes[-1] if hashes else None, i,
                                    self.tokens_per_block)
            hashes.append(block_hash)
            for g, blocks in enumerate(table.groups):
                if blocks[i] != self.null_block:
                    self.pool.cache_full_block(blocks[i], group_key(g, block_hash))

    def _attach_prefix(self, hits: list[list[PrefixHit | None]]) -> list[list[int]]:
        # take every device hit before onboarding, which allocates and may evict
        for g, group in enumerate(hits):
            for hit in group:
                if hit is not None and hit.block_id is not None:
                    self._take(g, hit.block_id)
        return [[self.null_block if hit is None else self._onboard(g, hit) for hit in group]
                for g, group in enumerate(hits)]

    def _onboard(self, group: int, hit: PrefixHit) -> int:
        """A hit's block id on the device, its contents brought from host or disk first."""
        if hit.block_id is None:
            [hit.block_id] = self._allocate(group, 1)
            self._write_block(hit.block_id, hit.data)
            self.pool.cache_full_block(hit.block_id, hit.key)
            self.stats.blocks_onboarded += 1
        return hit.block_id

    def _offload(self, block_id: int, block_hash: int) -> None:
        self.host_store.put(block_hash, self._read_block(block_id))
        self.stats.blocks_offloaded += 1

    def _read_block(self, block_id: int) -> torch.Tensor:
        """[num_slots, 2 (1: keys only), tokens_per_block, kv_heads, head_dim]"""
        return torch.stack([torch.stack([cache[block_id] for cache in stored_tensors(pair)])
                            for pair in self.slot_caches])

    def _write_block(self, block_id: int, data: torch.Tensor) -> None:
        data = data.to(self.slot_caches[0][0].device, non_blocking=True)
        for slot, pair in enumerate(self.slot_caches):
            for i, cache in enumerate(stored_tensors(pair)):
                cache[block_id].copy_(data[slot, i])

    def stats_dict(self) -> dict[str, float]:
        out = asdict(self.stats)
        out["hit_rate"] = self.stats.hit_rate
        out["device_evictions"] = self.pool.num_evictions
        out["blocks_free"] = self.pool.num_free_blocks
        out["blocks_total"] = self.num_blocks
        out["host_blocks"] = len(self.host_store) if self.host_store is not None else 0
        disk = self.host_store.next_tier if self.host_store is not None else None
        out["disk_blocks"] = len(disk) if disk is not None else 0
        out.update(self._group_usage())
        return out

    def _group_usage(self) -> dict[str, float]:
        """Per group: its window (0: full attention) and the distinct blocks it holds."""
        out: dict[str, float] = {"num_groups": self.num_groups}
        for g, window in enumerate(self.windows):
            out[f"group{g}_window"] = window or 0
            out[f"group{g}_blocks_used"] = self._group_blocks[g]
        return out

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, in every tier (the weights changed, or the KV memory
        was released); blocks requests hold stay theirs, never to be published."""
        self.pool.forget_cached()
        if self.prefixes.saved_states is not None:
            self.prefixes.saved_states.forget()
        if self.host_store is not None:
            self.host_store.clear()
        self._unpublishable.update(self._tables)

    def close(self) -> None:
        if self.host_store is not None:
            self.host_store.close()
