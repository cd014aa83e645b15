"""Prefix reuse lookups: the chained hash of each full block of a request's tokens, the cache
key of a block in a KV cache group, and the longest cached prefix a request can start from,
across the device pool and the host/disk tiers.

A full-attention group needs every block of the prefix; a sliding-window group only the
blocks within its window of the prefix's end (the rest stand as the null block)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tllm.kv_cache.block_pool import BlockPool
from tllm.kv_cache.groups import first_live_block
from tllm.kv_cache.offload import HostBlockStore
from tllm.request import Request


def chain_hash(request: Request, parent: int | None, index: int, tokens_per_block: int) -> int:
    """Block `index` of the request's tokens, chained with the hash of every block before."""
    if parent is None:
        parent = _first_parent(request)
    bs = tokens_per_block
    tokens = tuple(request.token_ids[index * bs:(index + 1) * bs])
    multimodal = getattr(request, "multimodal", None)
    if multimodal is not None:  # images' placeholders are alike: their contents differ
        images = multimodal.hashes_in(index * bs, (index + 1) * bs)
        if images:
            return hash((parent, tokens, images))
    return hash((parent, tokens))


def _first_parent(request: Request) -> int | None:
    """What the first block chains from: the cache salt and the LoRA adapter, when set (a
    drafter's view of a request has no adapter: the draft model runs without one)."""
    adapter = getattr(request, "lora_request", None)
    if request.cache_salt is None and adapter is None:
        return None
    return hash(("salt", request.cache_salt, adapter))  # a LoRARequest hashes by value


def group_key(group: int, block_hash: int) -> int:
    """A block's cache key: its chained hash, tagged with its group (the first group's is
    the bare hash, as with one group)."""
    return block_hash if group == 0 else hash((block_hash, group))


@dataclass
class PrefixHit:
    key: int                             # the block's cache key
    block_id: int | None                 # on the device, or
    data: torch.Tensor | None = None     # contents from the host or disk tier


@dataclass
class CachedPrefix:
    """A cached prefix: its blocks' hashes, and per group the blocks to attach (None where
    a window has passed: the null block)."""
    block_hashes: list[int]
    hits: list[list[PrefixHit | None]]


class PrefixIndex:
    """Finds cached prefixes in the pool (and the host tier, when there is one)."""

    def __init__(self, pool: BlockPool, host_store: HostBlockStore | None,
                 windows: list[int | None], tokens_per_block: int) -> None:
        self.pool = pool
        self.host_store = host_store
        self.windows = windows
        self.tokens_per_block = tokens_per_block
        # a model with state-space layers: a prefix must end on a block whose state was
        # saved (kv_cache/state_checkpoints.py: `has(block_hash)`)
        self.saved_states = None

    def find(self, request: Request) -> CachedPrefix:
        """The longest prefix of whole blocks every group holds in some tier."""
        # Prompt logprobs need every prompt position computed; and the last token is always
        # computed, since its logits give the next token.
        if not self.pool.enable_caching or request.wants_prompt_logprobs:
            return CachedPrefix([], [[] for _ in self.windows])
        bs = self.tokens_per_block
        hashes: list[int] = []
        num_hit = (request.num_tokens - 1) // bs
        full = [g for g, w in enumerate(self.windows) if w is None]
        for i in range(num_hit):
            hashes.append(chain_hash(request, hashes[-1] if hashes else None, i, bs))
            if not all(self._is_cached(g, hashes[i]) for g in full):
                num_hit = i
                break
        num_hit = self._hit_end(hashes, num_hit)
        hits = [[self._hit(g, hashes[i]) if i >= first_live_block(w, num_hit * bs, bs)
                 else None for i in range(num_hit)] for g, w in enumerate(self.windows)]
        return CachedPrefix(hashes[:num_hit], hits)

    def _hit_end(self, hashes: list[int], num_hit: int) -> int:
        """The longest prefix of at most `num_hit` blocks that every window and, with
        state-space layers, a saved state allow (each cut may call for the other)."""
        while True:
            end = self._window_hit_end(hashes, num_hit)
            if self.saved_states is not None:
                while end > 0 and not self.saved_states.has(hashes[end - 1]):
                    end -= 1
            if end == num_hit:
                return end
            num_hit = end

    def _window_hit_end(self, hashes: list[int], num_hit: int) -> int:
        """The longest prefix of at most `num_hit` blocks whose blocks within each window of
        its end are all cached (a miss at block i leaves only prefixes of i blocks or less)."""
        windows = [(g, w) for g, w in enumerate(self.windows) if w is not None]
        while num_hit > 0 and windows:
            shortest = num_hit
            for g, window in windows:
                first = first_live_block(window, num_hit * self.tokens_per_block,
                                         self.tokens_per_block)
                for i in range(num_hit - 1, first - 1, -1):
                    if not self._is_cached(g, hashes[i]):
                        shortest = min(shortest, i)
                        break
            if shortest == num_hit:
                break
            num_hit = shortest
        return num_hit

    def _is_cached(self, group: int, block_hash: int) -> bool:
        key = group_key(group, block_hash)
        return (self.pool.lookup(key) is not None
                or (self.host_store is not None and key in self.host_store))

    def _hit(self, group: int, block_hash: int) -> PrefixHit:
        key = group_key(group, block_hash)
        block_id = self.pool.lookup(key)
        if block_id is not None:
            return PrefixHit(key, block_id)
        found = self.host_store.get(key)
        if found is None:
            raise RuntimeError(f"KV block {key:x} left the host tier while being looked up")
        return PrefixHit(key, None, found[0])
