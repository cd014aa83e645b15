"""The scheduler: which requests run this step, and how many new tokens each computes.

There are no prefill and decode phases. A request has `num_computed_tokens` and
`num_tokens`; each step gives it up to the difference, within the token budget
(`max_num_tokens`) and the batch size. Long prompts are chunked; waiting requests join the
running batch as soon as budget and KV blocks allow (in-flight batching)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tllm.request import Request, RequestState
from tllm.kv_cache.manager import KVCacheManager


@dataclass
class ScheduledBatch:
    """The requests of one step, each with the number of tokens it computes."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)

    def add(self, request: Request, num_tokens: int) -> None:
        self.requests.append(request)
        self.num_scheduled_tokens.append(num_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    """FCFS scheduling. Capacity is the KV cache manager's business: under
    GUARANTEED_NO_EVICT it reserves at admission and allocation never fails; under
    MAX_UTILIZATION, when a running request cannot grow, the newest running requests are
    preempted (recomputed later, or swapped to host memory) until it can."""

    def __init__(self, kv_cache: KVCacheManager, *, max_batch_size: int, max_num_tokens: int,
                 enable_chunked_prefill: bool, preemption_mode: str = "recompute",
                 num_micro_batches: int = 1) -> None:
        self.kv_cache = kv_cache
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        # Pipeline parallelism keeps several micro-batches in flight: each step takes a
        # share of the requests and skips those still in the pipeline.
        self.num_micro_batches = num_micro_batches
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._step_limit = self._micro_batch_limit()
        budget = self._schedule_running(batch, self.max_num_tokens)
        self._admit_waiting(batch, budget)
        return batch

    def _micro_batch_limit(self) -> int:
        if self.num_micro_batches == 1:
            return self.max_batch_size
        total = min(len(self.running) + len(self.waiting), self.max_batch_size)
        return max(1, -(-total // self.num_micro_batches))

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and len(batch) < self._step_limit:
            request = self.running[i]
            num_new = 0 if request.in_pipeline else self._num_new_tokens(request, budget)
            if num_new == 0:
                i += 1
                continue
            if not self._make_room(request, num_new):
                break  # the request preempted itself: it was the newest
            self.kv_cache.allocate_slots(request, num_new)
            batch.add(request, num_new)
            budget -= num_new
            i += 1
        return budget

    def _make_room(self, request: Request, num_new: int) -> bool:
        """Preempt the newest running requests until `request` can grow; False if it had to
        preempt `request` itself."""
        while not self.kv_cache.can_allocate(request, num_new):
            victims = [r for r in self.running if not r.in_pipeline or r is request]
            victim = victims[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        if not (self.preemption_mode == "swap" and self.kv_cache.swap_out(request)):
            self.kv_cache.free(request)
            request.num_computed_tokens = 0  # recompute prompt and outputs when readmitted
        request.state = RequestState.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        skipped: list[Request] = []
        while (self.waiting and budget > 0 and len(self.running) < self.max_batch_size
               and len(batch) < self._step_limit):
            request = self.waiting[0]
            if not self._leader_ready(request):
                skipped.append(self.waiting.popleft())
                continue
            if not self.kv_cache.try_admit(request):
                break
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:  # whole prompt does not fit the budget (no chunking)
                self.kv_cache.free(request)
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.state = RequestState.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            self.kv_cache.allocate_slots(request, num_new)
            batch.add(request, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        if request.num_output_tokens >= request.max_new_tokens:
            return 0  # its last token is in flight: it finishes once that reaches the host
        num_new = request.num_tokens - request.num_computed_tokens
        if num_new > budget:
            return budget if self.enable_chunked_prefill else 0
        return num_new

    @staticmethod
    def _leader_ready(request: Request) -> bool:
        leader = request.prefix_leader
        return leader is None or leader.is_prompt_done or leader.is_finished

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request and return its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request)
