"""Scheduling policies: the order of the waiting queue (FCFS or priority), which running
request is preempted first, and the step's token budget (all of max_num_tokens, or a
smaller budget that protects running decodes: Sarathi-Serve's stall-free batching, counted
over the whole step or over its prefill chunks only)."""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator, Literal

from tllm.request import Request

SchedulingOrder = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class SchedulingPolicy:
    """`order`: "fcfs" admits by arrival; "priority" by the lowest `Request.priority` first,
    FCFS within a level, and preempts the lowest-priority running request first (vLLM's rule).
    `step_token_budget`: None spends max_num_tokens each step on running requests in
    admission order, then on new ones (best throughput; a long prefill chunk can make decodes
    wait a step); a number schedules every running decode first, each step, and lets prefill
    chunks fill the rest of this many tokens, so a step costs about a decode step.
    `prefill_token_budget`: every running decode first, uncounted (within max_num_tokens),
    then at most this many prefill tokens a step; a step without decodes spends
    max_num_tokens. With `admit_whole_chunks`, new requests join when enough slots are
    free to fill the chunk (at most an eighth of the batch), so prompts join in fewer,
    fuller steps and the steps between them are pure decode steps (CUDA graphs)."""

    order: SchedulingOrder = "fcfs"
    step_token_budget: int | None = None
    prefill_token_budget: int | None = None
    admit_whole_chunks: bool = True

    def __post_init__(self) -> None:
        if self.order not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy: 'fcfs' or 'priority', got {self.order!r}")
        if self.step_token_budget is not None and self.step_token_budget < 1:
            raise ValueError(f"step_token_budget must be >= 1, got {self.step_token_budget}")
        if self.prefill_token_budget is not None and self.prefill_token_budget < 1:
            raise ValueError("prefill_token_budget must be >= 1, got "
                             f"{self.prefill_token_budget}")
        if self.step_token_budget is not None and self.prefill_token_budget is not None:
            raise ValueError("step_token_budget and prefill_token_budget: set one of them")

    @property
    def protects_decodes(self) -> bool:
        """Whether running decodes are scheduled first, each step, under a budget."""
        return self.step_token_budget is not None or self.prefill_token_budget is not None

    def new_waiting_queue(self) -> deque[Request] | PriorityWaitingQueue:
        return deque() if self.order == "fcfs" else PriorityWaitingQueue()

    def preemption_victim(self, candidates: list[Request]) -> Request:
        """The running request (candidates in admission order) that gives up its blocks."""
        if self.order == "fcfs":
            return candidates[-1]  # the newest
        return max(reversed(candidates), key=lambda r: (r.priority, r.arrival_time))


def check_priority(priority: object, order: SchedulingOrder) -> int:
    """A request's priority (None: 0); ValueError naming `priority` for a value that is not
    an int, or one other than 0 when the policy does not order by priority (as vLLM)."""
    if priority is None:
        return 0
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority: must be an integer, got {priority!r}")
    if priority != 0 and order != "priority":
        raise ValueError(f"priority: got {priority}, but priority scheduling is off (set "
                         "scheduler_config.scheduling_policy='priority')")
    return priority


class PriorityWaitingQueue:
    """Waiting requests ordered by (priority, arrival): the deque operations the scheduler
    uses, each of which puts a request where its key belongs (a preempted request goes back
    among its level by its arrival, behind higher priorities). The beams of a group share
    their first beam's key, so a group stays together."""

    def __init__(self) -> None:
        self._requests: list[Request] = []
        self._keys: list[tuple[int, float, int]] = []

    @staticmethod
    def _key(request: Request) -> tuple[int, float, int]:
        group = request.beam_group
        if group is None:
            return (request.priority, request.arrival_time, 0)
        first = group.requests[0]
        return (first.priority, first.arrival_time, group.requests.index(request))

    def append(self, request: Request) -> None:
        key = self._key(request)
        at = bisect.bisect_right(self._keys, key)
        self._keys.insert(at, key)
        self._requests.insert(at, request)

    appendleft = append  # a preempted request goes back where its key belongs

    def extendleft(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.append(request)

    def popleft(self) -> Request:
        if not self._requests:
            raise IndexError("pop from an empty queue")
        self._keys.pop(0)
        return self._requests.pop(0)

    def remove(self, request: Request) -> None:
        at = self._requests.index(request)
        del self._requests[at], self._keys[at]

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._requests))

    def __contains__(self, request: object) -> bool:
        return request in self._requests
