"""The loop's part in beam search (tllm.sampling.beam holds the rule): after a step, the
candidates of every beam group whose beams all sampled, on the device; once they reach the
host, each group's choice, its beams forked onto their parents' KV blocks (through the
scheduler, which owns progress), and the group's end. The beams of a group end together:
a beam that finishes any other way (aborted, failed) takes its group with it."""
from __future__ import annotations

import logging
from typing import Callable

from tllm.request import FinishReason, Request
from tllm.runner.model_runner import StepOutput
from tllm.sampling.beam import BeamCandidates, BeamGroup, beam_candidates
from tllm.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

FinishFn = Callable[..., None]                       # (request, reason, stop_reason=None)
FailFn = Callable[[list[Request], Exception], None]


def check_beam_support(request: Request, *, has_drafter: bool, samples_at_launch: bool,
                       has_state: bool = False) -> None:
    """ValueError for a beam-search request this engine cannot run."""
    if request.beam_group is None:
        return
    if has_state:  # a forked beam would need its parent's state (kv_cache/state_cache.py)
        raise ValueError("SamplingParams.use_beam_search is not supported for models with "
                         "state-space layers yet")
    if has_drafter:
        raise ValueError("SamplingParams.use_beam_search is not supported with speculative "
                         "decoding")
    if not samples_at_launch:
        raise ValueError("SamplingParams.use_beam_search is not supported under pipeline "
                         "parallelism")


def end_beams_with(request: Request, finish: FinishFn) -> None:
    """`request` has finished: its unfinished sibling beams finish the same way."""
    for other in request.beam_group.requests:
        if not other.is_finished:
            other.error = other.error or request.error
            finish(other, request.finish_reason)


class BeamSearch:
    def __init__(self, scheduler: Scheduler, finish: FinishFn, fail: FailFn) -> None:
        self.scheduler = scheduler
        self._finish = finish
        self._fail = fail

    def candidates(self, step: StepOutput) -> BeamCandidates | None:
        """The step's beam rows made candidates (None without any). Every live beam of a
        group samples in the same step (the scheduler steps them together)."""
        rows: dict[int, dict[int, int]] = {}
        groups: dict[int, BeamGroup] = {}
        for i, request in enumerate(step.sample_requests):
            group = request.beam_group
            if group is not None and not request.is_finished:
                groups[id(group)] = group
                rows.setdefault(id(group), {})[id(request)] = i
        if not groups:
            return None
        ordered = list(groups.values())
        slot_rows = []
        for group in ordered:
            by_request = rows[id(group)]
            if len(by_request) != len(group.live_requests):
                raise RuntimeError("a beam group's beams did not sample together")
            slot_rows.append([by_request[id(r)] for r in group.live_requests])
        return beam_candidates(step.sample_logits, ordered, slot_rows)

    def process(self, candidates: BeamCandidates) -> None:
        """Each group's step on the host; a group that fails fails alone."""
        for group, values, indices in candidates.host():
            if any(r.is_finished for r in group.requests):
                continue  # aborted or failed meanwhile: it has ended as a whole
            try:
                self._advance(group, values, indices, candidates.vocab_size)
            except Exception as exc:
                logger.error("beam group of %s failed: %s: %s", group.requests[0].request_id,
                             type(exc).__name__, exc)
                self._fail(list(group.requests), exc)

    def _advance(self, group: BeamGroup, values: list[float], indices: list[int],
                 vocab_size: int) -> None:
        live = group.live_requests
        choices = group.step(values, indices, vocab_size)
        if group.is_done:
            self._finish(group.requests[0], FinishReason.STOP)  # the others follow
            return
        tokens = [list(r.token_ids) for r in live]
        self.scheduler.fork_beams(group, [live[c.parent] for c in choices])
        group.is_started = True
        for request, choice in zip(group.requests, choices):
            request.token_ids = list(tokens[choice.parent])
            request.append_token(choice.token_id)
            request.cumulative_logprob = choice.cumulative_logprob
