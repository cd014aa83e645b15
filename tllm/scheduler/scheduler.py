"""The scheduler: which requests run this step, and how many new tokens each computes. It
alone moves a request's progress (`num_computed_tokens`): forward after a step, back to what
the KV cache still holds on preemption, back by the rejected tokens of a speculative step.

There are no prefill and decode phases. A request has `num_computed_tokens` and
`num_tokens`; each step gives it up to the difference, within the token budget
(`max_num_tokens`) and the batch size. Long prompts are chunked; waiting requests join the
running batch as soon as budget and KV blocks allow (in-flight batching). The policy
(scheduler/policy.py) orders the waiting queue (FCFS or priority), picks preemption
victims, and may hold each step (or its prefill chunks) to a smaller token budget that
serves decodes first (scheduler/decode_first.py)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from tllm.request import Request, RequestState
from tllm.scheduler.beam_group import BeamGroupScheduling
from tllm.scheduler.decode_first import DecodeFirstScheduling
from tllm.scheduler.interface import ScheduledBatch
from tllm.scheduler.policy import SchedulingPolicy

if TYPE_CHECKING:
    from tllm.kv_cache.manager import KVCacheManager

__all__ = ["ScheduledBatch", "Scheduler"]


class Scheduler(BeamGroupScheduling, DecodeFirstScheduling):
    """FCFS (or priority) scheduling. Capacity is the KV cache manager's business: under
    GUARANTEED_NO_EVICT it reserves at admission and growth never fails; under
    MAX_UTILIZATION, when a running request cannot grow, the newest running requests are
    preempted (recomputed later, or swapped to host memory) until it can."""

    def __init__(self, kv_cache: KVCacheManager, *, max_batch_size: int, max_num_tokens: int,
                 enable_chunked_prefill: bool, preemption_mode: str = "recompute",
                 num_micro_batches: int = 1,
                 policy: SchedulingPolicy | None = None) -> None:
        self.policy = policy or SchedulingPolicy()
        if self.policy.protects_decodes and not enable_chunked_prefill:
            raise ValueError("scheduler_config.step_token_budget / prefill_token_budget "
                             "need chunked prefill (enable_chunked_prefill=True)")
        self.kv_cache = kv_cache
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        # Pipeline parallelism keeps several micro-batches in flight: each step takes a
        # share of the requests and skips those still in the pipeline (held).
        self.num_micro_batches = num_micro_batches
        self.waiting = self.policy.new_waiting_queue()
        self.running: list[Request] = []
        self._held: set[Request] = set()
        self._batch = ScheduledBatch()  # the step being scheduled
        self._beam_holds: dict[Request, ScheduledBatch] = {}  # beams sampling in that step
        self.num_preemptions = 0
        # Resources besides KV blocks a request needs to run (LoRA adapter slots): each has
        # try_acquire(request) -> bool at admission and release(request) on preemption.
        self.admission_gates: list = []

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- progress ----

    def advance(self, batch: ScheduledBatch, hold: bool = False) -> None:
        """The batch's tokens are computed (or launched); with `hold`, its requests sit out
        scheduling until `release` (their next token comes back with the step)."""
        for request, num_new in zip(batch.requests, batch.num_scheduled_tokens):
            request.num_computed_tokens += num_new
        if hold:
            self._held.update(batch.requests)
        else:
            self._hold_sampling_beams(batch)

    def release(self, batch: ScheduledBatch) -> None:
        self._held.difference_update(batch.requests)
        self._release_beams(batch)

    def rollback(self, request: Request, num_tokens: int) -> None:
        """Forget the last `num_tokens` computed tokens (speculative tokens the target
        rejected); the KV blocks wholly past what stays computed go back to the pool, the
        entries left in the last block are overwritten when those positions are computed
        again."""
        if not 0 <= num_tokens <= request.num_computed_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of "
                             f"{request.num_computed_tokens} computed tokens")
        request.num_computed_tokens -= num_tokens
        if num_tokens:
            self.kv_cache.truncate(request, request.num_computed_tokens)

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request (the loop frees its resources)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._held.discard(request)
        self._beam_holds.pop(request, None)

    # ---- one step ----

    def schedule(self) -> ScheduledBatch:
        """This step's requests and tokens; a request with drafts gets 1 + len(drafts) (its
        drafts shortened to the budget, or dropped), one left out keeps none."""
        batch = self._batch = ScheduledBatch()
        self._step_limit = self._micro_batch_limit()
        if self.policy.step_token_budget is not None:
            budget = self._schedule_decodes_first(batch)
        elif self.policy.prefill_token_budget is not None:
            budget = self._schedule_prefill_capped(batch)
        else:
            budget = self._schedule_running(batch, self.max_num_tokens)
        self._admit_waiting(batch, budget)
        if len(batch) < len(self.running):
            scheduled = set(map(id, batch.requests))
            for request in self.running:
                if request.draft_token_ids and id(request) not in scheduled:
                    request.clear_drafts()
        return batch

    def _micro_batch_limit(self) -> int:
        if self.num_micro_batches == 1:
            return self.max_batch_size
        total = min(len(self.running) + len(self.waiting), self.max_batch_size)
        return max(1, -(-total // self.num_micro_batches))

    def _schedule_running(self, batch: ScheduledBatch, budget: int,
                          pick: Callable[[Request], bool] | None = None) -> int:
        """Running requests (those `pick` selects) in admission order; the budget left. One
        preempted while this runs (to make room for another) is passed over. (The loop
        runs over every running request each step: it keeps the common case short.)"""
        running, held, limit = RequestState.RUNNING, self._held, self._step_limit
        try_grow = self.kv_cache.try_grow
        scheduled, counts = batch.requests, batch.num_scheduled_tokens
        for request in list(self.running):
            if len(scheduled) >= limit:
                break
            if request.state is not running or (pick is not None and not pick(request)):
                continue
            group = request.beam_group
            if group is not None:
                if request is group.requests[0]:
                    budget = self._schedule_beam_group(batch, self.running.index(request),
                                                       budget)[1]
                continue
            if request in held:
                continue
            num_tokens = len(request.token_ids) + request.num_in_flight
            if (num_tokens - request.num_computed_tokens == 1 and budget
                    and not request.draft_token_ids
                    and num_tokens - len(request.prompt_token_ids) < request.max_new_tokens):
                num_new = 1  # a decode (the common case, inline)
            else:
                num_new = self._num_new_tokens(request, budget)
                if num_new == 0:
                    continue
            if request.draft_token_ids and not try_grow(request, num_new):
                request.clear_drafts()  # no room for the drafts: decode one token
                num_new = self._num_new_tokens(request, budget)
            # else it preempted itself
            if try_grow(request, num_new) or self._make_room(request, num_new):
                scheduled.append(request)
                counts.append(num_new)
                budget -= num_new
        return budget

    def _make_room(self, request: Request, num_new: int) -> bool:
        """Preempt running requests (the policy's victims: the newest, or the lowest
        priority) until `request` can grow; False if it had to preempt `request` itself. A
        request already in this step's batch is never the victim."""
        while not self.kv_cache.try_grow(request, num_new):
            in_step = set(map(id, self._batch.requests))
            victims = [r for r in self.running if r is request
                       or not (self._is_held(r) or _is_in(r, in_step))]
            victim = self.policy.preemption_victim(victims)
            self._preempt(victim)
            if victim is request or request.state is RequestState.WAITING:
                return False
        return True

    def _is_held(self, request: Request) -> bool:
        group = request.beam_group
        if group is None:
            return request in self._held
        return any(r in self._held or r in self._beam_holds for r in group.requests)

    def _preempt(self, request: Request) -> None:
        if request.beam_group is not None:  # a beam group is preempted as a whole
            for member in reversed(request.beam_group.requests):
                self._preempt_one(member)
        else:
            self._preempt_one(request)

    def _preempt_one(self, request: Request) -> None:
        self.running.remove(request)
        self._release_gates(request)
        request.clear_drafts()
        if not (self.preemption_mode == "swap" and self.kv_cache.swap_out(request)):
            self.kv_cache.free(request)
            request.num_computed_tokens = 0  # recompute prompt and outputs when readmitted
        request.state = RequestState.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        self._batch.preempted.append(request)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        skipped: list[Request] = []
        while (self.waiting and budget > 0 and len(self.running) < self.max_batch_size
               and len(batch) < self._step_limit):
            request = self.waiting[0]
            if request.beam_group is not None:
                num_new = self._admit_beam_group(batch, budget)
                if num_new is None:
                    break
                budget -= num_new
                continue
            if not self._leader_ready(request) or not self._acquire_gates(request):
                skipped.append(self.waiting.popleft())
                continue
            num_new = self._try_admit(request, budget)
            if num_new == 0:
                self._release_gates(request)
                break
            self.waiting.popleft()
            request.state = RequestState.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            batch.add(request, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _try_admit(self, request: Request, budget: int) -> int:
        """Admit the request with room for what it computes this step; returns how many
        tokens that is, or 0 when it stays waiting (its admission undone)."""
        admission = self.kv_cache.try_admit(request)
        if admission is None:
            return 0
        request.num_computed_tokens = admission.num_computed_tokens
        num_new = self._num_new_tokens(request, budget)
        if num_new and self.kv_cache.try_grow(request, num_new):
            return num_new
        self.kv_cache.free(request)  # the whole prompt does not fit the budget (no chunking)
        request.num_computed_tokens = 0
        return 0

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        num_tokens = len(request.token_ids) + request.num_in_flight
        if num_tokens - len(request.prompt_token_ids) >= request.max_new_tokens:
            return 0  # its last token is in flight: it finishes once that reaches the host
        num_new = num_tokens - request.num_computed_tokens
        if request.draft_token_ids:
            if num_new != 1:  # drafts follow a decode step only
                request.clear_drafts()
            else:  # shortened to the budget
                del request.draft_token_ids[max(0, budget - 1):]
                num_new += len(request.draft_token_ids)
        if num_new > budget:
            return _chunk_len(request, budget) if self.enable_chunked_prefill else 0
        return num_new

    def _acquire_gates(self, request: Request) -> bool:
        """Every gate's resource for the request, or none of them (it waits)."""
        for i, gate in enumerate(self.admission_gates):
            if not gate.try_acquire(request):
                for taken in self.admission_gates[:i]:
                    taken.release(request)
                return False
        return True

    def _release_gates(self, request: Request) -> None:
        for gate in self.admission_gates:
            gate.release(request)

    @staticmethod
    def _leader_ready(request: Request) -> bool:
        leader = request.prefix_leader
        return leader is None or leader.is_prompt_done or leader.is_finished


def _chunk_len(request: Request, budget: int) -> int:
    """A prefill chunk's length: the budget, shortened not to cut an image whose tokens
    attend both ways (MultimodalInputs.chunk_end)."""
    if request.multimodal is None:
        return budget
    start = request.num_computed_tokens
    return request.multimodal.chunk_end(start, start + budget) - start


def _is_in(request: Request, ids: set[int]) -> bool:
    """Whether the request, or a beam of its group, is among `ids`."""
    group = request.beam_group
    members = group.requests if group is not None else (request,)
    return any(id(m) in ids for m in members)
