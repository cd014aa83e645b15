"""GenerationResult: the handle generate_async returns. The executor thread sends it small
deltas (new tokens, new text, finish); the caller's side folds them into RequestOutputs.
Await it for the final output, or `async for` over it for streamed snapshots."""
from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass, field
from typing import Callable

from tllm.request import Request
from tllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput


@dataclass
class _Delta:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[PositionLogprobs]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list | None = None
    error: Exception | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class _Cursor:
    """How much of a request has been sent already (executor thread only)."""

    def __init__(self) -> None:
        self.num_tokens = 0
        self.text_len = 0
        self.num_logprobs = 0
        self.sent_prompt_logprobs = False


class GenerationResult:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 num_samples: int, want_logprobs: bool, streaming: bool,
                 sink: queue.Queue | None = None) -> None:
        self.request_id = request_id
        self.streaming = streaming
        self.num_samples = num_samples
        self._outputs = [CompletionOutput(i, logprobs=[] if want_logprobs else None)
                         for i in range(num_samples)]
        self._output = RequestOutput(request_id, prompt, prompt_token_ids, self._outputs)
        self._num_unfinished = num_samples
        self._error: Exception | None = None
        self._abort: Callable[[], None] = lambda: None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_queue: asyncio.Queue | None = None
        if sink is None:
            try:
                self._loop = asyncio.get_running_loop()
                self._async_queue = asyncio.Queue()
            except RuntimeError:
                pass
        # Outside an event loop, deltas go to a queue; generate() shares one (the sink) among
        # all its results and applies each delta to the result it names.
        self._sink = sink
        self._sync_queue: queue.Queue = queue.Queue()

    # ---- executor side ----

    def bind(self, requests: list[Request], abort: Callable[[], None]) -> None:
        self._abort = abort
        for request in requests:
            cursor = _Cursor()
            request.on_update = lambda r, c=cursor: self._post(self._delta(r, c))

    @staticmethod
    def _delta(request: Request, cursor: _Cursor) -> _Delta:
        out_ids = request.output_token_ids
        new_ids = out_ids[cursor.num_tokens:]
        cursor.num_tokens = len(out_ids)
        text = ""
        if request.detokenizer is not None:
            end = request.detokenizer.stream_len
            text = request.detokenizer.text[cursor.text_len:end]
            cursor.text_len = max(cursor.text_len, end)
        logprobs = request.output_logprobs[cursor.num_logprobs:]
        cursor.num_logprobs = len(request.output_logprobs)
        delta = _Delta(request.sample_index, new_ids, text, logprobs)
        if request.prompt_logprobs and request.is_prompt_done and not cursor.sent_prompt_logprobs:
            delta.prompt_logprobs = request.prompt_logprobs
            cursor.sent_prompt_logprobs = True
        if request.is_finished:
            delta.finish_reason = request.finish_reason.value
            delta.stop_reason = request.stop_reason
            delta.error = request.error
            if request.sampling_params.logprobs is not None:
                delta.cumulative_logprob = request.cumulative_logprob
            delta.metrics = _metrics(request)
        return delta

    def set_abort(self, abort: Callable[[], None]) -> None:
        """What abort() calls (for results whose requests live in another process)."""
        self._abort = abort

    def deliver(self, delta: _Delta) -> None:
        """Hand a delta over from the result's own event loop thread."""
        self._async_queue.put_nowait(delta)

    def _post(self, delta: _Delta) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_queue.put_nowait, delta)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass
        elif self._sink is not None:
            self._sink.put((self, delta))
        else:
            self._sync_queue.put(delta)

    # ---- caller side ----

    @property
    def finished(self) -> bool:
        return self._num_unfinished == 0

    def abort(self) -> None:
        self._abort()

    def _apply(self, delta: _Delta) -> RequestOutput:
        out = self._outputs[delta.index]
        out.token_ids = out.token_ids + delta.token_ids
        out.token_ids_diff = delta.token_ids
        out.text += delta.text
        out.text_diff = delta.text
        if out.logprobs is not None:
            out.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None and delta.index == 0:
            self._output.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            out.finish_reason = "abort" if delta.error else delta.finish_reason
            out.stop_reason = delta.stop_reason
            out.cumulative_logprob = delta.cumulative_logprob
            if delta.index == 0:
                self._output.metrics = delta.metrics
            self._error = self._error or delta.error
            self._num_unfinished -= 1
            self._output.finished = self.finished
        return self._output

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"request {self.request_id} failed: {self._error}") from self._error

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until every sample is finished (for results made outside an event loop)."""
        if self._loop is not None:
            raise RuntimeError("this result belongs to an event loop: await it instead")
        while not self.finished and self._sink is None:
            self._apply(self._sync_queue.get(timeout=timeout))
        self._raise_error()
        return self._output

    async def aresult(self) -> RequestOutput:
        async for _ in self._updates():
            pass
        self._raise_error()
        return self._output

    def __await__(self):
        return self.aresult().__await__()

    async def _updates(self):
        if self._async_queue is None:
            raise RuntimeError("generate_async was called outside a running event loop")
        while not self.finished:
            yield self._apply(await self._async_queue.get())

    async def __aiter__(self):
        """Streamed snapshots: cumulative text/token_ids, plus *_diff since the last one."""
        async for output in self._updates():
            if self.streaming or output.finished:
                yield output
        self._raise_error()


def _metrics(request: Request) -> dict[str, float]:
    metrics = {"num_prompt_tokens": request.num_prompt_tokens,
               "num_output_tokens": request.num_output_tokens}
    if request.first_scheduled_time is not None:
        metrics["queue_s"] = request.first_scheduled_time - request.arrival_time
    if request.first_token_time is not None:
        metrics["ttft_s"] = request.first_token_time - request.arrival_time
    if request.finish_time is not None:
        metrics["e2e_s"] = request.finish_time - request.arrival_time
    return metrics
