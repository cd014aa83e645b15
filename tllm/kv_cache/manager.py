"""KV cache manager: the paged K/V tensors, per-request block tables, prefix reuse across
device/host/disk tiers, swapping for preemption, and admission under the capacity policy.
It is the executor's one resource manager for now."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from tllm.request import Request
from tllm.kv_cache.block_pool import BlockPool
from tllm.kv_cache.offload import DiskBlockStore, HostBlockStore


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


@dataclass
class _PrefixHit:
    block_hash: int
    block_id: int | None                 # on the device, or
    data: torch.Tensor | None = None     # contents from the host or disk tier


class KVCacheManager:
    """Owns one (key, value) pair of tensors per layer, each shaped
    [num_blocks, tokens_per_block, num_kv_heads, head_dim].

    With `reserve_full_generation` (GUARANTEED_NO_EVICT) admission reserves every block a
    request could need, so a running request never runs out; without it (MAX_UTILIZATION)
    requests are admitted greedily and the scheduler preempts when `can_allocate` fails.
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
        self._reserved: dict[Request, int] = {}  # blocks each admitted request may still take
        self._num_reserved = 0
        self._block_hashes: dict[Request, list[int]] = {}
        self._swapped: dict[Request, list[torch.Tensor]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def max_blocks(self, request: Request) -> int:
        return cdiv(request.num_prompt_tokens + request.max_new_tokens, self.tokens_per_block)

    def fits_ever(self, request: Request) -> bool:
        return self.max_blocks(request) <= self.pool.num_blocks

    # ---- admission and growth ----

    def try_admit(self, request: Request) -> bool:
        """Attach the longest cached prefix (or swapped-out blocks) and, under
        GUARANTEED_NO_EVICT, reserve blocks for the request's whole life."""
        if request in self._swapped:
            return self._swap_in(request)
        hits = self._find_cached_prefix(request)
        on_device = [h.block_id for h in hits if h.block_id is not None]
        num_cached_free = sum(1 for b in on_device if self.pool.is_free(b))
        total = (self.max_blocks(request) if self.reserve_full_generation
                 else cdiv(request.num_tokens, self.tokens_per_block))
        if self._available() < total - len(on_device) + num_cached_free:
            return False
        self.stats.blocks_needed += (request.num_tokens - 1) // self.tokens_per_block
        self.stats.blocks_reused += len(hits)
        request.block_ids = self._attach_prefix(hits)
        request.num_computed_tokens = len(hits) * self.tokens_per_block
        self._block_hashes[request] = [h.block_hash for h in hits]
        reserve = self.max_blocks(request) - len(hits) if self.reserve_full_generation else 0
        self._set_reserved(request, reserve)
        return True

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        own = self._reserved.get(request, 0)
        return self._num_new_blocks(request, num_new_tokens) <= self._available() + own

    def allocate_slots(self, request: Request, num_new_tokens: int) -> None:
        """Make the block table cover the tokens about to be computed."""
        num_new_blocks = self._num_new_blocks(request, num_new_tokens)
        if num_new_blocks > 0:
            request.block_ids.extend(self.pool.allocate(num_new_blocks))
            self._set_reserved(request, max(0, self._reserved[request] - num_new_blocks))

    def cache_computed_blocks(self, request: Request) -> None:
        """After a step: publish the request's newly filled blocks for prefix reuse."""
        hashes = self._block_hashes.setdefault(request, [])
        bs = self.tokens_per_block
        num_full = min(request.num_computed_tokens, request.num_tokens) // bs
        for i in range(len(hashes), num_full):
            block_hash = self._chain_hash(request, hashes[-1] if hashes else None, i)
            hashes.append(block_hash)
            self.pool.cache_full_block(request.block_ids[i], block_hash)

    def free(self, request: Request) -> None:
        self._swapped.pop(request, None)
        if request not in self._reserved:  # never admitted
            return
        self.pool.free(request.block_ids)
        request.block_ids = []
        self._set_reserved(request, 0)
        del self._reserved[request]
        self._block_hashes.pop(request, None)

    # ---- preemption ----

    def swap_out(self, request: Request) -> bool:
        """Move a request's blocks to host memory and free them on the device; False when the
        host tier has no room (the caller then recomputes instead)."""
        num_swapped = sum(len(blocks) for blocks in self._swapped.values())
        if num_swapped + len(request.block_ids) > self.host_capacity_blocks:
            return False
        data = [self._read_block(b).to("cpu") for b in request.block_ids]
        num_computed = request.num_computed_tokens
        self.free(request)
        request.num_computed_tokens = num_computed
        self._swapped[request] = data
        self.stats.blocks_swapped_out += len(data)
        return True

    def _swap_in(self, request: Request) -> bool:
        data = self._swapped[request]
        reserve = self.max_blocks(request) - len(data) if self.reserve_full_generation else 0
        # without a reservation, room for the tokens it computes next must be there now
        room = reserve or max(0, cdiv(request.num_tokens, self.tokens_per_block) - len(data))
        if self._available() < len(data) + room:
            return False
        del self._swapped[request]
        request.block_ids = self.pool.allocate(len(data))
        for block_id, contents in zip(request.block_ids, data):
            self._write_block(block_id, contents)
        self._set_reserved(request, reserve)
        self._block_hashes[request] = []
        self.cache_computed_blocks(request)
        self.stats.blocks_swapped_in += len(data)
        return True

    # ---- internals ----

    def _available(self) -> int:
        return self.pool.num_free_blocks - self._num_reserved

    def _num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.tokens_per_block)
        return max(0, needed - len(request.block_ids))

    def _set_reserved(self, request: Request, num_blocks: int) -> None:
        self._num_reserved += num_blocks - self._reserved.get(request, 0)
        self._reserved[request] = num_blocks

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
