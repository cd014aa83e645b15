"""The step token budget that protects running decodes (Sarathi-Serve's stall-free
batching): every running decode gets its token each step, first; prefill chunks (running
prompts, then new requests) fill what is left of the budget. A step then costs about a
decode step, so decodes never wait behind a whole prefill chunk.

Decodes are never cut to fit the budget (only max_num_tokens bounds them): when they alone
exceed it, prefills wait for decodes to finish. Drafts of speculative requests share what
the budget has beyond one token per decode, in running order.

Counted over the whole step (`step_token_budget`), the budget starves admission: the
running batch settles where its decodes plus the prompts that replace finishing requests
fill the budget (batch = budget * osl / (isl + osl)), and it fills slowly after a burst,
since each step admits only (budget - decodes) / isl prompts. `prefill_token_budget`
counts prefill tokens only, so the batch fills as under the default policy while a step
still costs at most a decode step plus that many prompt tokens; with whole chunks, new
prompts wait for enough free slots to fill the chunk, which leaves pure decode steps (CUDA
graphs) between the mixed ones instead of a small chunk in every step."""
from __future__ import annotations

from tllm.request import Request
from tllm.scheduler.interface import ScheduledBatch


class DecodeFirstScheduling:
    """Mixed into Scheduler (running, waiting, policy, max_batch_size, max_num_tokens,
    _schedule_running, _is_held, _held, _beam_holds, _step_limit)."""

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

    def _schedule_prefill_capped(self, batch: ScheduledBatch) -> int:
        """Schedule every running decode (drafts too) within max_num_tokens, then running
        prefill chunks within prefill_token_budget; the budget left for new requests (0
        while they wait to fill a whole chunk)."""
        decodes = [r for r in self.running if self._is_decoding(r)]
        _fit_drafts(decodes, self.max_num_tokens - len(decodes))
        left = self._schedule_running(batch, self.max_num_tokens, self._is_decoding)
        has_decodes = bool(batch.requests or self._held or self._beam_holds)
        if has_decodes:  # else no decode waits for this step: spend max_num_tokens
            left = min(left, self.policy.prefill_token_budget)
        left = self._schedule_running(batch, left, lambda r: not self._is_decoding(r))
        if has_decodes and self.policy.admit_whole_chunks and self._too_few_free_slots(
                batch, left):
            return 0
        return left

    def _too_few_free_slots(self, batch: ScheduledBatch, budget: int) -> bool:
        """Whether new requests should wait for more free slots: fewer are free than the
        waiting requests it takes to fill `budget` (at most an eighth of the batch, so the
        batch stays at least 7/8 full)."""
        free = min(self.max_batch_size - len(self.running), self._step_limit - len(batch))
        if free <= 0 or budget <= 0:
            return False  # nothing joins this step anyway
        most = min(len(self.waiting), max(1, self.max_batch_size // 8))
        num_needed, num_tokens = 0, 0
        while num_needed < most and num_tokens < budget:
            request = self.waiting[num_needed]
            num_tokens += request.num_tokens - request.num_computed_tokens
            num_needed += 1
        return free < num_needed

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
