"""The handles generate_async and submit_batch return, and the one place deltas are made.

The executor's output thread (tllm.executor.outputs) calls each Request's `on_update` after
its updates; `bind_deltas` makes that build a CompletionDelta (what is new since the previous
one: a DeltaBuilder per Request keeps the count; it also decodes the text of requests
without stop strings, which the loop leaves to it) and hand it on. Nothing downstream diffs
again:

- DeltaStream: a prompt's deltas as they arrive on the caller's event loop. `deltas()` yields
  them raw (the server's way); awaiting it or `async for` over it folds them into cumulative
  RequestOutputs, built only then. ProcessLLM's handles are DeltaStreams.
- GenerationResult: a DeltaStream bound to Requests of this process, also usable outside an
  event loop (LLM.generate, result()).
"""
from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from typing import AsyncIterator, Callable

from tllm.outputs import CompletionDelta, CompletionOutput, RequestOutput
from tllm.request import Request
from tllm.sampling_params import SamplingParams


class DeltaBuilder:
    """How much of one Request has been handed out already (the output thread only; the
    loop thread keeps changing the request meanwhile)."""

    __slots__ = ("num_tokens", "text_len", "num_logprobs", "sent_prompt_logprobs", "is_done")

    def __init__(self) -> None:
        self.num_tokens = 0
        self.text_len = 0
        self.num_logprobs = 0
        self.sent_prompt_logprobs = False
        self.is_done = False

    def build(self, request: Request) -> CompletionDelta | None:
        """What is new in the request since the previous call (None once it has ended)."""
        if self.is_done:
            return None
        # Read first: once a request reads as finished, its tokens and text are final.
        is_finished = request.is_finished
        new_ids = request.token_ids[request.num_prompt_tokens + self.num_tokens:]
        self.num_tokens += len(new_ids)
        text = ""
        if request.detokenizer is not None:
            if not request.sampling_params.stop_strings:  # the loop left decoding to us
                for token in new_ids:
                    request.detokenizer.add_token(token, check_stop=False)
                if is_finished:
                    request.detokenizer.finalize()
            end = request.detokenizer.stream_len
            text = request.detokenizer.text[self.text_len:end]
            self.text_len = max(self.text_len, end)
        delta = CompletionDelta(request.sample_index, new_ids, text)
        if request.sampling_params.logprobs is not None:
            delta.logprobs = request.output_logprobs[self.num_logprobs:]
            self.num_logprobs += len(delta.logprobs)
        if (request.sample_index == 0 and request.prompt_logprobs and request.is_prompt_done
                and not self.sent_prompt_logprobs):
            delta.prompt_logprobs = request.prompt_logprobs
            self.sent_prompt_logprobs = True
        if is_finished:
            self.is_done = True
            delta.finish_reason = "abort" if request.error else request.finish_reason.value
            delta.stop_reason = request.stop_reason
            delta.error = request.error
            if request.sampling_params.logprobs is not None:
                delta.cumulative_logprob = request.cumulative_logprob
            delta.metrics = _metrics(request)
        return delta


def bind_deltas(requests: list[Request], on_delta: Callable[[CompletionDelta], None]) -> None:
    """After each update of a request, build its delta and pass it to on_delta (called on the
    executor thread: it must only hand the delta over)."""
    for request in requests:
        builder = DeltaBuilder()
        request.on_update = lambda r, b=builder: _send(on_delta, b.build(r))


def _send(on_delta: Callable[[CompletionDelta], None], delta: CompletionDelta | None) -> None:
    if delta is not None:
        on_delta(delta)


class RequestOutputBuilder:
    """Folds one prompt's deltas into its cumulative RequestOutput (the LLM API's view)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        want_logprobs = params.logprobs is not None
        self.samples = [CompletionOutput(i, logprobs=[] if want_logprobs else None)
                        for i in range(params.n)]
        self.output = RequestOutput(request_id, prompt, list(prompt_token_ids), self.samples)
        self._num_unfinished = params.n

    def apply(self, delta: CompletionDelta) -> RequestOutput:
        out = self.samples[delta.index]
        out.token_ids = out.token_ids + delta.token_ids
        out.token_ids_diff = delta.token_ids
        out.text += delta.text
        out.text_diff = delta.text
        if out.logprobs is not None and delta.logprobs:
            out.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.output.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            out.finish_reason = delta.finish_reason
            out.stop_reason = delta.stop_reason
            out.cumulative_logprob = delta.cumulative_logprob
            if delta.index == 0:
                self.output.metrics = delta.metrics
            self._num_unfinished -= 1
            self.output.finished = self._num_unfinished == 0
        return self.output


class DeltaStream:
    """One prompt's deltas, on the event loop it was made in. Consume it one way, once:
    `async for delta in stream.deltas()` (raw CompletionDeltas, no RequestOutput built),
    `await stream` (the final RequestOutput), or `async for output in stream` (cumulative
    snapshots with *_diff; only the final one unless streaming)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, streaming: bool,
                 abort: Callable[[], None] = lambda: None, in_loop: bool = True) -> None:
        self.request_id = request_id
        self.streaming = streaming
        self.num_samples = params.n
        self._prompt = (prompt, prompt_token_ids, params)
        self._abort = abort
        self._is_abort_sent = False
        self._num_unfinished = params.n     # samples whose final delta is not consumed yet
        self._num_undelivered = params.n    # ... not handed over yet
        self._error: Exception | None = None
        self._outputs: RequestOutputBuilder | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None
        if in_loop:
            try:
                self._loop = asyncio.get_running_loop()
                self._queue = asyncio.Queue()
            except RuntimeError:
                pass

    @property
    def finished(self) -> bool:
        """Whether the final delta of every sample has been consumed."""
        return self._num_unfinished == 0

    def abort(self) -> None:
        """Stop the request in the engine; its samples end with finish_reason 'abort'. Only
        the first call reaches the engine."""
        if not self._is_abort_sent:
            self._is_abort_sent = True
            self._abort()

    def deliver(self, delta: CompletionDelta) -> bool:
        """Hand a delta over (from the stream's own event loop thread); True once every
        sample's final delta has been handed over."""
        self._queue.put_nowait(delta)
        if delta.finish_reason is not None:
            self._num_undelivered -= 1
        return self._num_undelivered == 0

    def fail(self, error: Exception) -> None:
        """End the stream with this error, raised by deltas() after what came before it (the
        engine has gone: nothing more will come, and there is nothing left to abort)."""
        self._is_abort_sent = True
        self._queue.put_nowait(error)

    async def deltas(self) -> AsyncIterator[CompletionDelta]:
        """The deltas of all samples in arrival order, as the engine built them, until every
        sample has finished; then raises RuntimeError if the engine failed the request."""
        if self._queue is None:
            raise RuntimeError("generate_async was called outside a running event loop")
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, Exception):
                raise item
            yield self._count(item)
        self._raise_error()

    async def aresult(self) -> RequestOutput:
        async for delta in self.deltas():
            self._fold(delta)
        return self._builder().output

    def __await__(self):
        return self.aresult().__await__()

    async def __aiter__(self):
        """Streamed snapshots: cumulative text/token_ids, plus *_diff since the last one."""
        async for delta in self.deltas():
            output = self._fold(delta)
            if self.streaming or output.finished:
                yield output

    def _count(self, delta: CompletionDelta) -> CompletionDelta:
        if delta.finish_reason is not None:
            self._error = self._error or delta.error
            self._num_unfinished -= 1
        return delta

    def _builder(self) -> RequestOutputBuilder:
        if self._outputs is None:
            self._outputs = RequestOutputBuilder(self.request_id, *self._prompt)
        return self._outputs

    def _fold(self, delta: CompletionDelta) -> RequestOutput:
        return self._builder().apply(delta)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"request {self.request_id} failed: {self._error}") from self._error


class GenerationResult(DeltaStream):
    """The handle LLM.generate_async returns: a DeltaStream fed by this process's executor
    thread (through `post`). Made outside an event loop, `result()` blocks for the final
    output; made with a sink, its deltas go to the sink as (result, delta) instead (for
    LLM.generate, which shares one sink among its results)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, streaming: bool, sink: queue.Queue | None = None,
                 abort: Callable[[], None] = lambda: None) -> None:
        super().__init__(request_id, prompt, prompt_token_ids, params, streaming, abort,
                         in_loop=sink is None)
        self._sink = sink
        self._sync_queue: queue.Queue = queue.Queue()

    def post(self, delta: CompletionDelta) -> None:
        """Hand a delta over from the executor's output thread (bind_deltas' on_delta)."""
        if self._loop is not None:
            _mailbox(self._loop).post(self._queue, delta)
        elif self._sink is not None:
            self._sink.put((self, delta))
        else:
            self._sync_queue.put(delta)

    # ---- caller side, outside an event loop ----

    def apply(self, delta: CompletionDelta) -> RequestOutput:
        """Fold a delta taken from the sink into the cumulative output."""
        return self._fold(self._count(delta))

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until every sample is finished (for results made outside an event loop)."""
        if self._loop is not None:
            raise RuntimeError("this result belongs to an event loop: await it instead")
        while not self.finished and self._sink is None:
            self.apply(self._sync_queue.get(timeout=timeout))
        self._raise_error()
        return self._builder().output


class _LoopMailbox:
    """Deltas bound for one event loop: posted from another thread, delivered in batches
    (one wake-up of the loop for everything posted since its last turn, not one each)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: list[tuple[asyncio.Queue, CompletionDelta]] = []
        self._lock = threading.Lock()

    def post(self, target: asyncio.Queue, delta: CompletionDelta) -> None:
        with self._lock:
            self._items.append((target, delta))
            if len(self._items) > 1:  # a drain is scheduled already
                return
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            with self._lock:
                self._items.clear()

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for target, delta in items:
            target.put_nowait(delta)


_mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_mailboxes_lock = threading.Lock()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _LoopMailbox:
    with _mailboxes_lock:
        box = _mailboxes.get(loop)
        if box is None:
            box = _mailboxes[loop] = _LoopMailbox(loop)
        return box


def _metrics(request: Request) -> dict[str, float]:
    metrics = {"num_prompt_tokens": request.num_prompt_tokens,
               "num_output_tokens": request.num_output_tokens}
    if request.first_scheduled_time is not None:
        metrics["queue_s"] = request.first_scheduled_time - request.arrival_time
    if request.first_token_time is not None:
        metrics["ttft_s"] = request.first_token_time - request.arrival_time
    if request.finish_time is not None:
        metrics["e2e_s"] = request.finish_time - request.arrival_time
    # The readings themselves (time.monotonic, one clock for the host's processes): the
    # server's TTFT breakdown subtracts its own readings from them.
    metrics["arrival_time"] = request.arrival_time
    for name in ("first_scheduled_time", "first_token_time"):
        if getattr(request, name) is not None:
            metrics[name] = getattr(request, name)
    return metrics
