"""Beam search, by HF transformers' rule (its `_beam_search`): each step the live beams'
logits become logprobs added to each beam's running score; the top K = max(2, 1 + number
of stop tokens) * B candidates over beams x vocabulary are taken (on the device); on the host
the candidates among the top B that end (a stop token, or the length limit) become finished
hypotheses scored sum / length ** length_penalty, and the best B that do not end are the next
beams. The group stops when the finished hypotheses cannot be beaten (`early_stopping`), or
no candidate can go on.

A group's first step has one live beam (the prompt's), as HF starts the other beams at
-1e9; its B beams exist from then on and step together."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tllm.request import Request

_NO_SCORE = -1.0e9  # HF's stand-in for an impossible candidate


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its output tokens (the stop token that ended it included)."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float                    # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str              # "stop" or "length"
    stop_reason: int | None = None  # the stop token id, when it was not an EOS token


@dataclass(frozen=True)
class BeamChoice:
    """Where one beam goes next: the live beam it continues (its row), and the token."""

    parent: int
    token_id: int
    cumulative_logprob: float


@dataclass(eq=False)
class BeamGroup:
    """The B beams (Requests) of one prompt and the search's state. `requests` are slots:
    after each step slot j holds the j-th best live beam."""

    requests: list[Request]
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_results: int = 1
    scores: list[float] = field(default_factory=list)   # running, per live beam
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most B
    is_started: bool = False     # the first step is done: every slot holds a live beam
    is_improvable: bool = True   # HF's early-stop heuristic has not fired yet
    is_done: bool = False
    num_generated: int = 0       # tokens each live beam has generated
    scheduled_in: object = None  # the ScheduledBatch that last considered the group

    def __post_init__(self) -> None:
        self.scores = [0.0]
        for request in self.requests:
            request.beam_group = self

    @property
    def beam_width(self) -> int:
        return len(self.requests)

    @property
    def live_requests(self) -> list[Request]:
        return self.requests if self.is_started else self.requests[:1]

    @property
    def stop_token_ids(self) -> frozenset[int]:
        request = self.requests[0]
        params = request.sampling_params
        eos = frozenset() if params.ignore_eos else request.eos_token_ids
        return eos | frozenset(params.stop_token_ids)

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.stop_token_ids)) * self.beam_width

    @property
    def max_new_tokens(self) -> int:
        return self.requests[0].max_new_tokens

    def results(self) -> list[Hypothesis]:
        """The best `num_results` hypotheses (once the group is done)."""
        return self.finished[:self.num_results]

    # ---- one step, on the host ----

    def step(self, values: list[float], indices: list[int], vocab_size: int) -> list[BeamChoice]:
        """Take one step's candidates (sorted best first; index = row * vocab + token):
        finished hypotheses updated, the next beams returned (meaningless once is_done)."""
        gen_len = self.num_generated + 1
        stops = self.stop_token_ids
        at_limit = gen_len >= self.max_new_tokens
        candidates = []
        for rank, (value, index) in enumerate(zip(values, indices)):
            parent, token = divmod(index, vocab_size)
            candidates.append((value, parent, token, at_limit or token in stops, rank))
        self._add_finished(candidates, gen_len, stops)
        if len(candidates) < self.beam_width:  # only where vocab < 2 x beam width
            raise ValueError(f"a beam width of {self.beam_width} needs at least that many "
                             f"candidates; the vocabulary ({vocab_size}) has too few tokens")
        running = sorted(candidates, key=lambda c: -(c[0] + _NO_SCORE * c[3]))
        running = running[:self.beam_width]
        self.scores = [c[0] + _NO_SCORE * c[3] for c in running]
        self.num_generated = gen_len
        self._check_done(all(c[3] for c in candidates))
        return [BeamChoice(c[1], c[2], c[0]) for c in running]

    def _add_finished(self, candidates: list[tuple], gen_len: int, stops: frozenset[int]) -> None:
        is_full = len(self.finished) == self.beam_width
        if not self.is_improvable or (is_full and self.early_stopping is True):
            return
        eos = self.requests[0].eos_token_ids
        for value, parent, token, hits, rank in candidates:
            if not hits or rank >= self.beam_width:
                continue
            tokens = self.live_requests[parent].output_token_ids + [token]
            is_stop = token in stops
            stop_reason = token if is_stop and token not in eos else None
            self.finished.append(Hypothesis(tokens, value,
                                            _length_normalized(value, gen_len,
                                                               self.length_penalty),
                                            "stop" if is_stop else "length", stop_reason))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.beam_width:]

    def _check_done(self, no_continuation: bool) -> None:
        """HF's stopping rule, after the step (num_generated already counts it)."""
        is_full = len(self.finished) == self.beam_width
        if self.early_stopping == "never" and self.length_penalty > 0:
            best_len = self.max_new_tokens
        else:
            best_len = self.num_generated
        if is_full:
            best_running = _length_normalized(self.scores[0], best_len, self.length_penalty)
            self.is_improvable &= best_running > self.finished[-1].score
        self.is_done = (not self.is_improvable or (is_full and self.early_stopping is True)
                        or no_continuation)


def _length_normalized(score: float, length: int, length_penalty: float) -> float:
    """score / length ** length_penalty (HF's), kept in the floats where the power leaves
    them (|penalty| in the hundreds): 0 or an infinity of the score's sign, never an
    OverflowError or a ZeroDivisionError."""
    try:
        return score / length ** length_penalty
    except OverflowError:       # the power is past the largest float: the score ends at 0
        return score * 0.0
    except ZeroDivisionError:   # ... below the smallest: the score grows without bound
        return math.copysign(math.inf, score) if score else 0.0


# ---- the candidates of a step, on the device ----

class BeamCandidates:
    """Each group's top-K candidates of one step, copied to the host without blocking (on
    CUDA, to pinned memory: `host()` waits for that copy alone, as SampledBatch does).
    `values[s]` / `indices[s]` are [len(members[s]), K] for the groups `members[s]`."""

    def __init__(self, groups: list[BeamGroup], members: list[list[int]],
                 values: list[torch.Tensor], indices: list[torch.Tensor],
                 vocab_size: int) -> None:
        self.groups = groups
        self.vocab_size = vocab_size
        self._members = members
        self._event = None
        tensors = values + indices
        if tensors and tensors[0].is_cuda:
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(host, tensors):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            tensors = host
        self._values, self._indices = tensors[:len(values)], tensors[len(values):]

    @property
    def requests(self) -> list[Request]:
        return [r for g in self.groups for r in g.requests]

    def host(self) -> list[tuple[BeamGroup, list[float], list[int]]]:
        """Per group: (group, candidate scores best first, flat indices row * vocab + id)."""
        if self._event is not None:
            self._event.synchronize()
        out = []
        for values, indices, members in zip(self._values, self._indices, self._members):
            for g, row_values, row_indices in zip(members, values.tolist(), indices.tolist()):
                out.append((self.groups[g], row_values, row_indices))
        return out


def beam_candidates(logits: torch.Tensor, groups: list[BeamGroup],
                    rows: list[list[int]]) -> BeamCandidates:
    """Top-K candidates of each group from its live beams' logit rows (`rows[g]`, in slot
    order), batched over groups of the same shape: log-softmax (fp32), stop tokens masked
    before min_tokens (after the log-softmax, as HF's logits processors), plus each beam's
    running score, top-K over beams x vocabulary."""
    vocab = logits.shape[-1]
    by_shape: dict[tuple[int, int], list[int]] = {}
    for g, group in enumerate(groups):
        by_shape.setdefault((len(rows[g]), group.num_candidates), []).append(g)
    values, indices, shapes = [], [], []
    for (num_rows, k), members in by_shape.items():
        index = torch.tensor([r for g in members for r in rows[g]], device=logits.device)
        logprobs = logits[index].float().log_softmax(dim=-1).view(len(members), num_rows, vocab)
        logprobs = _mask_early_stops(logprobs, [groups[g] for g in members])
        scores = torch.tensor([groups[g].scores for g in members], device=logits.device)
        flat = (logprobs + scores[:, :, None]).view(len(members), num_rows * vocab)
        top = flat.topk(min(k, num_rows * vocab), dim=-1)
        values.append(top.values)
        indices.append(top.indices)
        shapes.append(members)
    return BeamCandidates(groups, shapes, values, indices, vocab)


def _mask_early_stops(logprobs: torch.Tensor, groups: list[BeamGroup]) -> torch.Tensor:
    vocab = logprobs.shape[-1]
    rows, cols = [], []
    for i, group in enumerate(groups):
        if group.num_generated < group.requests[0].sampling_params.min_tokens:
            ids = [t for t in group.stop_token_ids if t < vocab]
            rows += [i] * len(ids)
            cols += ids
    if rows:
        logprobs = logprobs.clone()
        logprobs[torch.tensor(rows), :, torch.tensor(cols)] = float("-inf")
    return logprobs
