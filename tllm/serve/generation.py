"""Runs one API request in the engine: admission (engine alive, waiting queue not full),
submission of its prompts x n samples, one merged stream of per-sequence deltas, metrics, and
abort of whatever is unfinished when the request ends early or its client goes away."""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

from starlette.requests import Request

from tllm.outputs import PositionLogprobs, RequestOutput
from tllm.sampling_params import SamplingParams
from tllm.serve.errors import APIError, from_value_error
from tllm.serve.metrics import RequestTracker, ServerMetrics


@dataclass
class PromptInput:
    token_ids: list[int]
    text: str | None = None


@dataclass
class SeqDelta:
    """What is new in one sequence since its previous delta."""

    index: int          # the choice index: prompt_index * n + sample index
    prompt_index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Cursor:
    num_tokens: int = 0
    text_len: int = 0
    is_finished: bool = False


class Generation:
    """The sequences of one API request. Use as `async with`: leaving it aborts whatever is
    unfinished in the engine (so KV blocks come back) and closes the metrics tracker."""

    def __init__(self, results: list, num_samples: int, tracker: RequestTracker,
                 on_close: Callable[[Generation], None] = lambda _: None) -> None:
        self.results = results
        self.num_samples = num_samples
        self.outputs: list[RequestOutput | None] = [None] * len(results)
        self._tracker = tracker
        self._on_close = on_close
        self._cursors = [_Cursor() for _ in range(len(results) * num_samples)]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening, abort what is unfinished, settle the metrics (idempotent)."""
        for pump in self._pumps:
            pump.cancel()
        self.abort()
        self._tracker.close()
        self._on_close(self)

    def fail(self, error: Exception) -> None:
        """End deltas() with this error (the engine stopped: nothing more will come)."""
        self._queue.put_nowait(error)

    def abort(self) -> None:
        for result in self.results:
            if not result.finished:
                result.abort()

    async def deltas(self) -> AsyncIterator[SeqDelta]:
        """Deltas of all sequences in arrival order; raises if the engine failed a request."""
        self._pumps = [asyncio.create_task(_pump(i, r, self._queue))
                       for i, r in enumerate(self.results)]
        num_running = len(self._pumps)
        while num_running:
            item = await self._queue.get()
            if item is None:
                num_running -= 1
                continue
            if isinstance(item, Exception):
                raise item
            prompt_index, output = item
            self.outputs[prompt_index] = output
            for delta in self._diff(prompt_index, output):
                self._track(delta)
                yield delta

    async def wait(self) -> list[RequestOutput]:
        """Run to the end without streaming; the final output of each prompt."""
        async for _ in self.deltas():
            pass
        return self.outputs  # type: ignore[return-value]

    def _diff(self, prompt_index: int, output: RequestOutput) -> list[SeqDelta]:
        deltas = []
        for sample in output.outputs:
            index = prompt_index * self.num_samples + sample.index
            cursor = self._cursors[index]
            if cursor.is_finished:
                continue
            token_ids = sample.token_ids[cursor.num_tokens:]
            text = sample.text[cursor.text_len:]
            if not token_ids and not text and not sample.finished:
                continue
            logprobs = None
            if sample.logprobs is not None:
                logprobs = sample.logprobs[cursor.num_tokens:cursor.num_tokens + len(token_ids)]
            cursor.num_tokens += len(token_ids)
            cursor.text_len += len(text)
            cursor.is_finished = sample.finished
            deltas.append(SeqDelta(index, prompt_index, text, token_ids, logprobs,
                                   sample.finish_reason, sample.stop_reason))
        return deltas

    def _track(self, delta: SeqDelta) -> None:
        self._tracker.on_tokens(delta.index, len(delta.token_ids))
        if delta.finish_reason is not None:
            self._tracker.on_finish(delta.index, delta.finish_reason)
            output = self.outputs[delta.prompt_index]
            if output is not None and output.metrics:
                self._tracker.on_engine_metrics(output.metrics)


async def _pump(prompt_index: int, result, queue: asyncio.Queue) -> None:
    try:
        async for output in result:
            queue.put_nowait((prompt_index, output))
    except Exception as exc:  # handed to the consumer, which raises it
        queue.put_nowait(exc)
    finally:
        queue.put_nowait(None)


class EngineClient:
    """The server's side of the LLM: admission control, submission, health."""

    def __init__(self, llm, metrics: ServerMetrics, max_queue_size: int | None,
                 stuck_timeout_s: float, retry_after_s: int = 1,
                 liveness_interval_s: float = 1.0) -> None:
        self.llm = llm
        self.metrics = metrics
        self.max_queue_size = max_queue_size
        self.stuck_timeout_s = stuck_timeout_s
        self.retry_after_s = retry_after_s
        self.liveness_interval_s = liveness_interval_s
        self._last_num_steps = -1
        self._last_progress = time.monotonic()
        self._open: set[Generation] = set()
        self._watchdog: asyncio.Task | None = None

    async def start(self, prompts: list[PromptInput], params: list[SamplingParams],
                    arrival: float, prompt_param: str = "prompt") -> Generation:
        """Submit every prompt (n samples each, with its own params), or none: raises
        APIError when refused (naming prompt_param when the engine refuses a prompt)."""
        self._check_alive()
        self._check_queue()
        inputs = [{"prompt_token_ids": p.token_ids, "prompt": p.text} for p in prompts]
        try:
            results = await self.llm.submit_batch(inputs, params, streaming=True)
        except ValueError as exc:
            raise from_value_error(exc, prompt_param) from exc
        num_samples = params[0].n
        tracker = self.metrics.track([len(p.token_ids) for p in prompts], num_samples, arrival)
        generation = Generation(results, num_samples, tracker, on_close=self._open.discard)
        self._open.add(generation)
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_engine())
        return generation

    async def _watch_engine(self) -> None:
        """While requests are open, fail them all with a 503 if the engine loop dies (their
        results would otherwise never finish)."""
        while self._open:
            await asyncio.sleep(self.liveness_interval_s)
            if not self.llm.is_alive:
                for generation in list(self._open):
                    generation.fail(APIError(503, "the engine stopped while this request "
                                             "was running", code="engine_unavailable"))
                return

    def health(self) -> str | None:
        """None when healthy, else why not: the loop is dead, or busy without progress."""
        if not self.llm.is_alive:
            return "the engine loop is not running"
        stats = self.llm.get_stats()
        now = time.monotonic()
        is_busy = stats["num_running"] + stats["num_waiting"] > 0
        if stats["num_steps"] != self._last_num_steps or not is_busy:
            self._last_num_steps = stats["num_steps"]
            self._last_progress = now
            return None
        stalled = now - self._last_progress
        if stalled > self.stuck_timeout_s:
            return f"the engine has made no progress for {stalled:.0f} s with work queued"
        return None

    def _check_alive(self) -> None:
        if not self.llm.is_alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable",
                           headers={"Retry-After": str(self.retry_after_s)})

    def _check_queue(self) -> None:
        if self.max_queue_size is None:
            return
        num_waiting = self.llm.get_stats()["num_waiting"]
        if num_waiting >= self.max_queue_size:
            raise APIError(429, f"the server is busy: {num_waiting} requests are waiting "
                           f"(max_queue_size {self.max_queue_size}); retry later",
                           code="queue_full", headers={"Retry-After": str(self.retry_after_s)})


class Abortable(Protocol):
    def abort(self) -> None: ...


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, generation: Abortable):
    """Abort the generation (a Generation, or a visual Cancellation) as soon as the client
    disconnects, even while nothing is being sent (a request still queued, or a non-streaming
    one)."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        generation.abort()

    watcher = asyncio.create_task(watch())
    try:
        yield generation
    finally:
        watcher.cancel()
