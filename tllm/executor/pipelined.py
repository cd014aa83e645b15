"""The executor loop for pipeline parallelism: up to `num_micro_batches` steps in flight at
once, over disjoint sets of requests, so that while the last stage runs micro-batch A the
first stage already runs micro-batch B (TensorRT-LLM and vLLM schedule PP the same way).

A request sits out scheduling while its micro-batch is in the pipeline; when the oldest
micro-batch's logits come back from the last stage, rank 0 samples, updates and streams
its requests, and they can be scheduled again. Sampled tokens reach the host before the
request's next step, so no placeholders are needed."""
from __future__ import annotations

import logging
from collections import deque

from tllm.executor.py_executor import PyExecutor
from tllm.request import PLACEHOLDER
from tllm.runner.model_runner import StepOutput
from tllm.scheduler.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)


class PipelinedExecutor(PyExecutor):
    def __init__(self, *args, num_micro_batches: int, **kwargs) -> None:
        self.num_micro_batches = num_micro_batches
        self._pipeline: deque[tuple[ScheduledBatch, StepOutput]] = deque()
        super().__init__(*args, overlap=False, **kwargs)

    def _is_idle(self) -> bool:
        return not self.scheduler.has_unfinished and not self._pipeline

    def _iteration(self) -> None:
        try:
            while len(self._pipeline) < self.num_micro_batches:
                batch = self.scheduler.schedule()
                if not batch.requests:
                    break
                self.num_steps += 1
                self._launch(batch)
            if self._pipeline:
                self._complete_oldest()
        except Exception as exc:  # a failed step fails the requests in the pipeline
            logger.exception("executor step failed")
            requests = [r for batch, _ in self._pipeline for r in batch.requests]
            self._pipeline.clear()
            for request in requests:
                request.in_pipeline = False
            self._fail(requests, self.health_check() or exc)

    def _launch(self, batch: ScheduledBatch) -> None:
        self._pipeline.append((batch, None))  # so that a failure below fails these too
        step = self.runner.execute(batch, None)
        self._pipeline[-1] = (batch, step)
        for request, num_new in zip(batch.requests, batch.num_scheduled_tokens):
            request.num_computed_tokens += num_new
            request.in_pipeline = True

    def _complete_oldest(self) -> None:
        batch, step = self._pipeline.popleft()
        for request in batch.requests:
            request.in_pipeline = False
        step.wait()
        self._record_prompt_logprobs(step)
        # the last stage sampled every row; rows of requests finished meanwhile are skipped
        self._in_flight, self._in_flight_batch = step.sampled, batch.requests
        for request in step.sample_requests:
            if not request.is_finished:
                request.append_token(PLACEHOLDER)
        self._complete_in_flight()

    def _finish(self, request, reason, stop_reason=None) -> None:
        super()._finish(request, reason, stop_reason)
        self.runner.forget_request(request.request_id)
