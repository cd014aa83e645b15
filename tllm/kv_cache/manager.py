"""KV cache manager: the paged K/V tensors, per-request block tables, prefix reuse, and the
GUARANTEED_NO_EVICT admission rule. It is the executor's one resource manager for now."""
from __future__ import annotations

import torch

from tllm.executor.request import Request
from tllm.kv_cache.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns one (key, value) pair of tensors per layer, each shaped
    [num_blocks, tokens_per_block, num_kv_heads, head_dim].

    Admission reserves every block a request could need (prompt + max_new_tokens), so a
    running request never waits for memory and nothing is ever evicted mid-generation.
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 tokens_per_block: int, dtype: torch.dtype, device: torch.device | str,
                 enable_block_reuse: bool = True) -> None:
        self.tokens_per_block = tokens_per_block
        self.pool = BlockPool(num_blocks, enable_caching=enable_block_reuse)
        shape = (num_blocks, tokens_per_block, num_kv_heads, head_dim)
        self.kv_caches = [(torch.empty(shape, dtype=dtype, device=device),
                           torch.empty(shape, dtype=dtype, device=device))
                          for _ in range(num_layers)]
        self._reserved: dict[Request, int] = {}  # blocks each admitted request may still take
        self._num_reserved = 0
        self._block_hashes: dict[Request, list[int]] = {}

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

    def try_admit(self, request: Request) -> bool:
        """Reserve blocks for the request's whole life and attach any cached prefix."""
        cached = self._find_cached_prefix(request)
        num_cached_free = sum(1 for b in cached if self.pool.is_free(b))
        need = self.max_blocks(request) - len(cached) + num_cached_free
        if self.pool.num_free_blocks - self._num_reserved < need:
            return False
        for block_id in cached:
            self.pool.take_cached(block_id)
        request.block_ids = list(cached)
        request.num_computed_tokens = len(cached) * self.tokens_per_block
        self._block_hashes[request] = [self.pool.blocks[b].block_hash for b in cached]
        self._set_reserved(request, self.max_blocks(request) - len(cached))
        return True

    def allocate_slots(self, request: Request, num_new_tokens: int) -> None:
        """Make the block table cover the tokens about to be computed."""
        num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.tokens_per_block)
        num_new_blocks = num_needed - len(request.block_ids)
        if num_new_blocks > 0:
            request.block_ids.extend(self.pool.allocate(num_new_blocks))
            self._set_reserved(request, self._reserved[request] - num_new_blocks)

    def cache_computed_blocks(self, request: Request) -> None:
        """After a step: publish the request's newly filled blocks for prefix reuse."""
        hashes = self._block_hashes.setdefault(request, [])
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.tokens_per_block
        bs = self.tokens_per_block
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            block_hash = hash((parent, tuple(request.token_ids[i * bs:(i + 1) * bs])))
            hashes.append(block_hash)
            self.pool.cache_full_block(request.block_ids[i], block_hash)

    def free(self, request: Request) -> None:
        if request not in self._reserved:  # never admitted
            return
        self.pool.free(request.block_ids)
        request.block_ids = []
        self._set_reserved(request, 0)
        del self._reserved[request]
        self._block_hashes.pop(request, None)

    def _set_reserved(self, request: Request, num_blocks: int) -> None:
        self._num_reserved += num_blocks - self._reserved.get(request, 0)
        self._reserved[request] = num_blocks

    def _find_cached_prefix(self, request: Request) -> list[int]:
        # Prompt logprobs need every prompt position computed; and the last prompt token is
        # always computed, since its logits give the first output token.
        if not self.pool.enable_caching or request.wants_prompt_logprobs:
            return []
        bs = self.tokens_per_block
        block_ids, parent = [], None
        for i in range((request.num_prompt_tokens - 1) // bs):
            parent = hash((parent, tuple(request.prompt_token_ids[i * bs:(i + 1) * bs])))
            block_id = self.pool.lookup(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids
