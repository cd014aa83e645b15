"""The images server's batching queue: requests wait in arrival order; the oldest one and the
waiting requests that can share its transformer batch (same batch key) run together in the
worker thread once the batch is full (`max_batch_size` requests) or the oldest one has waited
`window_s`. Requests with no key (models that do not batch, input images) run alone.

One batch runs at a time. A request whose client leaves is removed from the queue at once; a
running batch stops at its next denoising step only when all of its clients have left (the
others still want their images).
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

from prometheus_client import CollectorRegistry, Gauge, Histogram

from tllm.visual_gen.pipeline import Cancellation, DenoiseHook, DenoiseStep, GenerationCancelled

BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@dataclass(frozen=True)
class BatchingConfig:
    """How the images server batches: at most max_batch_size requests per transformer batch,
    collected for at most window_s after the oldest arrived (1: no batching)."""

    max_batch_size: int = 4
    window_s: float = 0.01

    def __post_init__(self) -> None:
        if not (isinstance(self.max_batch_size, int) and self.max_batch_size >= 1):
            raise ValueError(f"max_batch_size must be an integer >= 1, got "
                             f"{self.max_batch_size!r}")
        if not self.window_s >= 0:
            raise ValueError(f"window_s must be >= 0, got {self.window_s!r}")


class QueueFull(Exception):
    """The queue holds max_queue requests (waiting and running) already."""


@dataclass(eq=False)
class QueuedRequest:
    """One request in the queue: what to generate, its batch key (None: it runs alone), and
    how its answer comes back."""

    prompt: str
    params: Any
    image: Any = None
    key: Hashable | None = None
    cancellation: Cancellation = field(default_factory=Cancellation)
    arrived: float = field(default_factory=time.monotonic)
    future: asyncio.Future | None = None
    on_abort: Callable[[QueuedRequest], None] | None = None

    def abort(self) -> None:
        """The client left: stop or drop this request (abort_on_disconnect calls it)."""
        self.cancellation.abort()
        if self.on_abort is not None:
            self.on_abort(self)


class AllCancelled(DenoiseHook):
    """Stops a batch at its next step once every request in it was cancelled."""

    def __init__(self, requests: Sequence[QueuedRequest]) -> None:
        self.cancellations = [r.cancellation for r in requests]

    def prepare(self, step: DenoiseStep) -> None:
        if all(c.aborted for c in self.cancellations):
            raise GenerationCancelled("every client of the batch left")


class BatchMetrics:
    """Prometheus metrics of the queue: requests per batch, and requests waiting."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.batch_size = Histogram(
            "tllm:visual_batch_size", "Requests per transformer batch.", ["model_name"],
            buckets=BATCH_SIZE_BUCKETS, registry=self.registry).labels(model_name)
        self.waiting = Gauge("tllm:visual_requests_waiting", "Requests waiting for a batch.",
                             ["model_name"], registry=self.registry).labels(model_name)


# Runs in the worker thread: each request's result, or the exception that failed it.
RunBatch = Callable[[list[QueuedRequest], DenoiseHook], list[Any]]


class ImageBatcher:
    """The queue and the task that forms and runs its batches (see the module docstring)."""

    def __init__(self, run_batch: RunBatch, pool: Executor, max_batch_size: int,
                 window_s: float, max_queue: int | None, metrics: BatchMetrics) -> None:
        self.run_batch = run_batch
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.window_s = window_s
        self.max_queue = max_queue
        self.metrics = metrics
        self.waiting: list[QueuedRequest] = []
        self.running: list[QueuedRequest] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def num_pending(self) -> int:
        return len(self.waiting) + len(self.running)

    async def submit(self, request: QueuedRequest) -> Any:
        """The request's result once its batch has run; QueueFull when the queue is full,
        GenerationCancelled when it was aborted."""
        if self.max_queue is not None and self.num_pending >= self.max_queue:
            raise QueueFull(f"too many image requests waiting ({self.max_queue})")
        request.future = asyncio.get_running_loop().create_future()
        request.on_abort = self._discard
        self.waiting.append(request)
        self._changed()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._serve())
        try:
            return await request.future
        except asyncio.CancelledError:      # the handler was cancelled (shutdown)
            self._discard(request)
            raise

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _discard(self, request: QueuedRequest) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
            self._changed()
            if not request.future.done():
                request.future.set_exception(
                    GenerationCancelled("the client left while the request waited"))

    def _changed(self) -> None:
        self.metrics.waiting.set(len(self.waiting))
        self._wake.set()

    async def _serve(self) -> None:
        while True:
            batch = await self._next_batch()
            self.running = batch
            try:
                await self._run(batch)
            finally:
                self.running = []

    async def _run(self, batch: list[QueuedRequest]) -> None:
        self.metrics.batch_size.observe(len(batch))
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self.pool, self.run_batch, batch,
                                                 AllCancelled(batch))
        except Exception as exc:        # noqa: BLE001  (the whole batch failed)
            results = [exc] * len(batch)
        for request, result in zip(batch, results):
            if request.future.done():
                continue
            if request.cancellation.aborted:    # its client left while the others stayed
                request.future.set_exception(GenerationCancelled("the client left"))
            elif isinstance(result, BaseException):
                request.future.set_exception(result)
            else:
                request.future.set_result(result)

    async def _next_batch(self) -> list[QueuedRequest]:
        """Waits for a batch: full, or its oldest request's window over."""
        while True:
            while not self.waiting:
                await self._wait_for_change(None)
            head = self.waiting[0]
            deadline = head.arrived + self.window_s
            while (head in self.waiting and head.key is not None
                   and len(self._batch_of(head)) < self.max_batch_size
                   and time.monotonic() < deadline):
                await self._wait_for_change(deadline - time.monotonic())
            if head in self.waiting:        # else it was cancelled meanwhile: start over
                batch = self._batch_of(head)
                self.waiting = [r for r in self.waiting if r not in batch]
                self._changed()
                return batch

    def _batch_of(self, head: QueuedRequest) -> list[QueuedRequest]:
        if head.key is None:
            return [head]
        same = [r for r in self.waiting if r.key == head.key]
        return same[:self.max_batch_size]

    async def _wait_for_change(self, timeout_s: float | None) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
