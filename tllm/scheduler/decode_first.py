"""The step token budget that protects running decodes (Sarathi-Serve's stall-free
batching): every running decode gets its token each step, first; prefill chunks (running
prompts, then new requests) fill what is left of the budget. A step then costs about a
decode step, so decodes never wait behind a whole prefill chunk.

Decodes are never cut to fit the budget (only max_num_tokens bounds them): when they alone
exceed it, prefills wait for decodes to finish. Drafts of speculative requests share what
the budget has beyond one token per decode, in running order."""
from __future__ import annotations

from tllm.request import Request
from tllm.scheduler.interface import ScheduledBatch


class DecodeFirstScheduling:
    """Mixed into Scheduler (running, policy, max_num_tokens, _schedule_running, _is_held)."""

    def _schedule_decodes_first(self, batch: ScheduledBatch) -> int:
        """Schedule running decodes, then running prefill chunks; the budget left for new
        requests."""
        budget = min(self.policy.step_token_budget, self.max_num_tokens)
        decodes = [r for r in self.running if self._is_decoding(r)]
        decode_budget = min(self.max_num_tokens, max(budget, len(decodes)))
        _fit_drafts(decodes, decode_budget - len(decodes))
        left = self._schedule_running(batch, decode_budget, self._is_decoding)
        left = max(0, budget - (decode_budget - left))
        return self._schedule_running(batch, left, lambda r: not self._is_decoding(r))

    def _is_decoding(self, request: Request) -> bool:
        """Whether the request (or its beam group) computes one token and samples next."""
        group = request.beam_group
        members = group.live_requests if group is not None else [request]
        return bool(members) and all(_next_is_decode(m) for m in members) \
            and not self._is_held(request)


def _next_is_decode(request: Request) -> bool:
    return (request.num_tokens - request.num_computed_tokens == 1
            and request.num_output_tokens < request.max_new_tokens)


def _fit_drafts(decodes: list[Request], spare: int) -> None:
    """Shorten drafts, in running order, to `spare` tokens in all."""
    for request in decodes:
        keep = min(len(request.draft_token_ids), max(0, spare))
        if keep < len(request.draft_token_ids):
            if keep == 0:
                request.clear_drafts()
            else:
                del request.draft_token_ids[keep:]
        spare -= keep
