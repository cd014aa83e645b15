"""The reference for the runner's vectorized inputs: a step built token by token from each
request's own lists and block tables (the loop the persistent batch replaced)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tllm.request import Request
from tllm.scheduler.interface import ScheduledBatch


@dataclass
class ReferenceStep:
    input_ids: list[int] = field(default_factory=list)    # 0 where the device has the id
    device_rows: list[int] = field(default_factory=list)  # ... those rows
    positions: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    slots: list[list[int]] = field(default_factory=list)       # per KV cache group
    tables: list[list[list[int]]] = field(default_factory=list)  # per group, per request
    sample_rows: list[int] = field(default_factory=list)
    sample_requests: list[Request] = field(default_factory=list)
    sample_counts: list[int] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[tuple[Request, int]] = field(default_factory=list)


def reference_step(batch: ScheduledBatch, group_tables, tokens_per_block: int) -> ReferenceStep:
    """`group_tables(request)`: the request's block table of every group."""
    bs = tokens_per_block
    step = ReferenceStep()
    for request, num_new in zip(batch.requests, batch.num_scheduled_tokens):
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        first_row = len(step.input_ids)
        drafts = request.draft_token_ids
        known = request.token_ids + [None] * request.num_in_flight + list(drafts)
        for p in range(start, end):
            if known[p] is None:
                step.device_rows.append(len(step.input_ids))
            step.input_ids.append(known[p] or 0)
            step.positions.append(p)
        tables = group_tables(request)
        if not step.slots:
            step.slots = [[] for _ in tables]
            step.tables = [[] for _ in tables]
        for g, table in enumerate(tables):
            step.tables[g].append(list(table))
            step.slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, end))
        step.query_lens.append(num_new)
        step.seq_lens.append(end)
        if drafts:
            last_known = first_row + num_new - 1 - len(drafts)
            step.sample_rows.extend(range(last_known, last_known + len(drafts) + 1))
            step.sample_requests.append(request)
            step.sample_counts.append(len(drafts) + 1)
        elif end == request.num_tokens:
            step.sample_rows.append(first_row + num_new - 1)
            step.sample_requests.append(request)
            step.sample_counts.append(1)
        if request.wants_prompt_logprobs:
            recorded = max(0, len(request.prompt_logprobs) - 1)
            for p in range(max(start, recorded), min(end, request.num_prompt_tokens - 1)):
                step.prompt_rows.append(first_row + p - start)
                step.prompt_targets.append((request, request.token_ids[p + 1]))
    return step
