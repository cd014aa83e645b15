"""The scheduler's rules for beam groups (the beams of one beam-search prompt): a group is
admitted only when all its beams fit, preempted as a whole, and its live beams sample in
the same step or not at all. Before its first step only beam 0 is live (it computes the
prompt); the others wait, admitted, until they fork from it.

A group whose beams cannot all finish their tokens this step (the budget, or beams that
are recomputing after a preemption) catches up: each live beam computes up to all but its
last token, so none samples alone. A group that samples sits out until its candidates
reach the host (its next step's blocks depend on them)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tllm.request import Request, RequestState

if TYPE_CHECKING:
    from tllm.sampling.beam import BeamGroup
    from tllm.scheduler.interface import ScheduledBatch


class BeamGroupScheduling:
    """Mixed into Scheduler (running, waiting, _beam_holds, kv_cache, _make_room, gates)."""

    def _schedule_beam_group(self, batch: ScheduledBatch, i: int,
                             budget: int) -> tuple[int, int, bool]:
        """Schedule the group of running[i] when the step first meets it: (the index to go
        on from, the budget left, False if the group was preempted to make room for
        itself). Its beams need not be next to each other in `running`."""
        group = self.running[i].beam_group
        end = i + 1
        if group.scheduled_in is batch:
            return end, budget, True
        group.scheduled_in = batch
        live = group.live_requests
        if (any(r in self._beam_holds for r in group.requests)
                or len(batch) + len(live) > self._step_limit):
            return end, budget, True
        plan = _plan_group(live, budget)
        for request, num_new in plan:
            if not self._make_room(request, num_new):
                return end, budget, False
        for request, num_new in plan:
            batch.add(request, num_new)
            budget -= num_new
        return end, budget, True

    def _admit_beam_group(self, batch: ScheduledBatch, budget: int) -> int | None:
        """Admit the group at the head of the waiting queue with room for its step: the
        tokens it computes, or None when it stays waiting (all its admissions undone)."""
        group = self.waiting[0].beam_group
        members = group.requests
        if (len(self.running) + len(members) > self.max_batch_size
                or len(batch) + len(group.live_requests) > self._step_limit
                or not all(m in self.waiting for m in members)):
            return None
        gated: list[Request] = []  # other resources (LoRA slots), every beam or none
        for member in members:
            if not self._acquire_gates(member):
                return self._undo_admissions(gated, [])
            gated.append(member)
        admitted: list[Request] = []
        for member in members:
            admission = self.kv_cache.try_admit(member)
            if admission is None:
                return self._undo_admissions(gated, admitted)
            member.num_computed_tokens = admission.num_computed_tokens
            admitted.append(member)
        plan = _plan_group(group.live_requests, budget)
        if not plan or not all(self.kv_cache.try_grow(r, n) for r, n in plan):
            return self._undo_admissions(gated, admitted)
        now = time.monotonic()
        for member in members:
            self.waiting.remove(member)
            member.state = RequestState.RUNNING
            if member.first_scheduled_time is None:
                member.first_scheduled_time = now
            self.running.append(member)
        for request, num_new in plan:
            batch.add(request, num_new)
        return sum(n for _, n in plan)

    def _undo_admissions(self, gated: list[Request], admitted: list[Request]) -> None:
        for request in gated:
            self._release_gates(request)
        for request in admitted:
            self.kv_cache.free(request)
            request.num_computed_tokens = 0  # swapped-in contents are gone: recompute
        return None

    def _hold_sampling_beams(self, batch: ScheduledBatch) -> None:
        """Beams that sample this step sit out until their candidates are on the host (the
        release of an earlier step they were in does not let them go)."""
        for request in batch.requests:
            if request.beam_group is not None and request.num_computed_tokens == request.num_tokens:
                self._beam_holds[request] = batch

    def _release_beams(self, batch: ScheduledBatch) -> None:
        for request in batch.requests:
            if self._beam_holds.get(request) is batch:
                del self._beam_holds[request]

    def fork_beams(self, group: BeamGroup, parents: list[Request]) -> None:
        """Slot j's beam continues from `parents[j]` (a live beam, as it is now): it takes
        that beam's progress and KV blocks (shared, the last partial one copied on write)."""
        for request, parent in zip(group.requests, parents):
            request.num_computed_tokens = parent.num_computed_tokens
        self.kv_cache.fork(group.requests, parents)


def _plan_group(live: list[Request], budget: int) -> list[tuple[Request, int]]:
    """Each live beam's tokens this step: all it has left if every beam's fit the budget
    (the group samples), else up to all but the last (catching up, no beam samples)."""
    remaining = [r.num_tokens - r.num_computed_tokens for r in live]
    if not all(remaining):
        return []  # a beam has sampled and waits for the fork
    if sum(remaining) <= budget:
        return list(zip(live, remaining))
    plan = []
    for request, num_left in zip(live, remaining):
        num_new = min(num_left - 1, budget)
        if num_new > 0:
            plan.append((request, num_new))
            budget -= num_new
    return plan
