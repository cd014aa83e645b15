"""What the loop does with a step's logits and tokens, one request at a time where it can:
sampling (a request whose parameters make the sampler fail is failed alone, and the rest of
the batch is sampled without it), prompt logprobs, and the host-side update of each request
(its token, logprobs, stop checks, streaming). One request's failure never fails another's."""
from __future__ import annotations

import logging
from typing import Callable

from tllm.outputs import PositionLogprobs
from tllm.request import FinishReason, Request, RequestState
from tllm.runner.model_runner import StepOutput
from tllm.sampling.sampler import SampledBatch, Sampler, SamplerOutput, prompt_logprobs

logger = logging.getLogger(__name__)

FinishFn = Callable[..., None]                       # (request, reason, stop_reason=None)
FailFn = Callable[[list[Request], Exception], None]
UpdatedFn = Callable[[Request], None]


class Postprocessor:
    def __init__(self, sampler: Sampler, finish: FinishFn, fail: FailFn,
                 updated: UpdatedFn) -> None:
        self.sampler = sampler
        self._finish = finish
        self._fail = fail
        self._updated = updated  # the request has new outputs to deliver
        self.guided = None  # tllm.guided.GuidedDecoding: its matchers see each new token

    # ---- sampling ----

    def sample(self, step: StepOutput) -> SampledBatch:
        """Sample the step's rows; rows of requests that finished meanwhile were computed in
        vain and are dropped."""
        # beam rows are the beam search's (tllm.executor.beam_search)
        finished = RequestState.FINISHED
        live = [i for i, r in enumerate(step.sample_requests)
                if r.state is not finished and r.beam_group is None]
        requests = [step.sample_requests[i] for i in live]
        every_row = len(live) == len(step.sample_requests)
        logits = step.sample_logits if every_row else step.sample_logits[live]
        slots = step.sample_slots if every_row else step.sample_slots[live]
        try:
            sampled = self.sampler.sample(logits, requests, slots)
            sampled.slots = slots
            return sampled
        except Exception as exc:
            failing = self.sampler.failing_rows(logits, requests)
            if not failing:  # not any one request's doing: the step fails
                raise
            self._fail_each([requests[i] for i in failing], exc)
            keep = [i for i in range(len(requests)) if i not in set(failing)]
            sampled = self.sampler.sample(logits[keep], [requests[i] for i in keep],
                                          slots[keep])
            sampled.slots = slots[keep]
            return sampled

    def record_prompt_logprobs(self, step: StepOutput) -> None:
        if step.prompt_logits is None:
            return
        by_request: dict[Request, list[int]] = {}
        for row, (request, _) in enumerate(step.prompt_targets):
            by_request.setdefault(request, []).append(row)
        for request, rows in by_request.items():
            try:
                self._record_rows(step, request, rows)
            except Exception as exc:
                self._fail_each([request], exc)

    @staticmethod
    def _record_rows(step: StepOutput, request: Request, rows: list[int]) -> None:
        if not request.prompt_logprobs:
            request.prompt_logprobs.append(None)  # the first token has no context
        targets = [step.prompt_targets[r][1] for r in rows]
        request.prompt_logprobs.extend(prompt_logprobs(
            step.prompt_logits[rows], targets, request.sampling_params.prompt_logprobs))

    # ---- the host side of each request ----

    def process(self, requests: list[Request], sampled: SamplerOutput) -> None:
        """Each request's new token. Most tokens end nothing: they are found so with one
        set lookup and a count (`may_stop`); the rest take the full check."""
        finished, updated = RequestState.FINISHED, self._updated
        plain = (sampled.has_no_logprobs
                 and (self.guided is None or not self.guided.num_active))
        for i, (request, token) in enumerate(zip(requests, sampled.token_ids)):
            if request.state is finished:  # aborted (or failed) while its token was in flight
                continue
            if (plain and token not in request.stop_token_set
                    and not request.sampling_params.stop_strings
                    and len(request.token_ids) + 1 - len(request.prompt_token_ids)
                    < request.max_new_tokens and request.first_token_time is not None):
                request.num_in_flight -= 1  # (receive_token, inline: the common case)
                request.token_ids.append(token)
                if request.stream_outputs:
                    updated(request)
                continue
            try:
                self._process_one(request, sampled, i)
            except Exception as exc:
                self._fail_each([request], exc)

    def _process_one(self, request: Request, sampled: SamplerOutput, row: int) -> None:
        token = sampled.token_ids[row]
        request.receive_token(token)
        if sampled.logprobs[row] is not None:
            request.output_logprobs.append(sampled.logprobs[row])
        if sampled.sampled_logprobs[row] is not None:
            request.cumulative_logprob += sampled.sampled_logprobs[row]
        reason, stop_reason = self._check_stop(request, token)
        if reason is not None:
            self._finish(request, reason, stop_reason)
        else:
            self._updated(request)

    def process_tokens(self, requests: list[Request], token_ids: list[list[int]],
                       logprobs: list[list[tuple[PositionLogprobs, float]] | None]) -> None:
        """Several new tokens per request (a verified speculative step), each checked for a
        stop in turn: the ones after a stop are dropped."""
        for request, tokens, token_logprobs in zip(requests, token_ids, logprobs):
            if request.is_finished:
                continue
            try:
                self._process_several(request, tokens, token_logprobs)
            except Exception as exc:
                self._fail_each([request], exc)

    def _process_several(self, request: Request, tokens: list[int],
                         token_logprobs: list[tuple[PositionLogprobs, float]] | None) -> None:
        for j, token in enumerate(tokens):
            request.append_token(token)
            if token_logprobs is not None:
                request.output_logprobs.append(token_logprobs[j][0])
                request.cumulative_logprob += token_logprobs[j][1]
            reason, stop_reason = self._check_stop(request, token)
            if reason is not None:
                self._finish(request, reason, stop_reason)
                return
        self._updated(request)

    def _check_stop(self, request: Request, token: int):
        """check_stop, after the request's grammar (if any) took the token: a grammar that
        has ended stops the request."""
        grammar_ended = self.guided is not None and self.guided.accept(request, token)
        reason, stop_reason = check_stop(request, token)
        if reason is None and grammar_ended:
            return FinishReason.STOP, None
        return reason, stop_reason

    def _fail_each(self, requests: list[Request], exc: Exception) -> None:
        for request in requests:
            logger.error("request %s failed: %s: %s", request.request_id,
                         type(exc).__name__, exc)
        self._fail(requests, exc)


def check_stop(request: Request, token: int) -> tuple[FinishReason | None, int | str | None]:
    """Whether the request ends with this new token, and why."""
    params = request.sampling_params
    if token in params.stop_token_ids:
        return FinishReason.STOP, token
    if not params.ignore_eos and token in request.eos_token_ids:
        return FinishReason.STOP, None
    if request.detokenizer is not None and params.stop_strings:  # else the outputs decode
        stop = request.detokenizer.add_token(
            token, check_stop=request.num_output_tokens >= params.min_tokens)
        if stop is not None:
            return FinishReason.STOP, stop
    if request.num_output_tokens >= request.max_new_tokens:
        return FinishReason.LENGTH, None
    return None, None
