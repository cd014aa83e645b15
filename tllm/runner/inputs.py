"""Rank 0's view of a step: the ScheduledBatch as a StepDiff over the persistent batch
(runner/batch_state.py), the token ids the host knows, the rows whose ids the device holds
(tokens the previous step sampled, not yet on the host: the next step reads them from the
device token table), and which rows' logits the step needs (the last token of each request
that samples, its drafts' rows, and prompt positions whose logprobs were asked for).

Everything per token is an array operation; the host loops over requests only to read
their progress, and over those whose prompt tokens it sends."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tllm.request import Request
from tllm.runner.batch_state import BatchTables, SlotAssigner, StepArrays, StepDiff
from tllm.runner.pooling import StepPooling, pooling_segments
from tllm.scheduler.interface import ScheduledBatch


@dataclass
class StepInputs:
    diff: StepDiff
    arrays: StepArrays
    input_ids: np.ndarray                  # [T] int64; 0 where the device has the id
    device_rows: np.ndarray                # rows whose id is in the device token table
    device_slots: np.ndarray               # ... at these slots
    # rows of the flat token dimension whose logits are needed, in this order:
    sample_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    sample_requests: list[Request] = field(default_factory=list)
    sample_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    prompt_rows: list[int] = field(default_factory=list)      # prompt positions (logprobs)
    prompt_targets: list[tuple[Request, int]] = field(default_factory=list)  # (req, next id)
    # speculative decoding: per sample request, how many consecutive sample rows it has
    # (1 + its drafts: the target's logits after its last token and after each draft);
    # None when no request of the step has drafts (one row each)
    sample_counts: list[int] | None = None
    # the step's pooling requests and their rows (None: it has none)
    pooling: StepPooling | None = None

    @property
    def logit_rows(self) -> np.ndarray:
        if not self.prompt_rows:
            return self.sample_rows
        return np.concatenate([self.sample_rows, np.array(self.prompt_rows, np.int64)])


def build_step_inputs(batch: ScheduledBatch, slots: SlotAssigner, tables: BatchTables,
                      may_have_drafts: bool = True) -> StepInputs:
    """The batch as a diff (applied to rank 0's tables) and the step's host inputs.
    `may_have_drafts`: False when no request can carry drafts (no drafter), which spares
    a look at every request."""
    for request in batch.preempted:
        slots.release(request)
    requests = batch.requests
    # the requests' progress: computed, known on the host, sampled on the device
    diff = slots.diff(requests, batch.num_scheduled_tokens,
                      np.array([r.num_computed_tokens for r in requests], dtype=np.int64))
    tables.apply(diff.table_writes)
    arrays = tables.build(diff)
    known = np.array([len(r.token_ids) for r in requests], dtype=np.int64)
    num_tokens = known + np.array([r.num_in_flight for r in requests], dtype=np.int64)
    starts, ends = diff.num_computed, diff.num_computed + diff.query_lens
    first_rows = arrays.query_start_loc[:-1]
    input_ids = np.zeros(diff.num_tokens, dtype=np.int64)
    _fill_host_ids(input_ids, requests, starts, np.minimum(ends, known), first_rows)
    # the in-flight token (at most one a request) is read from the device
    on_device = (known >= starts) & (known < ends) & (num_tokens > known)
    inputs = StepInputs(diff, arrays, input_ids,
                        first_rows[on_device] + (known - starts)[on_device],
                        diff.slots[on_device])
    is_pooling = slots.is_pooling[diff.slots]
    has_pooling = is_pooling.any()
    if has_pooling:  # they pool their rows and sample none
        inputs.pooling = pooling_segments(requests, is_pooling, starts, ends, first_rows,
                                          diff.num_tokens)
    if may_have_drafts and any(r.draft_token_ids for r in requests):  # (nothing in flight)
        _add_drafts(inputs, requests, [len(r.draft_token_ids) for r in requests], starts,
                    num_tokens, first_rows)
    else:
        samples = np.flatnonzero(ends == num_tokens)
        if has_pooling:
            samples = samples[~is_pooling[samples]]
        inputs.sample_rows = arrays.query_start_loc[samples + 1] - 1
        inputs.sample_requests = (list(requests) if len(samples) == len(requests)
                                  else [requests[i] for i in samples])
        inputs.sample_slots = diff.slots[samples]
    if slots.wants_prompt_logprobs[diff.slots].any():
        for i, request in enumerate(requests):
            if request.wants_prompt_logprobs:
                _add_prompt_rows(inputs, request, int(starts[i]), int(ends[i]),
                                 int(first_rows[i]))
    return inputs


def _fill_host_ids(input_ids: np.ndarray, requests: list[Request], starts: np.ndarray,
                   host_ends: np.ndarray, first_rows: np.ndarray) -> None:
    """Each request's tokens the host knows among those it computes: a decode's one token
    (gathered in one pass) or a prompt chunk's slice."""
    counts = host_ends - starts
    single = np.flatnonzero(counts == 1)
    if len(single):
        input_ids[first_rows[single]] = [requests[i].token_ids[starts[i]] for i in single]
    for i in np.flatnonzero(counts > 1):
        row = first_rows[i]
        input_ids[row:row + counts[i]] = requests[i].token_ids[starts[i]:host_ends[i]]


def _add_drafts(inputs: StepInputs, requests: list[Request], num_drafts: list[int],
                starts: np.ndarray, num_tokens: np.ndarray, first_rows: np.ndarray) -> None:
    """A speculating request's drafts follow its tokens (all known on the host: drafts are
    proposed only then); it samples at its last token and at each draft. A request without
    drafts samples at its last token if that is its newest."""
    rows, sample_requests, counts, seqs = [], [], [], []
    ends = starts + inputs.diff.query_lens
    for i, request in enumerate(requests):
        k = num_drafts[i]
        known_end = int(first_rows[i] + num_tokens[i] - starts[i])  # the row after the last
        if k:
            inputs.input_ids[known_end:known_end + k] = request.draft_token_ids
        elif ends[i] != num_tokens[i] or request.pooling_params is not None:
            continue
        rows.extend(range(known_end - 1, known_end + k))
        sample_requests.append(request)
        counts.append(k + 1)
        seqs.append(i)
    inputs.sample_rows = np.array(rows, dtype=np.int64)
    inputs.sample_slots = inputs.diff.slots[np.array(seqs, dtype=np.int64)]
    inputs.sample_requests = sample_requests
    inputs.sample_counts = counts


def _add_prompt_rows(inputs: StepInputs, request: Request, start: int, end: int,
                     first_row: int) -> None:
    # after a preemption the prompt is computed again: skip what was recorded
    recorded = max(0, len(request.prompt_logprobs) - 1)
    for p in range(max(start, recorded), min(end, request.num_prompt_tokens - 1)):
        inputs.prompt_rows.append(first_row + p - start)
        inputs.prompt_targets.append((request, request.token_ids[p + 1]))
