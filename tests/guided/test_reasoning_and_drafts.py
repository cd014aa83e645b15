"""Guided decoding after reasoning (the grammar starts once `</think>` is generated, or at
once when the prompt closed the thinking) and speculative drafts checked against the grammar
(each draft position masked by the grammar after the drafts before it; the matcher advanced
only by accepted tokens), on tiny random models."""
from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from tests.guided.schemas import SCHEMAS
from tllm import LLM, GuidedDecodingParams, KvCacheConfig, SamplingParams
from tllm.guided import grammar_cache
from tllm.guided.manager import GuidedDecoding
from tllm.config import NGramDecodingConfig
from tllm.request import Request

TAGS = ("<think>", "</think>")
LLM_ARGS = dict(max_seq_len=512, max_batch_size=16,
                kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=8192))
SCHEMA = SCHEMAS[0]


@pytest.fixture(scope="module")
def think_llm(think_model_dir):
    with LLM(think_model_dir, **LLM_ARGS) as llm:
        yield llm


def _ids(llm: LLM, text: str) -> list[int]:
    return llm._engine.tokenizer.encode(text, add_special_tokens=False)


def _params(bias: dict[int, float] | None = None, **kind) -> SamplingParams:
    return SamplingParams(max_tokens=96, temperature=0, logit_bias=bias,
                          guided_decoding=GuidedDecodingParams(reasoning_tags=TAGS, **kind))


def test_grammar_starts_after_the_thinking_ends(think_llm):
    (start,), (end,) = _ids(think_llm, "<think>"), _ids(think_llm, "</think>")
    # the prompt opened the thinking; a bias makes the model close it at once: that token
    # is free (no grammar would take it), then the grammar holds
    out = think_llm.generate({"prompt_token_ids": _ids(think_llm, "hello <think>")},
                             _params({end: 100.0}, json=SCHEMA), use_tqdm=False).outputs[0]
    assert out.token_ids[0] == end
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(think_llm._engine.tokenizer.decode(out.token_ids[1:])),
                        SCHEMA)
    # thinking disabled in the prompt (Qwen3's template closes it): the grammar holds at once
    closed = think_llm.generate({"prompt_token_ids": _ids(think_llm, "hi <think></think>")},
                                _params({end: 100.0}, json=SCHEMA), use_tqdm=False)
    assert closed.outputs[0].token_ids[0] != end
    jsonschema.validate(json.loads(closed.outputs[0].text), SCHEMA)
    assert think_llm._engine.executor.guided.num_active == 0


def test_reasoning_tags_must_be_tokens(llm_without_tags):
    bad = SamplingParams(guided_decoding=GuidedDecodingParams(json=SCHEMA,
                                                              reasoning_tags=TAGS))
    with pytest.raises(ValueError, match="reasoning_tags"):
        llm_without_tags.generate("hello", bad, use_tqdm=False)
    with pytest.raises(ValueError, match="reasoning_tags"):
        GuidedDecodingParams(regex="a", reasoning_tags=("<think>",))


@pytest.fixture(scope="module")
def llm_without_tags(tiny_model_dir):
    with LLM(tiny_model_dir, **LLM_ARGS) as llm:
        yield llm


def _manager(llm: LLM) -> GuidedDecoding:
    engine = llm._engine
    return GuidedDecoding(engine.tokenizer, grammar_cache(engine.tokenizer).vocab_size)


def _request(prompt: list[int], params: GuidedDecodingParams) -> Request:
    return Request("r", prompt, SamplingParams(max_tokens=8, guided_decoding=params), 8)


def _allowed(manager: GuidedDecoding, request: Request, vocab: int) -> set[int]:
    logits = manager.mask_logits(torch.zeros(1, vocab), [request])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_gate_states_step_by_step(think_llm):
    manager, vocab = _manager(think_llm), think_llm._engine.executor.guided.cache.vocab_size
    (start,), (end,) = _ids(think_llm, "<think>"), _ids(think_llm, "</think>")
    params = GuidedDecodingParams(regex="[0-9]+", reasoning_tags=TAGS)
    digits = set(_ids(think_llm, "0123456789"))
    # no tag in the prompt: the first token may open the thinking or begin the answer
    request = _request(_ids(think_llm, "hi"), params)
    manager.prepare(SimpleNamespace(requests=[request]))
    assert start in _allowed(manager, request, vocab) and end not in _allowed(
        manager, request, vocab)
    assert manager.accept(request, start) is False
    assert len(_allowed(manager, request, vocab)) == vocab     # thinking: free
    for token in _ids(think_llm, "abc") + [end]:
        assert manager.accept(request, token) is False
    allowed = _allowed(manager, request, vocab)
    assert digits & allowed and not allowed & {start, end}
    manager.accept(request, next(iter(digits)))
    # a first token that begins the answer goes to the grammar
    other = _request(_ids(think_llm, "hi"), params)
    manager.prepare(SimpleNamespace(requests=[other]))
    manager.accept(other, next(iter(digits)))
    assert start not in _allowed(manager, other, vocab)
    with pytest.raises(ValueError, match="does not continue"):
        manager.accept(other, _ids(think_llm, "a")[0])
    for r in (request, other):
        manager.free(r)
    assert manager.num_active == 0


def test_verify_mask_follows_the_drafts(think_llm):
    manager, vocab = _manager(think_llm), think_llm._engine.executor.guided.cache.vocab_size
    (end,) = _ids(think_llm, "</think>")
    params = GuidedDecodingParams(json=SCHEMA, reasoning_tags=TAGS)
    request = _request(_ids(think_llm, "x <think>"), params)
    manager.prepare(SimpleNamespace(requests=[request]))
    drafts = [_ids(think_llm, "a")[0], end] + _ids(think_llm, '{"name": ') + [
        _ids(think_llm, "]")[0], _ids(think_llm, "a")[0]]   # "]" breaks the grammar
    request.draft_token_ids = drafts
    width = len(drafts) + 1
    masked = manager.mask_verify_logits(torch.randn(1, width, vocab), [request])[0]
    allowed = [set(torch.nonzero(row.isfinite()).flatten().tolist()) for row in masked]
    assert len(allowed[0]) == len(allowed[1]) == vocab   # thinking until </think>
    reference = _manager(think_llm)
    twin = _request(request.prompt_token_ids, params)
    reference.prepare(SimpleNamespace(requests=[twin]))
    for position, token in enumerate(drafts[:-1]):
        if position >= 2:   # each position as a matcher fed the drafts before it allows
            assert allowed[position] == _allowed(reference, twin, vocab), position
        if position < len(drafts) - 2:
            reference.accept(twin, token)
    assert allowed[-1] == allowed[-2] == allowed[-3]    # past the refused "]": unused
    # the matcher is where it was: the first real token is the one that is checked
    request.draft_token_ids = []
    assert manager.accept(request, _ids(think_llm, "a")[0]) is False   # still thinking


def test_guided_requests_speculate_with_the_same_output(tiny_model_dir, llm_without_tags):
    prompts = ['{"name": "ada", "age": 36', "[1, 2", '{"items": [{"id": 1}, {"id": 2}]',
               "hello world"]
    schemas = [SCHEMAS[0], SCHEMAS[5], SCHEMAS[7], SCHEMAS[21]]
    params = [SamplingParams(max_tokens=96, temperature=0,
                             guided_decoding=GuidedDecodingParams(json=s)) for s in schemas]
    plain = llm_without_tags.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_model_dir, speculative_config=NGramDecodingConfig(max_draft_len=3),
             **LLM_ARGS) as engine:
        speculated = engine.generate(prompts, params, use_tqdm=False)
        stats = engine.get_stats()
        assert engine._engine.executor.guided.num_active == 0
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    assert [o.outputs[0].token_ids for o in speculated] == [o.outputs[0].token_ids
                                                           for o in plain]
    for out, schema in zip(speculated, schemas):
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_threaded_fill_equals_the_loop(think_llm, monkeypatch):
    import tllm.guided.manager as manager_module
    vocab = think_llm._engine.executor.guided.cache.vocab_size
    texts = ["", "{", '{"name": "a', '{"name": "ab", "age": 1', "<think>hm", "<think>",
             "<think>a</think>", '<think></think>{"name"', "", "{"]  # the last: thinking off
    masks = []
    for threads in (1, 2):
        monkeypatch.setattr(manager_module, "_NUM_FILL_THREADS", threads)
        manager = _manager(think_llm)
        requests = [_request(_ids(think_llm, "x" if i < 9 else "x <think></think>"),
                             GuidedDecodingParams(json=SCHEMA, reasoning_tags=TAGS))
                    for i in range(len(texts))]
        manager.prepare(SimpleNamespace(requests=requests))
        for request, text in zip(requests, texts):
            for token in _ids(think_llm, text):
                manager.accept(request, token)
        masks.append(manager.mask_logits(torch.randn(len(requests), vocab), requests)
                     .isfinite())
        assert manager.fill_seconds > 0
    assert torch.equal(*masks)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_mixed_rows_and_padded_columns_are_masked_exactly(llm_without_tags, device):
    # logits wider than the tokenizer (a padded LM head), a guided row between unguided ones:
    # the guided row keeps only the grammar's tokens, the padding is -inf there only, and
    # the unguided rows are untouched
    manager = _manager(llm_without_tags)
    vocab = manager.cache.vocab_size
    guided = _request([1, 2, 3], GuidedDecodingParams(regex="[0-9]+"))
    plain = [Request(f"p{i}", [1, 2], SamplingParams(max_tokens=8), 8) for i in range(2)]
    manager.prepare(SimpleNamespace(requests=[guided]))
    logits = torch.randn(3, vocab + 40, device=device)
    out = manager.mask_logits(logits, [plain[0], guided, plain[1]])
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    assert torch.isinf(out[1, vocab:]).all()
    allowed = set(torch.nonzero(out[1].isfinite()).flatten().tolist())
    digits = set(_ids(llm_without_tags, "0123456789"))
    assert allowed and allowed <= set(range(vocab)) and allowed & digits
    assert torch.equal(out[1][out[1].isfinite()], logits[1][out[1].isfinite()])
    every = manager.mask_logits(logits[1:2], [guided])     # all rows guided: the slice path
    assert torch.equal(every.isfinite(), out[1:2].isfinite())
