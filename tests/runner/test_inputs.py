"""The runner's step inputs from its persistent batch (slots, block tables changed by diff,
vectorized positions and KV slots) against the reference that builds them token by token,
over random sequences of steps: new, finished and preempted requests, chunked prefill,
tokens still on the device, drafts, prompt logprobs, several KV cache groups, tables that
grow, shrink (rolled-back drafts), pass a window or are forked."""
from __future__ import annotations

import random

import numpy as np
import pytest

from tllm.kv_cache.block_table import cdiv
from tllm.request import Request
from tllm.runner.batch_state import BatchTables, SlotAssigner
from tllm.runner.inputs import build_step_inputs
from tllm.sampling_params import SamplingParams
from tllm.scheduler.interface import ScheduledBatch

from tests.runner.reference_inputs import reference_step

BLOCK = 4
NULL_BLOCK = 0


class FakeKVTables:
    """The part of the KV cache manager the runner reads: tables and their changes."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.tokens_per_block = BLOCK
        self.tables: dict[str, list[list[int]]] = {}
        self._changes: dict[str, int] = {}
        self._next_block = 1

    def take_table_changes(self) -> dict[str, int]:
        changes, self._changes = self._changes, {}
        return changes

    def group_block_ids_of(self, request_id: str) -> list[list[int]]:
        return self.tables[request_id]

    def tables_of(self, request: Request) -> list[list[int]]:
        return self.tables[request.request_id]

    def mark(self, request_id: str, index: int) -> None:
        self._changes[request_id] = min(index, self._changes.get(request_id, index))

    def new_table(self, request_id: str) -> None:
        self.tables[request_id] = [[] for _ in range(self.num_groups)]

    def grow(self, request_id: str, num_blocks: int) -> None:
        table = self.tables[request_id]
        if len(table[0]) >= num_blocks:
            return
        self.mark(request_id, len(table[0]))
        for blocks in table:
            while len(blocks) < num_blocks:
                blocks.append(self._next_block)
                self._next_block += 1

    def truncate(self, request_id: str, num_blocks: int) -> None:
        for blocks in self.tables[request_id]:
            del blocks[num_blocks:]
        self.mark(request_id, num_blocks)

    def pass_window(self, request_id: str, num_blocks: int) -> None:
        """The window group (group 1) gives back its first blocks: the null block instead."""
        blocks = self.tables[request_id][1]
        num_blocks = min(num_blocks, len(blocks))
        if num_blocks:
            blocks[:num_blocks] = [NULL_BLOCK] * num_blocks
            self.mark(request_id, 0)

    def fork(self, target: str, source: str) -> None:
        self.tables[target] = [list(b) for b in self.tables[source]]
        self.mark(target, 0)


def new_request(rng: random.Random, index: int) -> Request:
    prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))]
    params = SamplingParams(max_tokens=64,
                            prompt_logprobs=1 if rng.random() < 0.15 else None)
    return Request(f"r{index}", prompt, params, max_new_tokens=64)


def give_progress(rng: random.Random, request: Request, spec: bool) -> int:
    """Random progress for the request this step; how many tokens it computes."""
    request.clear_drafts()
    if spec and request.num_in_flight == 0 and rng.random() < 0.5:
        request.num_computed_tokens = request.num_tokens - 1
        request.draft_token_ids = [rng.randrange(3, 500) for _ in range(rng.randint(1, 4))]
        return 1 + len(request.draft_token_ids)
    left = request.num_tokens - request.num_computed_tokens
    if left <= 0:
        request.append_token(rng.randrange(3, 500))
        left = request.num_tokens - request.num_computed_tokens
    return rng.randint(1, left)


def advance(rng: random.Random, request: Request, num_new: int) -> None:
    """After the step: progress, and maybe a token on its way (or on the host)."""
    # drafts are rolled back (none accepted): progress ends at the known tokens
    request.num_computed_tokens = min(request.num_computed_tokens + num_new,
                                      request.num_tokens)
    request.clear_drafts()
    if request.num_computed_tokens == request.num_tokens:
        if request.num_in_flight:
            request.receive_token(rng.randrange(3, 500))
        if rng.random() < 0.5:
            request.mark_sampled()
        else:
            request.append_token(rng.randrange(3, 500))


def check_step(batch: ScheduledBatch, kv: FakeKVTables, slots: SlotAssigner,
               tables: BatchTables) -> None:
    ref = reference_step(batch, kv.tables_of, BLOCK)
    inputs = build_step_inputs(batch, slots, tables)
    arrays = inputs.arrays
    device_rows = set(inputs.device_rows.tolist())
    assert sorted(device_rows) == ref.device_rows
    assert inputs.input_ids.tolist() == ref.input_ids
    row_request = np.repeat(np.arange(len(batch.requests)), batch.num_scheduled_tokens)
    expected_slots = [slots.slot_of(batch.requests[row_request[r]]) for r in ref.device_rows]
    assert sorted(zip(inputs.device_rows.tolist(), inputs.device_slots.tolist())) == \
        list(zip(ref.device_rows, expected_slots))
    assert arrays.positions.tolist() == ref.positions
    assert arrays.query_start_loc.tolist() == [0, *np.cumsum(ref.query_lens).tolist()]
    assert arrays.seq_lens.tolist() == ref.seq_lens
    got_slots = [arrays.slot_mapping, *arrays.group_slot_mappings]
    got_tables = [arrays.block_tables, *arrays.group_block_tables]
    width = cdiv(max(ref.seq_lens), BLOCK)
    for g in range(kv.num_groups):
        assert got_slots[g].tolist() == ref.slots[g]
        expected = [(t + [0] * width)[:width] for t in ref.tables[g]]
        assert got_tables[g].tolist() == expected
    assert inputs.sample_rows.tolist() == ref.sample_rows
    assert inputs.sample_requests == ref.sample_requests
    has_drafts = any(r.draft_token_ids for r in batch.requests)
    assert inputs.sample_counts == (ref.sample_counts if has_drafts else None)
    assert inputs.prompt_rows == ref.prompt_rows
    assert inputs.prompt_targets == ref.prompt_targets
    assert inputs.logit_rows.tolist() == ref.sample_rows + ref.prompt_rows


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_groups", [1, 2])
def test_random_steps_equal_the_token_by_token_reference(seed, num_groups):
    rng = random.Random(seed * 10 + num_groups)
    num_slots = 12
    kv = FakeKVTables(num_groups)
    slots = SlotAssigner(num_slots, kv)
    tables = BatchTables(num_slots, 64, num_groups, BLOCK)
    live: list[Request] = []
    count = 0
    for _ in range(40):
        batch = ScheduledBatch()
        spec = rng.random() < 0.3  # speculation runs without tokens in flight
        for request in list(live):
            event = rng.random()
            if event < 0.1:  # finished
                live.remove(request)
                slots.free(request)
                del kv.tables[request.request_id]
            elif event < 0.15:  # preempted: recomputed from scratch with a new table
                batch.preempted.append(request)
                request.num_computed_tokens = 0
                kv.new_table(request.request_id)
        while len(live) < num_slots and rng.random() < 0.6:
            count += 1
            live.append(new_request(rng, count))
            kv.new_table(live[-1].request_id)
        for request in rng.sample(live, rng.randint(0, len(live))):
            if spec and request.num_in_flight:
                continue
            num_new = give_progress(rng, request, spec)
            end = request.num_computed_tokens + num_new
            if rng.random() < 0.2 and len(kv.tables[request.request_id][0]) > cdiv(end, BLOCK):
                kv.truncate(request.request_id, cdiv(end, BLOCK))  # drafts rolled back
            kv.grow(request.request_id, cdiv(end, BLOCK) + rng.randint(0, 1))
            if num_groups > 1 and rng.random() < 0.2:
                kv.pass_window(request.request_id, request.num_computed_tokens // BLOCK)
            batch.add(request, num_new)
        others = [r for r in live if r not in batch.requests and r.request_id in kv.tables]
        if others and len(live) > 1 and rng.random() < 0.2:  # a beam fork
            target = rng.choice(others)
            kv.fork(target.request_id, rng.choice(live).request_id)
        if not batch.requests:
            continue
        check_step(batch, kv, slots, tables)
        for request, num_new in zip(batch.requests, batch.num_scheduled_tokens):
            advance(rng, request, num_new)


def test_a_prefill_chunk_a_decode_and_a_token_on_the_device():
    kv = FakeKVTables(1)
    slots = SlotAssigner(4, kv)
    tables = BatchTables(4, 8, 1, BLOCK)
    chunk = Request("a", list(range(100, 110)), SamplingParams(), 8)
    decode = Request("b", list(range(200, 205)), SamplingParams(), 8)
    on_device = Request("c", list(range(300, 303)), SamplingParams(), 8)
    chunk.num_computed_tokens, decode.num_computed_tokens = 4, 5
    decode.append_token(9)
    on_device.num_computed_tokens = 3
    on_device.mark_sampled()
    kv.tables = {"a": [[7, 3, 5]], "b": [[2, 8]], "c": [[6]]}
    inputs = build_step_inputs(ScheduledBatch([chunk, decode, on_device], [4, 1, 1]), slots,
                               tables)
    assert inputs.input_ids.tolist() == [104, 105, 106, 107, 9, 0]  # the last is on the device
    assert inputs.device_rows.tolist() == [5]
    assert inputs.device_slots.tolist() == [slots.slot_of(on_device)]
    assert inputs.arrays.positions.tolist() == [4, 5, 6, 7, 5, 3]
    # slot = block * tokens_per_block + offset, through each request's own table
    assert inputs.arrays.slot_mapping.tolist() == [12, 13, 14, 15, 33, 27]
    assert inputs.arrays.seq_lens.tolist() == [8, 6, 4]
    assert inputs.arrays.block_tables.tolist() == [[7, 3], [2, 8], [6, 0]]
    # the chunk ends mid-prompt: no logits for it
    assert inputs.sample_requests == [decode, on_device]
    assert inputs.sample_rows.tolist() == [4, 5]


def test_a_slot_is_reused_with_its_old_table_cleared():
    kv = FakeKVTables(1)
    slots = SlotAssigner(1, kv)
    tables = BatchTables(1, 8, 1, BLOCK)
    first = Request("a", list(range(10)), SamplingParams(), 8)
    kv.tables["a"] = [[1, 2, 3]]
    build_step_inputs(ScheduledBatch([first], [10]), slots, tables)
    slots.free(first)
    second = Request("b", [5], SamplingParams(), 8)
    kv.tables["b"] = [[9]]
    build_step_inputs(ScheduledBatch([second], [1]), slots, tables)
    assert tables.tables[0, 0, :4].tolist() == [9, 0, 0, 0]
    with pytest.raises(RuntimeError, match="batch slots"):
        build_step_inputs(ScheduledBatch([second, first], [1, 1]), slots, tables)
