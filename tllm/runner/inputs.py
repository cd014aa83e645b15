"""A ScheduledBatch flattened into one step's inputs: the token ids, positions, KV slots and
block tables of every scheduled token, and which rows' logits the step needs (the last token
of each request that samples, and prompt positions whose logprobs were asked for)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tllm.request import PLACEHOLDER, Request
from tllm.runner.step import StepPlan
from tllm.scheduler.interface import ScheduledBatch


@dataclass
class StepInputs:
    plan: StepPlan
    # rows of the flat token dimension whose logits are needed, in this order:
    sample_rows: list[int] = field(default_factory=list)      # last token of a request
    sample_requests: list[Request] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)      # prompt positions (logprobs)
    prompt_targets: list[tuple[Request, int]] = field(default_factory=list)  # (req, next id)
    # rows whose token was sampled last step and is still only on the device
    placeholder_rows: list[int] = field(default_factory=list)
    placeholder_requests: list[Request] = field(default_factory=list)
    # speculative decoding: per sample request, how many consecutive sample rows it has
    # (1 + its drafts: the target's logits after its last token and after each draft);
    # None when no request of the step has drafts (one row each)
    sample_counts: list[int] | None = None


def prepare_inputs(batch: ScheduledBatch, block_ids: Callable[[Request], list[int]],
                   tokens_per_block: int,
                   group_block_ids: Callable[[Request], list[list[int]]] | None = None
                   ) -> StepInputs:
    """`block_ids(request)` is the request's block table (from the KV cache manager); with
    several KV cache groups, `group_block_ids(request)` gives its table of every group."""
    bs = tokens_per_block
    ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
    group_slots: list[list[int]] = []          # groups 1..: the tokens' slots
    group_tables: list[list[list[int]]] = []   # groups 1..: the requests' tables
    inputs = StepInputs(None)  # type: ignore[arg-type]
    if any(r.draft_token_ids for r in batch.requests):
        inputs.sample_counts = []
    for request, num_new in zip(batch.requests, batch.num_scheduled_tokens):
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        first_row = len(ids)
        num_drafts = len(request.draft_token_ids)
        if num_drafts:
            ids.extend(request.token_ids[start:] + request.draft_token_ids)
            _add_draft_rows(inputs, request, first_row + num_new - 1 - num_drafts, num_drafts)
        else:
            ids.extend(request.token_ids[start:end])
        positions.extend(range(start, end))
        table = block_ids(request)
        tables.append(table)
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        if group_block_ids is not None:
            _add_group_tables(group_block_ids(request)[1:], start, end, bs, group_slots,
                              group_tables)
        query_lens.append(num_new)
        seq_lens.append(end)
        if end == request.num_tokens and not num_drafts:
            inputs.sample_rows.append(first_row + num_new - 1)
            inputs.sample_requests.append(request)
            if inputs.sample_counts is not None:
                inputs.sample_counts.append(1)
            if request.token_ids[-1] == PLACEHOLDER:
                ids[-1] = 0
                inputs.placeholder_rows.append(first_row + num_new - 1)
                inputs.placeholder_requests.append(request)
        if request.wants_prompt_logprobs:
            _add_prompt_rows(inputs, request, start, end, first_row)
    # one padded table (per group): a tensor per request costs ~5 us each at batch 256
    width = max(len(t) for t in tables)
    inputs.plan = StepPlan(ids, positions, slots, query_lens, seq_lens, _pad(tables, width),
                           inputs.sample_rows + inputs.prompt_rows, group_slots=group_slots,
                           group_block_tables=[_pad(t, width) for t in group_tables])
    return inputs


def _add_draft_rows(inputs: StepInputs, request: Request, last_known_row: int,
                    num_drafts: int) -> None:
    """The rows of a speculating request's last known token and of each of its drafts."""
    inputs.sample_rows.extend(range(last_known_row, last_known_row + num_drafts + 1))
    inputs.sample_requests.append(request)
    inputs.sample_counts.append(num_drafts + 1)


def _pad(tables: list[list[int]], width: int) -> list[list[int]]:
    return [t + [0] * (width - len(t)) for t in tables]


def _add_group_tables(request_tables: list[list[int]], start: int, end: int, bs: int,
                      group_slots: list[list[int]], group_tables: list[list[list[int]]]) -> None:
    """A request's tables of groups 1.. (every group's table has the length of the first)
    and its tokens' slots in each."""
    if not group_tables:
        group_slots.extend([] for _ in request_tables)
        group_tables.extend([] for _ in request_tables)
    for table, slots, tables in zip(request_tables, group_slots, group_tables):
        tables.append(table)
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))


def _add_prompt_rows(inputs: StepInputs, request: Request, start: int, end: int,
                     first_row: int) -> None:
    # after a preemption the prompt is computed again: skip what was recorded
    recorded = max(0, len(request.prompt_logprobs) - 1)
    for p in range(max(start, recorded), min(end, request.num_prompt_tokens - 1)):
        inputs.prompt_rows.append(first_row + p - start)
        inputs.prompt_targets.append((request, request.token_ids[p + 1]))
