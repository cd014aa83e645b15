"""KV cache manager: the paged K/V tensors, per-request block tables, prefix reuse across
device/host/disk tiers, swapping for preemption, and admission under the capacity policy.

It is a resource manager (tllm.scheduler.interface): the scheduler asks it to admit a request
(`try_admit`, which answers with the tokens it already holds) and to make room for a step's
tokens (`try_grow`); the loop then calls `prepare(batch)` (blocks are allocated), `update(batch)`
(newly full blocks become reusable) and `free(request)`. Its state is keyed by request id; it
reads requests and never writes them."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from tllm.kv_cache.block_pool import BlockPool
from tllm.kv_cache.offload import DiskBlockStore, HostBlockStore
from tllm.request import PLACEHOLDER, Request
from tllm.scheduler.interface import ResourceManager, ScheduledBatch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class KVCacheStats:
    blocks_needed: int = 0       # full prefix blocks looked up when requests were admitted
    blocks_reused: int = 0       # of those, found in some tier instead of recomputed
    blocks_onboarded: int = 0    # brought back from host memory or disk
    blocks_offloaded: int = 0    # evicted from the device into the host tier
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0

    @property
    def hit_rate(self) -> float:
        return self.blocks_reused / self.blocks_needed if self.blocks_needed else 0.0


@dataclass(frozen=True)
class Admission:
    """What admitting a request decided: how many of its tokens already have their keys and
    values in the blocks it now holds (a cached prefix, or what it had before a swap)."""
    num_computed_tokens: int


@dataclass
class _PrefixHit:
    block_hash: int
    block_id: int | None                 # on the device, or
    data: torch.Tensor | None = None     # contents from the host or disk tier


@dataclass
class _BlockTable:
    """One admitted request's blocks."""
    block_ids: list[int]
    block_hashes: list[int] = field(default_factory=list)  # of its first published blocks
    reserved: int = 0      # blocks promised to it and not allocated yet
    num_pending: int = 0   # of those, blocks this step's prepare() allocates


@dataclass
class _Swapped:
    data: list[torch.Tensor]             # block contents in host memory
    num_computed_tokens: int


class KVCacheManager(ResourceManager):
    """Owns one (key, value) pair of tensors per layer, each shaped
    [num_blocks, tokens_per_block, num_kv_heads, head_dim].

    With `reserve_full_generation` (GUARANTEED_NO_EVICT) admission reserves every block a
    request could need, so a running request never runs out; without it (MAX_UTILIZATION)
    requests are admitted greedily and the scheduler preempts when `try_grow` fails.
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 tokens_per_block: int, dtype: torch.dtype, device: torch.device | str,
                 enable_block_reuse: bool = True, reserve_full_generation: bool = True,
                 host_cache_blocks: int = 0, disk_cache_dir: str | None = None,
                 disk_cache_blocks: int = 0) -> None:
        self.tokens_per_block = tokens_per_block
        self.reserve_full_generation = reserve_full_generation
        shape = (num_blocks, tokens_per_block, num_kv_heads, head_dim)
        self.kv_caches = [(torch.empty(shape, dtype=dtype, device=device),
                           torch.empty(shape, dtype=dtype, device=device))
                          for _ in range(num_layers)]
        self.host_capacity_blocks = host_cache_blocks
        disk = DiskBlockStore(disk_cache_dir, disk_cache_blocks) if disk_cache_dir else None
        self.host_store = (HostBlockStore(host_cache_blocks, torch.device(device).type == "cuda",
                                          disk) if host_cache_blocks or disk is not None else None)
        self.pool = BlockPool(num_blocks, enable_caching=enable_block_reuse,
                              on_evict=self._offload if self.host_store is not None else None)
        self.stats = KVCacheStats()
        self._tables: dict[str, _BlockTable] = {}
        self._num_reserved = 0
        self._swapped: dict[str, _Swapped] = {}

    # ---- capacity queries ----

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self.kv_caches[0][0].dtype if self.kv_caches else torch.float32

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.tokens_per_block

    def max_blocks(self, request: Request) -> int:
        return cdiv(request.num_prompt_tokens + request.max_new_tokens, self.tokens_per_block)

    def fits_ever(self, request: Request) -> bool:
        return self.max_blocks(request) <= self.pool.num_blocks

    def block_ids(self, request: Request) -> list[int]:
        """The request's block table (the model runner reads it; do not modify)."""
        return self._tables[request.request_id].block_ids

    # ---- admission and growth (the scheduler asks) ----

    def try_admit(self, request: Request) -> Admission | None:
        """Attach the longest cached prefix (or swapped-out blocks) and, under
        GUARANTEED_NO_EVICT, reserve blocks for the request's whole life; None when there is
        no room."""
        if request.request_id in self._swapped:
            return self._swap_in(request)
        if request.request_id in self._tables:
            raise RuntimeError(f"request id {request.request_id!r} is already admitted")
        hits = self._find_cached_prefix(request)
        on_device = [h.block_id for h in hits if h.block_id is not None]
        num_cached_free = sum(1 for b in on_device if self.pool.is_free(b))
        total = (self.max_blocks(request) if self.reserve_full_generation
                 else cdiv(request.num_tokens, self.tokens_per_block))
        if self._available() < total - len(on_device) + num_cached_free:
            return None
        self.stats.blocks_needed += (request.num_tokens - 1) // self.tokens_per_block
        self.stats.blocks_reused += len(hits)
        table = _BlockTable(self._attach_prefix(hits), [h.block_hash for h in hits])
        self._tables[request.request_id] = table
        reserve = self.max_blocks(request) - len(hits) if self.reserve_full_generation else 0
        self._set_reserved(table, reserve)
        return Admission(len(hits) * self.tokens_per_block)

    def try_grow(self, request: Request, num_new_tokens: int) -> bool:
        """Room for the request's next `num_new_tokens` tokens this step: promised now (from
        its own reservation first), allocated by prepare(); False when there is none."""
        table = self._tables[request.request_id]
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.tokens_per_block)
        num_new = max(0, needed - len(table.block_ids) - table.num_pending)
        extra = max(0, num_new - (table.reserved - table.num_pending))
        if extra > self._available():
            return False
        self._set_reserved(table, table.reserved + extra)
        table.num_pending += num_new
        return True

    # ---- the resource-manager hooks (the loop calls) ----

    def prepare(self, batch: ScheduledBatch) -> None:
        """Allocate the blocks promised for this step."""
        for request in batch.requests:
            table = self._tables[request.request_id]
            if table.num_pending:
                table.block_ids.extend(self.pool.allocate(table.num_pending))
                self._set_reserved(table, table.reserved - table.num_pending)
                table.num_pending = 0

    def update(self, batch: ScheduledBatch) -> None:
        """The step's tokens are computed: publish newly full blocks for prefix reuse, at
        once, whatever the request does next (it may finish in this very step)."""
        for request in batch.requests:
            if request.request_id in self._tables:
                self._publish(request, request.num_computed_tokens)

    def free(self, request: Request) -> None:
        """Release the request's blocks; the full ones it computed stay reusable (unless it
        failed: a failed step may have left them half written)."""
        self._swapped.pop(request.request_id, None)
        if request.request_id not in self._tables:  # never admitted
            return
        if request.error is None:
            self._publish(request, request.num_computed_tokens)
        table = self._tables.pop(request.request_id)
        self.pool.free(table.block_ids)
        self._set_reserved(table, 0)

    # ---- preemption ----

    def swap_out(self, request: Request) -> bool:
        """Move a request's blocks to host memory and free them on the device; False when the
        host tier has no room (the caller then recomputes instead)."""
        block_ids = self.block_ids(request)
        num_swapped = sum(len(s.data) for s in self._swapped.values())
        if num_swapped + len(block_ids) > self.host_capacity_blocks:
            return False
        data = [self._read_block(b).to("cpu") for b in block_ids]
        self.free(request)
        self._swapped[request.request_id] = _Swapped(data, request.num_computed_tokens)
        self.stats.blocks_swapped_out += len(data)
        return True

    def _swap_in(self, request: Request) -> Admission | None:
        swapped = self._swapped[request.request_id]
        num_blocks = len(swapped.data)
        reserve = self.max_blocks(request) - num_blocks if self.reserve_full_generation else 0
        # without a reservation, room for the tokens it computes next must be there now
        room = reserve or max(0, cdiv(request.num_tokens, self.tokens_per_block) - num_blocks)
        if self._available() < num_blocks + room:
            return None
        del self._swapped[request.request_id]
        table = _BlockTable(self.pool.allocate(num_blocks))
        for block_id, contents in zip(table.block_ids, swapped.data):
            self._write_block(block_id, contents)
        self._tables[request.request_id] = table
        self._set_reserved(table, reserve)
        self._publish(request, swapped.num_computed_tokens)
        self.stats.blocks_swapped_in += num_blocks
        return Admission(swapped.num_computed_tokens)

    # ---- internals ----

    def _available(self) -> int:
        return self.pool.num_free_blocks - self._num_reserved

    def _set_reserved(self, table: _BlockTable, num_blocks: int) -> None:
        self._num_reserved += num_blocks - table.reserved
        table.reserved = num_blocks

    def _publish(self, request: Request, num_computed_tokens: int) -> None:
        """Hash and publish the request's full blocks of computed tokens not published yet.
        A token sampled but not yet on the host (a placeholder) ends what is known."""
        table = self._tables[request.request_id]
        num_known = request.num_tokens - int(request.token_ids[-1] == PLACEHOLDER)
        num_full = min(num_computed_tokens, num_known) // self.tokens_per_block
        hashes = table.block_hashes
        for i in range(len(hashes), num_full):
            block_hash = self._chain_hash(request, hashes[-1] if hashes else None, i)
            hashes.append(block_hash)
            self.pool.cache_full_block(table.block_ids[i], block_hash)

    def _chain_hash(self, request: Request, parent: int | None, index: int) -> int:
        if parent is None and request.cache_salt is not None:
            parent = hash(("salt", request.cache_salt))
        bs = self.tokens_per_block
        return hash((parent, tuple(request.token_ids[index * bs:(index + 1) * bs])))

    def _find_cached_prefix(self, request: Request) -> list[_PrefixHit]:
        # Prompt logprobs need every prompt position computed; and the last token is always
        # computed, since its logits give the next token.
        if not self.pool.enable_caching or request.wants_prompt_logprobs:
            return []
        hits: list[_PrefixHit] = []
        parent = None
        for i in range((request.num_tokens - 1) // self.tokens_per_block):
            parent = self._chain_hash(request, parent, i)
            block_id = self.pool.lookup(parent)
            if block_id is not None:
                hits.append(_PrefixHit(parent, block_id))
                continue
            found = self.host_store.get(parent) if self.host_store is not None else None
            if found is None:
                break
            hits.append(_PrefixHit(parent, None, found[0]))
        return hits

    def _attach_prefix(self, hits: list[_PrefixHit]) -> list[int]:
        for hit in hits:
            if hit.block_id is not None:
                self.pool.take_cached(hit.block_id)
        block_ids = []
        for hit in hits:
            if hit.block_id is None:  # onboard from host or disk
                [hit.block_id] = self.pool.allocate(1)
                self._write_block(hit.block_id, hit.data)
                self.pool.cache_full_block(hit.block_id, hit.block_hash)
                self.stats.blocks_onboarded += 1
            block_ids.append(hit.block_id)
        return block_ids

    def _offload(self, block_id: int, block_hash: int) -> None:
        self.host_store.put(block_hash, self._read_block(block_id))
        self.stats.blocks_offloaded += 1

    def _read_block(self, block_id: int) -> torch.Tensor:
        """[num_layers, 2, tokens_per_block, kv_heads, head_dim]"""
        return torch.stack([torch.stack((k[block_id], v[block_id])) for k, v in self.kv_caches])

    def _write_block(self, block_id: int, data: torch.Tensor) -> None:
        data = data.to(self.kv_caches[0][0].device, non_blocking=True)
        for layer, (k, v) in enumerate(self.kv_caches):
            k[block_id].copy_(data[layer, 0])
            v[block_id].copy_(data[layer, 1])

    def stats_dict(self) -> dict[str, float]:
        out = asdict(self.stats)
        out["hit_rate"] = self.stats.hit_rate
        out["device_evictions"] = self.pool.num_evictions
        out["blocks_free"] = self.pool.num_free_blocks
        out["blocks_total"] = self.pool.num_blocks
        out["host_blocks"] = len(self.host_store) if self.host_store is not None else 0
        disk = self.host_store.next_tier if self.host_store is not None else None
        out["disk_blocks"] = len(disk) if disk is not None else 0
        return out

    def close(self) -> None:
        if self.host_store is not None:
            self.host_store.close()
