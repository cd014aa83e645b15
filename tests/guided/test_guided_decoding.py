"""Guided decoding end to end on a tiny random Llama (and SmolLM2 for a few schemas): every
output that stops is valid against its schema, regex or choice; unguided neighbours are
untouched; bad schemas are refused at submission; grammar state and KV blocks are freed."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from tests.guided.schemas import SCHEMAS
from tllm import LLM, GuidedDecodingParams, KvCacheConfig, SamplingParams
from tllm.guided import compile_check, grammar_cache
from tllm.llmapi.llm_args import NGramDecodingConfig

PROMPTS = ["hello world", "the quick brown fox", '{"name": "ada"', "[1, 2"]
LLM_ARGS = dict(max_seq_len=512, max_batch_size=32,
                kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=16384))


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(tiny_model_dir, **LLM_ARGS) as engine:
        yield engine


def guided(max_tokens=160, **kind) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0,
                          guided_decoding=GuidedDecodingParams(**kind))


def check_json_outputs(outputs, schemas) -> int:
    """Every output that stopped validates; returns how many stopped."""
    stopped = 0
    for out, schema in zip(outputs, schemas):
        completion = out.outputs[0]
        if completion.finish_reason == "length":
            continue
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), schema)
        stopped += 1
    return stopped


def test_json_schemas_validate_greedy_and_sampled(llm):
    assert len(SCHEMAS) >= 20
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))]
    greedy = llm.generate(prompts, [guided(json=s) for s in SCHEMAS], use_tqdm=False)
    sampled_params = [SamplingParams(max_tokens=160, temperature=1.0, seed=i,
                                     guided_decoding=GuidedDecodingParams(json=json.dumps(s)))
                      for i, s in enumerate(SCHEMAS)]
    sampled = llm.generate(prompts, sampled_params, use_tqdm=False)
    stopped = check_json_outputs(greedy, SCHEMAS) + check_json_outputs(sampled, SCHEMAS)
    assert stopped >= 0.8 * 2 * len(SCHEMAS)
    assert llm._engine.executor.guided.num_active == 0


def test_json_object_regex_and_choice(llm):
    regex = r"[0-9]{3}-[a-z]{2,4}"
    choices = ["yes", "no", "maybe so"]
    outputs = llm.generate(PROMPTS[:3] + PROMPTS, [guided(regex=regex), guided(choice=choices)]
                           + [guided(json_object=True)] * 5, use_tqdm=False)
    reg, choice, *objects = (o.outputs[0] for o in outputs)
    # a random model rarely closes a free string: those that stop parse, all begin an object
    stopped = [o for o in objects if o.finish_reason == "stop"]
    assert all(isinstance(json.loads(o.text), dict) for o in stopped)
    assert all(o.text.startswith("{") for o in objects)
    assert reg.finish_reason == "stop" and re.fullmatch(regex, reg.text)
    assert choice.finish_reason == "stop" and choice.text in choices


def test_json_object_grammar_takes_objects_only(llm):
    import xgrammar as xgr
    compiled = grammar_cache(llm._engine.tokenizer).compile(
        GuidedDecodingParams(json_object=True))
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    assert matcher.accept_string('{"a": [1, {"b": null}], "c": "d"}')
    assert matcher.is_terminated()
    assert not xgr.GrammarMatcher(compiled).accept_string("[1]")


def test_a_grammar_and_finish_by_length(llm):
    ebnf = 'root ::= "(" digits ")"\ndigits ::= [0-9]+'
    out = llm.generate(PROMPTS[0], guided(grammar=ebnf, max_tokens=64), use_tqdm=False)
    text = out.outputs[0].text
    if out.outputs[0].finish_reason == "stop":
        assert re.fullmatch(r"\([0-9]+\)", text)
    else:  # a prefix of the language
        assert re.fullmatch(r"\([0-9]*", text)
    short = llm.generate(PROMPTS[0], guided(json=SCHEMAS[7], max_tokens=3), use_tqdm=False)
    assert short.outputs[0].finish_reason == "length"
    assert short.outputs[0].text.startswith("{")


@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_batch_leaves_unguided_requests_identical(tiny_model_dir, overlap):
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(tiny_model_dir, disable_overlap_scheduler=not overlap, **LLM_ARGS) as engine:
        alone = engine.generate(PROMPTS, plain, use_tqdm=False)
        mixed_prompts = [p for p in PROMPTS for _ in range(2)]
        mixed_params = [plain if i % 2 == 0 else guided(json=SCHEMAS[i])
                        for i in range(len(mixed_prompts))]
        mixed = engine.generate(mixed_prompts, mixed_params, use_tqdm=False)
        kv = engine._engine.kv_cache
        assert kv.num_free_blocks == kv.num_blocks
    assert [o.outputs[0].token_ids for o in mixed[::2]] == [o.outputs[0].token_ids
                                                           for o in alone]
    assert check_json_outputs(mixed[1::2], [SCHEMAS[i] for i in range(1, 8, 2)]) >= 3


def test_bad_schemas_raise_value_error(llm):
    tokenizer = llm._engine.tokenizer
    bad = GuidedDecodingParams(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}})
    with pytest.raises(ValueError, match="guided_decoding.json does not compile"):
        compile_check(bad, tokenizer)
    with pytest.raises(ValueError, match="guided_decoding.regex does not compile"):
        compile_check(GuidedDecodingParams(regex="(unclosed"), tokenizer)
    with pytest.raises(ValueError, match="guided_decoding"):
        llm.generate(PROMPTS[0], SamplingParams(guided_decoding=bad), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(json={}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="not valid JSON"):
        GuidedDecodingParams(json="{not json")
    with pytest.raises(ValueError, match="choice"):
        GuidedDecodingParams(choice=[])
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(guided_decoding={"json": {}})


def test_compiled_grammars_are_cached_by_schema(llm):
    cache = grammar_cache(llm._engine.tokenizer)
    assert cache is llm._engine.executor.guided.cache  # the server's check warms the engine's
    schema = {"type": "object", "properties": {"k": {"type": "integer"}, "j": {"type": "null"}}}
    before = cache.num_compiles
    compile_check(GuidedDecodingParams(json=schema), llm._engine.tokenizer)
    reordered = json.dumps(dict(reversed(list(schema.items()))))
    compile_check(GuidedDecodingParams(json=reordered), llm._engine.tokenizer)
    assert cache.num_compiles == before + 1


def test_abort_frees_grammar_state_and_kv_blocks(llm):
    result = llm.generate_async(PROMPTS[0], SamplingParams(
        max_tokens=400, temperature=0, ignore_eos=True, guided_decoding=GuidedDecodingParams(
            grammar='root ::= [a-z]+')))
    deadline = time.monotonic() + 30
    while llm._engine.executor.guided.num_active == 0 and time.monotonic() < deadline:
        time.sleep(0.001)  # until it is running, with a matcher
    assert llm._engine.executor.guided.num_active == 1
    result.abort()
    assert result.result(timeout=30).outputs[0].finish_reason == "abort"
    executor, kv = llm._engine.executor, llm._engine.kv_cache
    assert executor.guided.num_active == 0
    assert kv.num_free_blocks == kv.num_blocks


def test_guided_requests_do_not_speculate(tiny_model_dir):
    with LLM(tiny_model_dir, speculative_config=NGramDecodingConfig(max_draft_len=3),
             **LLM_ARGS) as engine:
        outputs = engine.generate(PROMPTS[:2], [guided(json=SCHEMAS[5]), guided(json=SCHEMAS[0])],
                                  use_tqdm=False)
        stats = engine.get_stats()
    assert stats["spec_draft_tokens"] == 0
    assert check_json_outputs(outputs, [SCHEMAS[5], SCHEMAS[0]]) == 2


@pytest.fixture(scope="module")
def smollm2():
    with LLM("smollm2", max_seq_len=512, max_batch_size=8,
             kv_cache_config=KvCacheConfig(max_tokens=8192)) as engine:
        yield engine


def test_smollm2_schemas(smollm2):
    schemas = [SCHEMAS[0], SCHEMAS[10], SCHEMAS[12], SCHEMAS[18]]
    prompts = [smollm2._engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Give me a JSON object for: {json.dumps(s)}"}])
        for s in schemas]
    outputs = smollm2.generate(prompts, [guided(json=s, max_tokens=96) for s in schemas],
                               use_tqdm=False)
    assert check_json_outputs(outputs, schemas) >= 3
    choice = smollm2.generate(prompts[0], guided(choice=["red", "green"]), use_tqdm=False)
    assert choice.outputs[0].text in ("red", "green")
