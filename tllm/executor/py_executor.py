"""The executor loop: one background thread that repeatedly fetches new requests, schedules,
runs the model, samples, and updates, streams and frees requests.

There is one loop. How far it runs ahead of the host is its strategy (`StepOverlap`): each
step ends on the host before the next is scheduled (SYNC); step N+1 is launched before step
N's tokens reach the host (OVERLAP, the default); or, under pipeline parallelism, up to one
step per stage is in flight over disjoint requests, sampled on the last stage (`pipelined`).
Resource managers (the KV cache first) are called in order around every step."""
from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Callable

from tllm.executor.loop_gate import LoopGate
from tllm.executor.beam_search import BeamSearch, check_beam_support, end_beams_with
from tllm.executor.outputs import OutputStage
from tllm.executor.postprocess import Postprocessor
from tllm.executor.slow_steps import SlowIterationLog
from tllm.executor.speculation import Speculation, VerifiedBatch
from tllm.guided.manager import GuidedDecoding
from tllm.kv_cache.manager import KVCacheManager
from tllm.request import FinishReason, Request, RequestState
from tllm.runner.model_runner import ModelRunner, StepOutput
from tllm.sampling.beam import BeamCandidates
from tllm.sampling.sampler import SampledBatch, Sampler
from tllm.scheduler.interface import ResourceManager, ScheduledBatch
from tllm.scheduler.scheduler import Scheduler
from tllm.speculative.interface import Drafter, VerifyResult

logger = logging.getLogger(__name__)
_SHUTDOWN = object()
_live_executors: weakref.WeakSet[PyExecutor] = weakref.WeakSet()


@dataclass(frozen=True)
class StepOverlap:
    """How many steps the loop keeps in flight (launched, tokens not yet processed on the
    host), and whether the host samples each one as soon as it is launched (its tokens then
    stay on the device and feed the next step) or a later pipeline stage does."""

    max_in_flight: int
    samples_at_launch: bool = True


SYNC = StepOverlap(1)
OVERLAP = StepOverlap(2)


def pipelined(num_micro_batches: int) -> StepOverlap:
    """A step per pipeline stage in flight; a request sits out while its step is in one."""
    return StepOverlap(num_micro_batches, samples_at_launch=False)


@dataclass
class InFlightStep:
    batch: ScheduledBatch
    output: StepOutput | None = None
    sampled: SampledBatch | VerifiedBatch | None = None   # its tokens (on the device)
    first_positions: list[int] | None = None  # with a drafter: where each request began
    beams: BeamCandidates | None = None       # its beam groups' candidates (on the device)


class PyExecutor:
    """Owns the scheduler, KV cache, model runner and sampler; touched only by its thread.
    Other threads talk to it through `submit`, `abort` and `shutdown`."""

    def __init__(self, scheduler: Scheduler, kv_cache: KVCacheManager, runner: ModelRunner,
                 sampler: Sampler, overlap: StepOverlap = OVERLAP,
                 drafter: Drafter | None = None) -> None:
        self.scheduler = scheduler
        self.kv_cache = kv_cache
        self.runner = runner
        # speculation needs each step's tokens on the host before the next is drafted
        self.strategy = SYNC if drafter is not None else overlap
        self.resource_managers: list[ResourceManager] = [kv_cache, *runner.resource_managers]
        self.speculation = None
        if drafter is not None:
            self.speculation = Speculation(drafter, sampler)
            self.resource_managers.append(drafter)
            runner.has_drafter = True
            if drafter.hidden_state_layers:
                runner.capture_hidden_states(drafter.hidden_state_layers)
        self.outputs = OutputStage()
        self.postprocess = Postprocessor(sampler, self._finish, self._fail, self.outputs.add)
        self.beam_search = BeamSearch(scheduler, self._finish, self._fail)
        self.guided: GuidedDecoding | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._requests: dict[str, Request] = {}
        self._in_flight: deque[InFlightStep] = deque()
        self._thread = threading.Thread(target=self._run, name="tllm-executor", daemon=True)
        self._stopped = False
        self._is_shutdown_taken = False     # the inbox gave _SHUTDOWN: the loop ends
        self.num_steps = 0
        self._slow_log = SlowIterationLog()
        self._num_pending_adds = 0  # submitted, not yet taken from the inbox
        self._pending_lock = threading.Lock()
        # With worker ranks: set from the watcher thread when one dies; the loop stops and
        # every open request fails with it.
        self.fatal_error: Exception | None = None
        self.health_check: Callable[[], Exception | None] = lambda: None
        self.gate = LoopGate()  # pause, sleep, calls run with no step in flight (RL)
        self._thread.start()
        _live_executors.add(self)

    def enable_guided_decoding(self, guided: GuidedDecoding) -> None:
        """Serve guided requests with `guided` (before any request is submitted). Not under
        pipeline parallelism: its last stage samples, where no grammar state lives."""
        if not self.strategy.samples_at_launch:
            return
        self.guided = guided
        self.resource_managers.append(guided)
        self.postprocess.sampler.guided = guided
        self.postprocess.guided = guided

    def submit(self, request: Request) -> None:
        """Queue a request; ValueError (nothing queued) if its grammar cannot be served."""
        if self.fatal_error is not None:
            raise RuntimeError(f"the engine has stopped: {self.fatal_error}")
        self.gate.check_submit()
        if request.sampling_params.guided_decoding is not None:
            if self.guided is None:
                raise ValueError("sampling_params.guided_decoding: this engine cannot guide "
                                 "decoding (it has no tokenizer, or runs pipeline stages)")
            self.guided.check(request)
        check_beam_support(request, has_drafter=self.speculation is not None,
                           samples_at_launch=self.strategy.samples_at_launch,
                           has_state=getattr(getattr(self.runner, "model", None),
                                             "state_cache", None) is not None)
        with self._pending_lock:
            self._num_pending_adds += 1
        self._inbox.put(("add", request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every request submitted so far (between steps)."""
        self._inbox.put(("call", self._abort_all))

    def call_when_quiet(self, fn: Callable[[], object]):
        """fn's Future: the loop runs fn between steps once none is in flight."""
        future = self.gate.add_quiet_call(fn)
        self._inbox.put(("call", lambda: None))   # wakes an idle loop
        return future

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run fn on the loop thread between steps (for state only that thread may touch,
        such as KV blocks another thread is done with); it wakes an idle loop."""
        self._inbox.put(("call", fn))

    def add_resource_manager(self, manager: ResourceManager, first: bool = False) -> None:
        """Another resource manager (before any request is submitted); `first`: its hooks
        run before the KV cache's (its free() sees the request's blocks still held)."""
        self.resource_managers.insert(0 if first else len(self.resource_managers), manager)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> dict[str, int | float | str]:
        """A snapshot for monitoring; read from other threads, so only plain values."""
        return {"num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting) + self._num_pending_adds,
                "num_preemptions": self.scheduler.num_preemptions,
                "kv_blocks_total": self.kv_cache.num_blocks,
                "kv_blocks_free": self.kv_cache.num_free_blocks,
                "kv_capacity_tokens": self.kv_cache.capacity_tokens,
                "kv_cache_dtype": str(self.kv_cache.dtype).removeprefix("torch."),
                "num_steps": self.num_steps,
                "generation_held": int(self.gate.holds_launches),  # paused or asleep
                **(self.speculation.stats.as_dict() if self.speculation is not None else {}),
                # a vision-language model's encoder: images encoded, found in its cache
                **(self.runner.multimodal.cache.stats()
                   if getattr(self.runner, "multimodal", None) is not None else {}),
                # tokens routed to each expert (moe_load_stats)
                **(self.runner.rank.expert_load.snapshot()
                   if getattr(self.runner, "rank", None) is not None
                   and self.runner.rank.expert_load is not None else {}),
                # a hybrid's state checkpoints and swaps
                **{k: v for manager in self.resource_managers
                   if hasattr(manager, "state_stats") for k, v in manager.state_stats().items()},
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
        failed = [r for r in list(self._requests.values())
                  if r.state is not RequestState.FINISHED]
        for request in failed:
            request.error = error
            request.finish(FinishReason.ABORT)
        self.outputs.deliver_now(failed)

    # ---- the loop (executor thread only) ----

    def _run(self) -> None:
        try:
            while self._fetch_requests(block=self._is_idle()) and self.fatal_error is None:
                self._iteration()
                self.outputs.flush()
                if self.gate.has_quiet_calls and not self._in_flight:
                    self.gate.run_quiet_calls()
        finally:  # even if the loop itself dies, every open result gets its end
            self.gate.fail_quiet_calls(RuntimeError("the engine has stopped"))
            self._abort_all()
            self.outputs.close()

    def _is_idle(self) -> bool:
        return ((not self.scheduler.has_unfinished or self.gate.holds_launches)
                and not self._in_flight)

    def _iteration(self) -> None:
        """Launch what the strategy allows, bring the oldest step's tokens to the host when
        it must, then sample what was launched (with overlap, after the host has seen the
        previous step's tokens: penalties and stop checks need them)."""
        clock = self._slow_log.start()
        try:
            num_launched = self._launch_steps()
            clock.mark("launch")
            # Aborts that came while the step ran apply now, before its rows are sampled and
            # its predecessor's tokens processed: a client that left costs no more host work.
            self._fetch_requests(block=False)
            clock.mark("fetch")
            keep = self.strategy.max_in_flight - 1
            if self._in_flight and (num_launched == 0 or len(self._in_flight) > keep):
                self._complete_oldest()
            clock.mark("complete")
            if self.strategy.samples_at_launch:
                for step in self._in_flight:
                    if step.sampled is None:
                        self._sample(step)
            clock.mark("sample")
            clock.done(launched=num_launched, running=len(self.scheduler.running),
                       waiting=len(self.scheduler.waiting))
        except Exception as exc:  # a failed step fails its requests, not the loop
            logger.exception("executor step failed")
            self._fail_in_flight(self.health_check() or exc)

    def _launch_steps(self) -> int:
        # Sampling at launch gives the next step its inputs, so such strategies launch one
        # step per iteration; pipeline stages take a step each over disjoint requests.
        limit = 1 if self.strategy.samples_at_launch else self.strategy.max_in_flight
        if self.gate.holds_launches:
            limit = 0
        num_launched = 0
        while num_launched < limit and len(self._in_flight) < self.strategy.max_in_flight:
            if self.speculation is not None:
                self.speculation.propose(self.scheduler.running)
            try:
                batch = self.scheduler.schedule()
            except Exception as exc:
                self._fail_scheduling(exc)
                break
            if not batch.requests:
                break
            self._launch(batch)
            num_launched += 1
        return num_launched

    def _fail_scheduling(self, exc: Exception) -> None:
        """A failure inside the scheduler has no step in flight to fail, and which request
        caused it is not known: every request it holds would meet it again at the next
        iteration, forever. They fail instead (blocks freed), and the loop serves on."""
        logger.exception("scheduling failed: the %d requests the engine holds fail",
                         len(self._requests))
        self._fail(list(self._requests.values()), exc)

    def _launch(self, batch: ScheduledBatch) -> None:
        """Resources ready, the step launched, progress advanced, new full blocks published."""
        step = InFlightStep(batch)
        self._in_flight.append(step)  # so that a failure below fails these too
        self.num_steps += 1
        for manager in self.resource_managers:
            manager.prepare(batch)
        if self.speculation is not None:
            step.first_positions = [r.num_computed_tokens for r in batch.requests]
        step.output = self.runner.execute(batch)
        self.scheduler.advance(batch, hold=not self.strategy.samples_at_launch)
        for manager in self.resource_managers:
            manager.update(batch)

    def _sample(self, step: InFlightStep) -> None:
        """The step's tokens, kept on the device (in flight: the next step reads them from
        the runner's token table) until `_complete_oldest` brings them to the host."""
        output = step.output.wait()
        if output.pooled:
            self._finish_pooled(output.pooled)
        self.postprocess.record_prompt_logprobs(output)
        step.beams = self.beam_search.candidates(output)
        if output.sample_counts is not None:  # drafts to verify: SYNC, tokens on the host
            step.sampled = self.speculation.verify(output)
            return
        if output.sampled is not None:  # the last pipeline stage sampled every row
            step.sampled = output.sampled
        else:
            step.sampled = self.postprocess.sample(output)
            self.runner.record_sampled(step.sampled)
        finished = RequestState.FINISHED
        for request in step.sampled.requests:
            if request.state is not finished:
                request.num_in_flight += 1  # (mark_sampled, inline: every row, every step)

    def _finish_pooled(self, pooled: list) -> None:
        """Pooling requests end with their prompt's last step: the output stays on the
        device (the output thread reads it), their KV blocks go back now."""
        for request, values in pooled:
            if request.state is not RequestState.FINISHED:
                request.pooled = values
                self._finish(request, FinishReason.STOP)

    def _complete_oldest(self) -> None:
        """Bring the oldest step's tokens to the host: append them, stream, stop."""
        step = self._in_flight[0]
        if step.sampled is None:
            self._sample(step)
        self.scheduler.release(step.batch)
        if isinstance(step.sampled, VerifiedBatch):
            self._process_verified(step.sampled)
        else:
            self.postprocess.process(step.sampled.requests, step.sampled.host())
        if step.beams is not None:
            self.beam_search.process(step.beams)
        if self.speculation is not None:
            self._tell_drafter(step)
        self._in_flight.popleft()

    def _process_verified(self, verified: VerifiedBatch) -> None:
        """Rejected drafts rolled back first (their KV must never be published), then each
        request's new tokens, stop checks and streaming."""
        for request, drafted, accepted in zip(verified.requests, verified.num_drafts,
                                              verified.num_accepted):
            if not request.is_finished:
                self.scheduler.rollback(request, drafted - accepted)
        self.postprocess.process_tokens(verified.requests, verified.token_ids,
                                        verified.logprobs)

    def _tell_drafter(self, step: InFlightStep) -> None:
        """The drafter learns what each request of the step gained (and the hidden states)."""
        batch, gained = step.batch, {}
        if isinstance(step.sampled, VerifiedBatch):
            gained = {id(r): (t, a) for r, t, a in zip(step.sampled.requests,
                                                      step.sampled.token_ids,
                                                      step.sampled.num_accepted)}
        elif step.sampled is not None:
            gained = {id(r): (r.token_ids[-1:], 0) for r in step.sampled.requests}
        for request in batch.requests:
            request.clear_drafts()
        starts = [0]
        for n in batch.num_scheduled_tokens[:-1]:
            starts.append(starts[-1] + n)
        self.speculation.drafter.on_verified(VerifyResult(
            batch.requests, step.first_positions, batch.num_scheduled_tokens,
            [gained.get(id(r), ([], 0))[1] for r in batch.requests],
            [list(gained.get(id(r), ([], 0))[0]) for r in batch.requests], starts,
            step.output.hidden_states if step.output is not None else None))

    def _fail_in_flight(self, error: Exception) -> None:
        """Fail what the in-flight steps still owe: a sampled step its tokens, an unsampled
        one its whole batch."""
        steps, self._in_flight = list(self._in_flight), deque()
        failed: dict[int, Request] = {}
        for step in steps:
            self.scheduler.release(step.batch)
            owed = step.sampled.requests if step.sampled is not None else step.batch.requests
            owed = owed + (step.beams.requests if step.beams is not None else [])
            failed.update((id(r), r) for r in owed)
        self._fail(list(failed.values()), error)

    def _fetch_requests(self, block: bool) -> bool:
        """Drain the inbox; False once shutdown was asked for."""
        if self._is_shutdown_taken:
            return False
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is _SHUTDOWN:
                self._is_shutdown_taken = True
                return False
            action, payload = item
            if action == "add":
                with self._pending_lock:
                    self._num_pending_adds -= 1
                self._requests[payload.request_id] = payload
                self.scheduler.add_request(payload)
            elif action == "call":
                payload()
            elif payload in self._requests:
                self._finish(self._requests[payload], FinishReason.ABORT)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _finish(self, request: Request, reason: FinishReason, stop_reason=None) -> None:
        if request.state is RequestState.FINISHED:
            return
        if request.detokenizer is not None and request.sampling_params.stop_strings:
            request.detokenizer.finalize()  # (the loop decodes these; before they finish)
        request.finish(reason, stop_reason)
        self.scheduler.finish(request)
        for manager in self.resource_managers:
            manager.free(request)
        self._requests.pop(request.request_id, None)
        self.outputs.add(request)
        if request.beam_group is not None:  # the beams of a prompt end together
            end_beams_with(request, self._finish)

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
