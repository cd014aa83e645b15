"""The executor loop: one background thread that repeatedly fetches new requests, schedules,
runs the model, samples, and updates, streams and frees requests."""
from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from typing import Callable

from tllm.request import PLACEHOLDER, FinishReason, Request, RequestState
from tllm.kv_cache.manager import KVCacheManager
from tllm.runner.model_runner import ModelRunner, StepOutput
from tllm.sampling.sampler import SampledBatch, Sampler, SamplerOutput, prompt_logprobs
from tllm.scheduler.scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger(__name__)
_SHUTDOWN = object()
_live_executors: weakref.WeakSet[PyExecutor] = weakref.WeakSet()


class PyExecutor:
    """Owns the scheduler, KV cache, model runner and sampler; touched only by its thread.
    Other threads talk to it through `submit`, `abort` and `shutdown`."""

    def __init__(self, scheduler: Scheduler, kv_cache: KVCacheManager, runner: ModelRunner,
                 sampler: Sampler, overlap: bool = True) -> None:
        self.scheduler = scheduler
        self.kv_cache = kv_cache
        self.runner = runner
        self.sampler = sampler
        self._inbox: queue.Queue = queue.Queue()
        self._requests: dict[str, Request] = {}
        # Overlap scheduler: step N's sampled tokens stay on the device and feed step N+1,
        # which is launched before the host looks at them; stop checks lag one step.
        self.overlap = overlap
        self._in_flight: SampledBatch | None = None
        self._in_flight_batch: list[Request] = []
        self._thread = threading.Thread(target=self._run, name="tllm-executor", daemon=True)
        self._stopped = False
        self.num_steps = 0
        self._num_pending_adds = 0  # submitted, not yet taken from the inbox
        self._pending_lock = threading.Lock()
        # With worker ranks: set from the watcher thread when one dies; the loop stops and
        # every open request fails with it.
        self.fatal_error: Exception | None = None
        self.health_check: Callable[[], Exception | None] = lambda: None
        self._thread.start()
        _live_executors.add(self)

    def submit(self, request: Request) -> None:
        if self.fatal_error is not None:
            raise RuntimeError(f"the engine has stopped: {self.fatal_error}")
        with self._pending_lock:
            self._num_pending_adds += 1
        self._inbox.put(("add", request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        """A snapshot for monitoring; read from other threads, so only plain counts."""
        return {"num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting) + self._num_pending_adds,
                "num_preemptions": self.scheduler.num_preemptions,
                "kv_blocks_total": self.kv_cache.num_blocks,
                "kv_blocks_free": self.kv_cache.num_free_blocks,
                "num_steps": self.num_steps,
                **{f"kv_{k}": v for k, v in self.kv_cache.stats_dict().items()
                   if k not in ("blocks_free", "blocks_total")}}

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the loop; `timeout` bounds the wait for a loop stuck on a dead rank."""
        if not self._stopped:
            self._stopped = True
            self._inbox.put(_SHUTDOWN)
            self._thread.join(timeout)

    def fail_fatal(self, error: Exception) -> None:
        """From another thread: the engine cannot go on (a worker rank died). Every open
        request ends with `error` now, without waiting for the loop, which may be stuck in a
        collective with the dead rank."""
        self.fatal_error = error
        with self._pending_lock:
            pending = []
            while True:
                try:
                    pending.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
        for item in pending:
            if item is not _SHUTDOWN and item[0] == "add":
                self._requests[item[1].request_id] = item[1]
            elif item is _SHUTDOWN:
                self._inbox.put(item)
        for request in list(self._requests.values()):
            if request.state is not RequestState.FINISHED:
                request.error = error
                request.finish(FinishReason.ABORT)
                if request.on_update is not None:
                    request.on_update(request)

    # ---- the loop (executor thread only) ----

    def _run(self) -> None:
        try:
            while self._fetch_requests(block=self._is_idle()) and self.fatal_error is None:
                self._iteration()
        finally:  # even if the loop itself dies, every open result gets its end
            self._abort_all()

    def _iteration(self) -> None:
        batch = self.scheduler.schedule()
        if not batch.requests:
            self._complete_in_flight()
            return
        self.num_steps += 1
        try:
            self._step(batch)
        except Exception as exc:  # a failed step fails its requests, not the loop
            logger.exception("executor step failed")
            in_flight = self._in_flight.requests if self._in_flight else []
            self._in_flight = None
            self._fail(batch.requests + in_flight, self.health_check() or exc)

    def _is_idle(self) -> bool:
        return not self.scheduler.has_unfinished and self._in_flight is None

    def _step(self, batch: ScheduledBatch) -> None:
        """Launch step N+1; with overlap, finish step N on the CPU while the GPU runs it."""
        step = self.runner.execute(batch, self._in_flight)
        for request, num_new in zip(batch.requests, batch.num_scheduled_tokens):
            request.num_computed_tokens += num_new
        if self.overlap:
            self._complete_in_flight()
        self._record_prompt_logprobs(step)
        self._sample(step, batch.requests)
        if not self.overlap:
            self._complete_in_flight()

    def _sample(self, step: StepOutput, computed: list[Request]) -> None:
        """Sample the step's logits; the tokens stay on the device (in flight) and the
        requests get placeholders until `_complete_in_flight` brings them to the host."""
        # rows of requests that finished meanwhile were computed in vain: drop them
        live = [i for i, r in enumerate(step.sample_requests) if not r.is_finished]
        requests = [step.sample_requests[i] for i in live]
        logits = (step.sample_logits if len(live) == len(step.sample_requests)
                  else step.sample_logits[live])
        self._in_flight = self.sampler.sample(logits, requests)
        self._in_flight_batch = computed
        for request in requests:
            request.append_token(PLACEHOLDER)

    def _complete_in_flight(self) -> None:
        """Bring the last step's tokens to the host: fill placeholders, stream, stop."""
        if self._in_flight is None:
            return
        sampled, computed = self._in_flight, self._in_flight_batch
        self._in_flight, self._in_flight_batch = None, []
        self._process_samples(sampled.requests, sampled.host())
        for request in computed:  # preempted ones are skipped: their blocks are gone
            if request.state is RequestState.RUNNING:
                self.kv_cache.cache_computed_blocks(request)

    def _fetch_requests(self, block: bool) -> bool:
        """Drain the inbox; False once shutdown was asked for."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is _SHUTDOWN:
                return False
            action, payload = item
            if action == "add":
                with self._pending_lock:
                    self._num_pending_adds -= 1
                self._requests[payload.request_id] = payload
                self.scheduler.add_request(payload)
            elif payload in self._requests:
                self._finish(self._requests[payload], FinishReason.ABORT)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _record_prompt_logprobs(self, step: StepOutput) -> None:
        if step.prompt_logits is None:
            return
        by_request: dict[Request, list[int]] = {}
        for row, (request, _) in enumerate(step.prompt_targets):
            by_request.setdefault(request, []).append(row)
        for request, rows in by_request.items():
            if not request.prompt_logprobs:
                request.prompt_logprobs.append(None)  # the first token has no context
            targets = [step.prompt_targets[r][1] for r in rows]
            request.prompt_logprobs.extend(prompt_logprobs(
                step.prompt_logits[rows], targets, request.sampling_params.prompt_logprobs))

    def _process_samples(self, requests: list[Request], sampled: SamplerOutput) -> None:
        for i, request in enumerate(requests):
            if request.is_finished:  # aborted while its token was in flight
                continue
            token = sampled.token_ids[i]
            request.fill_placeholder(token)
            if sampled.logprobs[i] is not None:
                request.output_logprobs.append(sampled.logprobs[i])
                request.cumulative_logprob += sampled.sampled_logprobs[i]
            reason, stop_reason = self._check_stop(request, token)
            if reason is not None:
                self._finish(request, reason, stop_reason)
            elif request.on_update is not None:
                request.on_update(request)

    @staticmethod
    def _check_stop(request: Request, token: int):
        params = request.sampling_params
        if token in params.stop_token_ids:
            return FinishReason.STOP, token
        if not params.ignore_eos and token in request.eos_token_ids:
            return FinishReason.STOP, None
        if request.detokenizer is not None:
            stop = request.detokenizer.add_token(
                token, check_stop=request.num_output_tokens >= params.min_tokens)
            if stop is not None:
                return FinishReason.STOP, stop
        if request.num_output_tokens >= request.max_new_tokens:
            return FinishReason.LENGTH, None
        return None, None

    def _finish(self, request: Request, reason: FinishReason, stop_reason=None) -> None:
        if request.state is RequestState.FINISHED:
            return
        request.finish(reason, stop_reason)
        self.scheduler.finish(request)
        self._requests.pop(request.request_id, None)
        if request.detokenizer is not None:
            request.detokenizer.finalize()
        if request.on_update is not None:
            request.on_update(request)

    def _fail(self, requests: list[Request], exc: Exception) -> None:
        for request in requests:
            request.error = exc
            self._finish(request, FinishReason.ABORT)

    def _abort_all(self) -> None:
        for request in list(self._requests.values()):
            self._finish(request, FinishReason.ABORT)


@atexit.register
def _shutdown_live_executors() -> None:
    """A process that never called LLM.shutdown() still stops its loop thread cleanly."""
    for executor in list(_live_executors):
        executor.shutdown()
