"""The scheduler's handoffs: the ScheduledBatch it hands the loop each step, and the small
interface every resource manager implements (TensorRT-LLM's resource-manager hooks).

The loop calls, in order: `prepare(batch)` once the scheduler has decided the step,
`update(batch)` once the step's tokens are computed (and the scheduler has advanced each
request's progress), and `free(request)` when a request ends. A resource manager answers
questions and keeps its own per-request state; it never writes `Request` fields."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from tllm.request import Request


@dataclass
class ScheduledBatch:
    """The requests of one step, each with the number of tokens it computes, and the
    requests that stopped running while it was scheduled (preempted: they hold no KV blocks
    any more). With the requests' own progress and the KV cache manager's table changes,
    this is the step as a diff of the previous one."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def add(self, request: Request, num_tokens: int) -> None:
        self.requests.append(request)
        self.num_scheduled_tokens.append(num_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class ResourceManager(ABC):
    """A per-request resource the loop keeps in step with the batch (KV blocks first;
    draft-model KV, adapter slots and grammar state work the same way)."""

    def prepare(self, batch: ScheduledBatch) -> None:
        """Before the step runs: make what its requests need ready."""

    def update(self, batch: ScheduledBatch) -> None:
        """After the step's tokens are computed."""

    @abstractmethod
    def free(self, request: Request) -> None:
        """The request has ended (finished, aborted or failed): release what it holds."""
