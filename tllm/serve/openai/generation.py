"""Runs one API request in the engine: admission (engine alive; no more sequences than the
per-request cap; its sequences that would wait beyond the free batch slots within the queue
cap and within one request's share of it), submission of its prompts x n samples, one merged
stream of the engine's per-sequence deltas (as the engine built them: nothing is diffed
here), metrics, and abort of whatever is unfinished when the request ends early or its client
goes away."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from starlette.requests import Request

from tllm.guided.probe import UnsatisfiableGrammarError
from tllm.executor.loop_gate import EngineAsleepError
from tllm.llmapi.process_llm import EngineDeadError
from tllm.outputs import CompletionDelta, PositionLogprobs
from tllm.sampling_params import SamplingParams
from tllm.serve.http.errors import APIError, from_value_error, server_stopping
from tllm.serve.http.metrics import RequestTracker, ServerMetrics
from tllm.serve.http.supervisor import EngineSupervisor

logger = logging.getLogger(__name__)


@dataclass
class PromptInput:
    token_ids: list[int]
    text: str | None = None
    # a vision-language model's images (PIL), in the order of the text's placeholders;
    # the engine then expands the placeholders of `text` (token_ids count each as one)
    images: list | None = None
    # with images: whether the engine adds the tokenizer's special tokens to `text`
    # (not to what a chat template rendered: it wrote them)
    add_special_tokens: bool = False

    def engine_input(self) -> dict:
        if self.images:
            return {"prompt": self.text, "multi_modal_data": {"image": self.images},
                    "add_special_tokens": self.add_special_tokens}
        return {"prompt_token_ids": self.token_ids, "prompt": self.text}


class DeltaSource(Protocol):
    """What the server needs of an engine handle on one prompt (a GenerationResult, a
    ProcessLLM DeltaStream, a test double)."""

    @property
    def finished(self) -> bool: ...

    def abort(self) -> None: ...

    def deltas(self) -> AsyncIterator[CompletionDelta]: ...


@dataclass(frozen=True, slots=True)
class SeqDelta:
    """One engine delta of one sequence, with its place in the API request."""

    index: int          # the choice index: prompt_index * n + sample index
    prompt_index: int
    engine: CompletionDelta     # as the engine built it

    @property
    def text(self) -> str:
        return self.engine.text

    @property
    def token_ids(self) -> list[int]:
        return self.engine.token_ids

    @property
    def logprobs(self) -> list[PositionLogprobs] | None:
        return self.engine.logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.engine.finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.engine.stop_reason


@dataclass
class Choice:
    """One sequence's text, tokens and logprobs, folded from its deltas (for responses that
    are not streamed)."""

    index: int          # the choice index
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class Generation:
    """The sequences of one API request. Use as `async with`: leaving it aborts whatever is
    unfinished in the engine (so KV blocks come back) and closes the metrics tracker."""

    def __init__(self, results: list[DeltaSource], num_samples: int, tracker: RequestTracker,
                 on_close: Callable[[Generation], None] = lambda _: None) -> None:
        self.results = results
        self.num_samples = num_samples
        # Each prompt's logprobs, once they have come (sample 0's first delta brings them).
        self.prompt_logprobs: list[list[PositionLogprobs | None] | None] = [None] * len(results)
        self._engine_metrics: list[dict[str, float]] = [{} for _ in results]
        self._tracker = tracker
        self._on_close = on_close
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
            delta = self._receive(*item)
            if delta is not None:
                yield delta

    async def wait(self) -> list[Choice]:
        """Run to the end without streaming; every choice's final text, tokens, logprobs."""
        choices = [Choice(i, i // self.num_samples)
                   for i in range(len(self.results) * self.num_samples)]
        async for delta in self.deltas():
            choices[delta.index].add(delta.engine)
        return choices

    def num_prompt_tokens(self, prompt_index: int, default: int) -> int:
        """The prompt's token count as the engine reported it once sample 0 ended (a prompt
        with images has its placeholders expanded there), else `default`."""
        return int(self._engine_metrics[prompt_index].get("num_prompt_tokens", default))

    def _receive(self, prompt_index: int, delta: CompletionDelta) -> SeqDelta | None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = delta.prompt_logprobs
        if delta.finished and delta.index == 0:
            self._engine_metrics[prompt_index] = delta.metrics
        if not delta.token_ids and not delta.text and not delta.finished:
            return None
        seq = SeqDelta(prompt_index * self.num_samples + delta.index, prompt_index, delta)
        self._track(seq)
        return seq

    def _track(self, delta: SeqDelta) -> None:
        self._tracker.on_tokens(delta.index, len(delta.token_ids))
        if delta.finish_reason is not None:
            self._tracker.on_finish(delta.index, delta.finish_reason)
            # The prompt's engine metrics are sample 0's (as in its RequestOutput).
            metrics = self._engine_metrics[delta.prompt_index]
            if metrics:
                self._tracker.on_engine_metrics(metrics)


async def _pump(prompt_index: int, result: DeltaSource, queue: asyncio.Queue) -> None:
    try:
        async for delta in result.deltas():
            queue.put_nowait((prompt_index, delta))
    except EngineDeadError:     # the engine process died under it
        queue.put_nowait(engine_stopped())
    except Exception as exc:  # handed to the consumer, which raises it
        queue.put_nowait(_client_error(exc) or exc)
    finally:
        queue.put_nowait(None)


def _client_error(exc: Exception) -> APIError | None:
    """The 400 for a request the engine failed because of what the client asked (a grammar
    that admits no output, met mid-generation); None for the engine's own failures."""
    cause = exc if isinstance(exc, UnsatisfiableGrammarError) else exc.__cause__
    if isinstance(cause, UnsatisfiableGrammarError):
        return APIError(400, str(cause), code="unsatisfiable_grammar")
    return None


def engine_stopped() -> APIError:
    return APIError(503, "the engine stopped while this request was running",
                    code="engine_unavailable")


# The default cap on one request's sequences: twice OpenAI's largest n (128), so two prompts
# at n 128 still pass, and the batch of vLLM's V0 default (max_num_seqs 256): one request
# fills at most one such batch.
DEFAULT_MAX_SEQUENCES = 256


class EngineClient:
    """The server's side of the LLM: admission control, submission, health, and the drain
    of open requests when the server shuts down (http_server.GracefulServer)."""

    def __init__(self, llm, metrics: ServerMetrics, max_queue_size: int | None,
                 stuck_timeout_s: float, retry_after_s: int = 1,
                 liveness_interval_s: float = 1.0,
                 supervisor: EngineSupervisor | None = None,
                 max_sequences_per_request: int | None = DEFAULT_MAX_SEQUENCES) -> None:
        self.llm = llm
        self.metrics = metrics
        self.max_queue_size = max_queue_size
        self.max_sequences_per_request = max_sequences_per_request
        self.max_batch_size: int | None = getattr(getattr(llm, "args", None),
                                                  "max_batch_size", None)
        self.supervisor = supervisor
        self.stuck_timeout_s = stuck_timeout_s
        self.retry_after_s = retry_after_s
        self.liveness_interval_s = liveness_interval_s
        self._last_num_steps = -1
        self._last_progress = time.monotonic()
        self._open: set[Generation] = set()
        self._watchdog: asyncio.Task | None = None
        self.is_stopping = False

    @property
    def num_open(self) -> int:
        """Requests submitted and not yet closed."""
        return len(self._open)

    def stop_admitting(self) -> None:
        """(Shutdown) From now on new requests get a 503, and /health says why."""
        self.is_stopping = True

    def end_open(self) -> None:
        """(Shutdown) End every open request with a 503: a stream with an error event and
        [DONE]; the engine aborts them as they close."""
        for generation in list(self._open):
            generation.fail(server_stopping())

    async def start(self, prompts: list[PromptInput], params: list[SamplingParams],
                    arrival: float, prompt_param: str = "prompt",
                    disaggregated_params: dict | None = None,
                    lora_request=None, priority: int = 0) -> Generation:
        """Submit every prompt (n samples each, with its own params), or none: raises
        APIError when refused (naming prompt_param when the engine refuses a prompt)."""
        self._check_alive()
        self.check_fan_out(len(prompts), params[0].n, params[0].num_sequences)
        self._check_queue(sum(p.num_sequences for p in params))
        inputs = [p.engine_input() for p in prompts]
        if lora_request is not None:  # the adapter the request's "model" names
            for item in inputs:
                item["lora_request"] = lora_request
        if priority:
            for item in inputs:
                item["priority"] = priority
        if disaggregated_params is not None:
            if len(inputs) != 1:
                raise APIError(400, "disaggregated_params: one prompt per request",
                               param="disaggregated_params")
            inputs[0]["disaggregated_params"] = disaggregated_params
        submitted = time.monotonic()
        try:
            results = await self.llm.submit_batch(inputs, params, streaming=True)
        except ValueError as exc:
            raise from_value_error(exc, prompt_param) from exc
        except EngineDeadError as exc:     # it died since _check_alive
            raise self._unavailable() from exc
        except EngineAsleepError as exc:   # sleep_mode_policy="fail"
            raise APIError(503, str(exc), code="engine_asleep") from exc
        num_samples = params[0].n
        # the HTTP request's id comes with the line (tllm.log): this maps it to the engine's
        logger.debug("submitted as engine request(s) %s",
                     ", ".join(str(getattr(r, "request_id", "?")) for r in results))
        tracker = self.metrics.track([len(p.token_ids) for p in prompts], num_samples, arrival,
                                     submitted)
        generation = Generation(results, num_samples, tracker, on_close=self._open.discard)
        self._open.add(generation)
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_engine())
        return generation

    async def _watch_engine(self) -> None:
        """While requests are open, fail them all with a 503 if the engine loop dies (their
        results would otherwise never finish; ProcessLLM's fail at once by themselves)."""
        while self._open:
            await asyncio.sleep(self.liveness_interval_s)
            if not self.llm.is_alive:
                for generation in list(self._open):
                    generation.fail(engine_stopped())
                return

    def health(self) -> str | None:
        """None when healthy, else why not: the loop is dead, or busy without progress."""
        if self.is_stopping:
            return server_stopping().message
        if not self.llm.is_alive:
            return self._down_reason()
        stats = self.llm.get_stats()
        now = time.monotonic()
        is_busy = (stats["num_running"] + stats["num_waiting"] > 0
                   and not stats.get("generation_held"))   # paused or asleep: on purpose
        if stats["num_steps"] != self._last_num_steps or not is_busy:
            self._last_num_steps = stats["num_steps"]
            self._last_progress = now
            return None
        stalled = now - self._last_progress
        if stalled > self.stuck_timeout_s:
            return f"the engine has made no progress for {stalled:.0f} s with work queued"
        return None

    def _down_reason(self) -> str:
        status = self.supervisor.status() if self.supervisor is not None else None
        return status or "the engine loop is not running"

    def check_room(self) -> None:
        """503 unless the server admits requests and the engine runs, 429 when the queue is
        full, as for a one-prompt generation request (for the pooling routes, which do not
        go through `start`: their
        inputs leave the engine after one step, and --max-pooling-inputs caps their number,
        so a request counts as one, not as its share of the queue)."""
        self._check_alive()
        self._check_queue(1)

    def _check_alive(self) -> None:
        if self.is_stopping:
            raise server_stopping()
        if not self.llm.is_alive:
            raise self._unavailable()

    def _unavailable(self) -> APIError:
        return APIError(503, f"the engine is unavailable: {self._down_reason()}",
                        code="engine_unavailable",
                        headers={"Retry-After": str(self.retry_after_s)})

    def check_fan_out(self, num_prompts: int, n: int, per_prompt: int) -> None:
        """400 for a request of more sequences (prompts x n, or x best_of / the beam width:
        `per_prompt`) than --max-sequences-per-request, or than it could ever be admitted
        with."""
        num_sequences = num_prompts * per_prompt
        limit = self.max_sequences_per_request
        prompts = f"{num_prompts} prompt{'s' if num_prompts != 1 else ''}"
        what = f"{num_sequences} sequences ({prompts} x {per_prompt} each)"
        param = "best_of" if per_prompt > n else "n" if n > 1 else "prompt"
        if limit is not None and num_sequences > limit:
            raise APIError(400, f"the request asks for {what}; at most {limit} are allowed "
                           "per request (--max-sequences-per-request)", param=param,
                           code="too_many_sequences")
        most = self._most_admitted()
        if most is not None and num_sequences > most:
            raise APIError(400, f"the request asks for {what}; this server admits at most "
                           f"{most} of one request (its batch slots and half of "
                           f"--max-queue-size {self.max_queue_size})", param=param,
                           code="too_many_sequences")

    def _most_admitted(self) -> int | None:
        """The most sequences one request could be admitted with, on an idle engine."""
        if self.max_queue_size is None:
            return None
        return (self.max_batch_size or 0) + self._queue_share

    @property
    def _queue_share(self) -> int:
        """What one request may hold of the queue: half, so one request's fan-out never
        fills the waiting room and locks every other client out."""
        return max(1, self.max_queue_size // 2)

    def _check_queue(self, num_sequences: int = 1) -> None:
        """429 unless the request's own sequences fit: those beyond what the free batch
        slots take at once may wait, as long as no more than max_queue_size sequences wait
        then, and this request holds no more than half of that room. A request that fits a
        free slot is never refused by the cap (a burst arrives before the engine schedules
        any of it, so every request of it is 'waiting' at first)."""
        if self.max_queue_size is None:
            return
        stats = self.llm.get_stats()
        free_slots = self._num_free_slots(stats)
        num_queued = stats["num_waiting"] - free_slots
        num_own_queued = num_sequences - max(0, -num_queued)   # after the unclaimed slots
        if num_queued + num_sequences > self.max_queue_size:
            raise self._busy(f"{max(0, num_queued)} sequences are waiting beyond the free "
                             f"batch slots; this request's {num_sequences} would pass "
                             f"max_queue_size {self.max_queue_size}")
        if num_own_queued > self._queue_share:
            raise self._busy(f"this request's {num_sequences} sequences would hold "
                             f"{num_own_queued} places of the queue beyond the free batch "
                             f"slots, more than one request's share "
                             f"({self._queue_share}, half of max_queue_size "
                             f"{self.max_queue_size})")

    def _busy(self, why: str) -> APIError:
        return APIError(429, f"the server is busy: {why}; retry later", code="queue_full",
                        headers={"Retry-After": str(self.retry_after_s)})

    def _num_free_slots(self, stats: dict[str, int]) -> int:
        if self.max_batch_size is None:
            return 0
        return max(0, self.max_batch_size - stats["num_running"])


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
