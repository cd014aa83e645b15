"""Property-based test: random sequences of admit / extend / fork / finish / abort / swap
against the KV cache manager keep its invariants."""
from __future__ import annotations

import itertools
from collections import Counter

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tllm.kv_cache.manager import KVCacheManager
from tllm.request import Request
from tllm.sampling_params import SamplingParams
from tllm.scheduler.interface import ScheduledBatch

BLOCK = 4
_ids = itertools.count()  # the manager keys its state by request id
PROMPTS = st.lists(st.integers(0, 3), min_size=1, max_size=20)  # few tokens: many shared prefixes


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=24,
                                 tokens_per_block=BLOCK, dtype=torch.float32, device="cpu",
                                 reserve_full_generation=False, host_cache_blocks=8)
        self.live: list[Request] = []
        self.swapped: list[Request] = []

    def _admit(self, request: Request) -> bool:
        admission = self.kv.try_admit(request)
        if admission is not None:
            request.num_computed_tokens = admission.num_computed_tokens
            self.live.append(request)
        return admission is not None

    @rule(prompt=PROMPTS, max_new=st.integers(1, 8))
    def admit(self, prompt, max_new):
        self._admit(Request(f"r{next(_ids)}", prompt, SamplingParams(), max_new_tokens=max_new))

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), num=st.integers(1, 9), token=st.integers(0, 3))
    def extend(self, index, num, token):
        request = self.live[index % len(self.live)]
        num = min(num, request.num_tokens - request.num_computed_tokens) or 1
        if request.num_computed_tokens + num > request.num_tokens:
            request.append_token(token)  # a sampled token to compute next
        if self.kv.try_grow(request, num):
            batch = ScheduledBatch([request], [num])
            self.kv.prepare(batch)
            request.num_computed_tokens += num
            self.kv.update(batch)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def fork(self, index):  # a parallel sample of the same prompt reuses the cached blocks
        leader = self.live[index % len(self.live)]
        self._admit(Request(f"s{next(_ids)}", leader.prompt_token_ids, SamplingParams(), max_new_tokens=4))

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def finish_or_abort(self, index):
        self.kv.free(self.live.pop(index % len(self.live)))

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def swap_out(self, index):
        request = self.live[index % len(self.live)]
        if self.kv.swap_out(request):
            self.live.remove(request)
            self.swapped.append(request)

    @precondition(lambda self: self.swapped)
    @rule()
    def swap_in(self):
        request = self.swapped[0]
        if self._admit(request):
            self.swapped.pop(0)

    @invariant()
    def ref_counts_equal_live_references(self):
        held = Counter(b for r in self.live for b in self.kv.block_ids(r))
        for block in self.kv.pool.blocks:
            assert block.ref_count == held.get(block.block_id, 0)
            assert self.kv.pool.is_free(block.block_id) == (block.ref_count == 0)
        tables = [self.kv.block_ids(r) for r in self.live]
        assert all(len(set(t)) == len(t) for t in tables)

    @invariant()
    def block_tables_cover_computed_tokens(self):
        for r in self.live:
            assert len(self.kv.block_ids(r)) * BLOCK >= r.num_computed_tokens

    def teardown(self):
        for request in self.live + self.swapped:
            self.kv.free(request)
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert self.kv._num_reserved == 0


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
