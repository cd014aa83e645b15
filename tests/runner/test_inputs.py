"""The model runner's input building: a ScheduledBatch flattened into token ids, positions,
KV slots, block tables and the rows whose logits the step needs."""
from __future__ import annotations

from tllm.request import PLACEHOLDER, Request
from tllm.runner.inputs import prepare_inputs
from tllm.sampling_params import SamplingParams
from tllm.scheduler.interface import ScheduledBatch

BLOCK = 4


def make_request(rid, prompt, computed=0, outputs=(), **params) -> Request:
    request = Request(rid, list(prompt), SamplingParams(**params), max_new_tokens=8)
    for token in outputs:
        request.append_token(token)
    request.num_computed_tokens = computed
    return request


def test_a_prefill_chunk_a_decode_and_a_placeholder():
    chunk = make_request("a", range(100, 110), computed=4)           # tokens 4..9 of 10
    decode = make_request("b", range(200, 205), computed=5, outputs=[9])
    overlap = make_request("c", range(300, 303), computed=3, outputs=[PLACEHOLDER])
    tables = {"a": [7, 3, 5], "b": [2, 8], "c": [6]}
    batch = ScheduledBatch([chunk, decode, overlap], [4, 1, 1])
    inputs = prepare_inputs(batch, lambda r: tables[r.request_id], BLOCK)
    plan = inputs.plan
    assert plan.input_ids == [104, 105, 106, 107, 9, 0]              # placeholder sent as 0
    assert plan.positions == [4, 5, 6, 7, 5, 3]
    # slot = block * tokens_per_block + offset, through each request's own table
    assert plan.slots == [3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 8 * 4 + 1, 6 * 4 + 3]
    assert plan.query_lens == [4, 1, 1] and plan.seq_lens == [8, 6, 4]
    assert plan.block_tables == [[7, 3, 5], [2, 8, 0], [6, 0, 0]]    # padded with block 0
    # the chunk ends mid-prompt: no logits for it
    assert inputs.sample_requests == [decode, overlap] and inputs.sample_rows == [4, 5]
    assert inputs.placeholder_requests == [overlap] and inputs.placeholder_rows == [5]
    assert plan.logit_rows == [4, 5]


def test_prompt_logprob_rows_skip_what_was_recorded():
    request = make_request("a", range(100, 108), computed=0, prompt_logprobs=1)
    inputs = prepare_inputs(ScheduledBatch([request], [5]), lambda r: [0, 1], BLOCK)
    # positions 0..4 predict tokens 1..5
    assert inputs.prompt_rows == [0, 1, 2, 3, 4]
    assert [t for _, t in inputs.prompt_targets] == [101, 102, 103, 104, 105]
    # recomputed after a preemption: the first 3 positions were recorded already
    request.prompt_logprobs = [None, {}, {}, {}]
    inputs = prepare_inputs(ScheduledBatch([request], [8]), lambda r: [0, 1], BLOCK)
    assert inputs.prompt_rows == [3, 4, 5, 6]                       # the last one samples
    assert inputs.sample_rows == [7] and inputs.plan.logit_rows == [7, 3, 4, 5, 6]
