"""Speculative decoding in the loop: asking the drafter for drafts before a step, and after
it, verifying them against the target's logits (tllm.speculative.acceptance) into each
request's new tokens, with the counters `get_stats` reports.

A request speculates only where verification reproduces its sampler exactly: no logit bias,
no penalties (they would need each position's own token history), past `min_tokens`. A
guided request's draft positions are masked by its grammar after the drafts before them. Its
drafts never reach beyond `max_new_tokens`, so a reservation made for its whole life holds.
Requests of the step without drafts are sampled by the ordinary sampler, as without
speculation."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tllm.outputs import PositionLogprobs
from tllm.request import Request
from tllm.runner.model_runner import StepOutput
from tllm.sampling.sampler import Sampler, token_logprobs
from tllm.speculative.acceptance import accept_greedy, accept_sampled
from tllm.speculative.interface import Drafter

logger = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """Counters over the engine's life. A verify step is one request's step with drafts."""

    num_draft_tokens: int = 0      # drafts the target verified
    num_accepted_tokens: int = 0   # of those, accepted
    num_verify_steps: int = 0
    drafter_off: bool = False      # the drafter failed once: no drafts since

    def as_dict(self) -> dict[str, int | float]:
        steps, drafted = self.num_verify_steps, self.num_draft_tokens
        return {"spec_draft_tokens": drafted,
                "spec_accepted_tokens": self.num_accepted_tokens,
                "spec_verify_steps": steps,
                "spec_drafter_off": int(self.drafter_off),
                "spec_acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
                # tokens a verify step gains: the accepted drafts plus the target's own token
                "spec_mean_accepted_length":
                    (self.num_accepted_tokens + steps) / steps if steps else 0.0}


@dataclass
class VerifiedBatch:
    """A verified step's outcome per request (in the order of `requests`): its new tokens,
    their logprobs where asked for, and how many drafts it had and kept."""

    requests: list[Request]
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[tuple[PositionLogprobs, float]] | None] = field(default_factory=list)
    num_drafts: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)


def can_speculate(request: Request) -> bool:
    params = request.sampling_params
    return (not params.logit_bias and params.repetition_penalty == 1.0
            and not params.presence_penalty and not params.frequency_penalty
            and request.num_output_tokens >= params.min_tokens)


class Speculation:
    """The drafter's side of the loop and the verification of its drafts."""

    def __init__(self, drafter: Drafter, sampler: Sampler) -> None:
        self.drafter = drafter
        self.sampler = sampler
        self.stats = SpecStats()

    def draft_len(self, request: Request) -> int:
        """How many drafts the request takes next step (0: it does not speculate)."""
        if (request.num_computed_tokens != request.num_tokens - 1 or request.is_finished
                or request.num_in_flight or not can_speculate(request)):
            return 0
        room = request.max_new_tokens - request.num_output_tokens - 1
        return max(0, min(self.drafter.max_draft_len, room))

    def propose(self, running: list[Request]) -> None:
        """Drafts for the running requests that decode next (set on each request). A
        drafter that raises turns speculation off for the engine's life: drafts only speed
        decoding up, and its requests would otherwise be scheduled into the failure again
        (the failed step holds nothing in flight to fail)."""
        if self.stats.drafter_off:
            return
        requests, lengths = [], []
        for request in running:
            request.clear_drafts()
            k = self.draft_len(request)
            if k:
                requests.append(request)
                lengths.append(k)
        if not requests:
            return
        try:
            drafts = self.drafter.propose(requests, lengths)
        except Exception:
            logger.exception("the drafter failed: speculative decoding is off from now on")
            self.stats.drafter_off = True
            return
        for i, (request, k) in enumerate(zip(requests, lengths)):
            request.draft_token_ids = list(drafts.token_ids[i][:k])
            if drafts.probs is not None and request.draft_token_ids:
                request.draft_probs = drafts.probs[i, :len(request.draft_token_ids)]

    def verify(self, output: StepOutput) -> VerifiedBatch:
        """Each live request's new tokens from a step whose sample rows include drafts."""
        rows = _row_ranges(output.sample_counts)
        live = [i for i, r in enumerate(output.sample_requests) if not r.is_finished]
        requests = [output.sample_requests[i] for i in live]
        batch = VerifiedBatch(requests, [[] for _ in live], [None] * len(live),
                              [0] * len(live), [0] * len(live))
        plain = [j for j, i in enumerate(live) if output.sample_counts[i] == 1]
        spec = [j for j, i in enumerate(live) if output.sample_counts[i] > 1]
        logits = output.sample_logits
        if plain:  # with their slots: their penalty counts live there
            self._sample_plain(batch, plain, logits[[rows[live[j]].start for j in plain]],
                               output.sample_slots[[live[j] for j in plain]])
        if spec:
            self._verify_drafts(batch, spec, logits, [rows[live[j]] for j in spec])
        for j in spec:
            self.stats.num_verify_steps += 1
            self.stats.num_draft_tokens += batch.num_drafts[j]
            self.stats.num_accepted_tokens += batch.num_accepted[j]
        return batch

    def _sample_plain(self, batch: VerifiedBatch, members: list[int],
                      logits: torch.Tensor, slots) -> None:
        requests = [batch.requests[j] for j in members]
        out = self.sampler.sample(logits, requests, slots).host()
        for row, j in enumerate(members):
            batch.token_ids[j] = [out.token_ids[row]]
            if out.logprobs[row] is not None:
                batch.logprobs[j] = [(out.logprobs[row], out.sampled_logprobs[row])]

    def _verify_drafts(self, batch: VerifiedBatch, members: list[int], logits: torch.Tensor,
                       ranges: list[range]) -> None:
        """Acceptance on the device; the host reads its outcome once (one copy, one wait)."""
        requests = [batch.requests[j] for j in members]
        width = max(len(r) for r in ranges)  # K + 1
        device = logits.device
        # [S, K+1] rows of the flat logits; padding repeats a request's last row (ignored).
        # Host lists go to the device without blocking: torch.tensor(..., device=cuda)
        # would wait for the forward before the host has anything else to launch.
        index = _to_device([[r[min(c, len(r) - 1)] for c in range(width)] for r in ranges],
                           device)
        drafts = _to_device([r.draft_token_ids + [0] * (width - 1 - len(r.draft_token_ids))
                             for r in requests], device)
        num_drafts = _to_device([len(r.draft_token_ids) for r in requests], device)
        target = raw = logits[index]  # the model's dtype: argmax needs no float copy
        if self.sampler.guided is not None:  # each position as the grammar allows it
            target = self.sampler.guided.mask_verify_logits(target, requests)
        greedy = [s for s, r in enumerate(requests) if r.sampling_params.is_greedy]
        if len(greedy) == len(requests):
            tokens, accepted = accept_greedy(target, drafts, num_drafts)
        else:
            target = target.float()
            tokens = torch.empty_like(index)
            accepted = torch.empty_like(num_drafts)
            sampled = [s for s, r in enumerate(requests) if not r.sampling_params.is_greedy]
            if greedy:
                g = _to_device(greedy, device)
                tokens[g], accepted[g] = accept_greedy(target[g], drafts[g], num_drafts[g])
            s = _to_device(sampled, device)
            tokens[s], accepted[s] = self._accept_sampled(
                target[s], drafts[s], num_drafts[s], [requests[i] for i in sampled])
        outcome = torch.cat([tokens, accepted[:, None]], dim=1).tolist()
        self._fill(batch, members, requests, (raw, target),
                   [row[:-1] for row in outcome], [row[-1] for row in outcome])

    def _accept_sampled(self, target: torch.Tensor, drafts: torch.Tensor,
                        num_drafts: torch.Tensor, requests: list[Request]):
        num, width, vocab = target.shape
        repeated = [r for r in requests for _ in range(width)]
        probs = self.sampler.processed_probs(target.flatten(0, 1), repeated)
        draft_probs = None
        if any(r.draft_probs is not None for r in requests):
            draft_probs = torch.zeros(num, width - 1, vocab, device=target.device)
            for i, r in enumerate(requests):
                k = len(r.draft_token_ids)
                if r.draft_probs is not None:
                    draft_probs[i, :k] = r.draft_probs[:k].float()
                else:  # one-hot
                    draft_probs[i, torch.arange(k), drafts[i, :k]] = 1.0
        return accept_sampled(probs.view(num, width, vocab), drafts, num_drafts, draft_probs,
                              [r.generator for r in requests],
                              default_generator=self.sampler.generator)

    def _fill(self, batch: VerifiedBatch, members: list[int], requests: list[Request],
              logits: tuple[torch.Tensor, torch.Tensor], tokens: list[list[int]],
              accepted: list[int]) -> None:
        """`logits`: the target's at each position, raw and after the grammar's mask."""
        raw, target = logits
        for s, (j, request) in enumerate(zip(members, requests)):
            n = accepted[s] + 1
            batch.token_ids[j] = tokens[s][:n]
            batch.num_drafts[j] = len(request.draft_token_ids)
            batch.num_accepted[j] = accepted[s]
            if request.sampling_params.logprobs is not None:
                batch.logprobs[j] = self._logprobs(request, raw[s, :n], target[s, :n],
                                                   tokens[s][:n])

    def _logprobs(self, request: Request, raw: torch.Tensor, target: torch.Tensor,
                  tokens: list[int]) -> list:
        """The accepted tokens' logprobs, of the distribution logprobs_mode names (at each
        position the sampler's: speculating requests have no bias or penalties)."""
        n, vocab = len(tokens), raw.shape[-1]
        rows = None
        if request.sampling_params.logprobs_mode != "raw_logprobs":
            rows = self.sampler.request_rows([request] * n, vocab)
        out = token_logprobs(raw, torch.tensor(tokens, device=raw.device), [request] * n,
                             rows, target)
        return list(zip(out.logprobs, out.sampled_logprobs))


def _to_device(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _row_ranges(counts: list[int]) -> list[range]:
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges
