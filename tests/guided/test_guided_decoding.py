"""Guided decoding end to end on a tiny random Llama and on SmolLM2 (tests taking `engine` run
on both): every output continues its grammar and every one that stops validates against its
schema, regex or choice; unguided neighbours are untouched; bad schemas are refused at
submission; grammar state and KV blocks are freed."""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

import jsonschema
import pytest

from tests.guided.schemas import SCHEMAS
from tllm import LLM, GuidedDecodingParams, KvCacheConfig, SamplingParams
from tllm.guided import compile_check, grammar_cache

PROMPTS = ["hello world", "the quick brown fox", '{"name": "ada"', "[1, 2"]
LLM_ARGS = dict(max_seq_len=512, max_batch_size=32,
                kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=16384))


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(tiny_model_dir, **LLM_ARGS) as engine:
        yield engine


@dataclass
class Engine:
    """An LLM and how a prompt is written for it (SmolLM2 is asked through its template)."""

    llm: LLM
    uses_chat_template: bool

    def prompts(self, texts: list[str]) -> list[str]:
        if not self.uses_chat_template:
            return texts
        tokenizer = self.llm._engine.tokenizer
        return [tokenizer.apply_chat_template([{"role": "user", "content": text}])
                for text in texts]


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2",
                                                             marks=pytest.mark.slow)])
def engine(request, tiny_model_dir):
    """Each test that takes `engine` runs on the tiny random model and on SmolLM2 (dense in
    float32: the mixed-batch check compares a request's tokens across batch compositions,
    which only float32 keeps to ~1e-6; README, The CPU path: batch invariance)."""
    if request.param == "tiny":
        with LLM(tiny_model_dir, **LLM_ARGS) as tiny:
            yield Engine(tiny, uses_chat_template=False)
    else:
        with LLM("smollm2", quantization="none", max_seq_len=768, max_batch_size=32, max_num_tokens=2048,
                 kv_cache_config=KvCacheConfig(max_tokens=32768)) as smollm2:
            yield Engine(smollm2, uses_chat_template=True)


def guided(max_tokens=160, **kind) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0,
                          guided_decoding=GuidedDecodingParams(**kind))


def assert_grammar_accepts(llm: LLM, output, params: GuidedDecodingParams) -> None:
    """Every generated token continues the grammar: an output cut by length is a prefix of
    the language, one that stopped is a whole sentence of it."""
    import xgrammar as xgr
    matcher = xgr.GrammarMatcher(grammar_cache(llm._engine.tokenizer).compile(params))
    for token in output.token_ids:
        assert matcher.accept_token(token), (output.text, token)
    if output.finish_reason == "stop":
        assert matcher.is_terminated() or matcher.is_completed(), output.text


def check_json_outputs(outputs, schemas, llm: LLM | None = None) -> int:
    """Every output that stopped validates (and, given the LLM, every one cut by length is
    the start of a valid document); returns how many stopped."""
    stopped = 0
    for out, schema in zip(outputs, schemas):
        completion = out.outputs[0]
        if llm is not None:
            assert_grammar_accepts(llm, completion, GuidedDecodingParams(json=schema))
        if completion.finish_reason == "length":
            continue
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), schema)
        stopped += 1
    return stopped


def schema_prompts(engine: Engine, schemas) -> list[str]:
    if engine.uses_chat_template:
        texts = [f"Reply with a JSON value valid against this schema: {json.dumps(s)}"
                 for s in schemas]
    else:
        texts = [PROMPTS[i % len(PROMPTS)] for i in range(len(schemas))]
    return engine.prompts(texts)


def test_json_schemas_validate_greedy_and_sampled(engine):
    assert len(SCHEMAS) >= 20
    llm, prompts = engine.llm, schema_prompts(engine, SCHEMAS)
    greedy = llm.generate(prompts, [guided(json=s) for s in SCHEMAS], use_tqdm=False)
    sampled_params = [SamplingParams(max_tokens=160, temperature=1.0, seed=i,
                                     guided_decoding=GuidedDecodingParams(json=json.dumps(s)))
                      for i, s in enumerate(SCHEMAS)]
    sampled = llm.generate(prompts, sampled_params, use_tqdm=False)
    stopped = (check_json_outputs(greedy, SCHEMAS, llm)
               + check_json_outputs(sampled, SCHEMAS, llm))
    assert stopped >= 0.8 * 2 * len(SCHEMAS)
    assert llm._engine.executor.guided.num_active == 0


def test_json_object_regex_and_choice(engine):
    regex = r"[0-9]{3}-[a-z]{2,4}"
    choices = ["yes", "no", "maybe so"]
    prompts = engine.prompts(["Write a code like 123-abc.", "Yes or no?"] + PROMPTS * 2)
    objects = [guided(json_object=True, max_tokens=64)] * 6
    outputs = engine.llm.generate(prompts[:8], [guided(regex=regex), guided(choice=choices),
                                                *objects], use_tqdm=False)
    reg, choice, *objects = (o.outputs[0] for o in outputs)
    # a random model rarely closes a free string: those that stop parse, all begin an object
    stopped = [o for o in objects if o.finish_reason == "stop"]
    assert all(isinstance(json.loads(o.text), dict) for o in stopped)
    for o in objects:
        assert_grammar_accepts(engine.llm, o, GuidedDecodingParams(json_object=True))
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


def check_mixed_batch(llm: LLM, prompts: list[str]) -> None:
    """Unguided requests give the same tokens beside guided ones as alone; the guided ones
    validate; every KV block is free afterwards."""
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = llm.generate(prompts, plain, use_tqdm=False)
    mixed_prompts = [p for p in prompts for _ in range(2)]
    mixed_params = [plain if i % 2 == 0 else guided(json=SCHEMAS[i], max_tokens=96)
                    for i in range(len(mixed_prompts))]
    mixed = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    kv = llm._engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert [o.outputs[0].token_ids for o in mixed[::2]] == [o.outputs[0].token_ids
                                                           for o in alone]
    assert check_json_outputs(mixed[1::2], [SCHEMAS[i] for i in range(1, 8, 2)], llm) >= 3


def test_mixed_batch_leaves_unguided_requests_identical(engine):
    check_mixed_batch(engine.llm, engine.prompts(PROMPTS))   # under the overlap scheduler


def test_mixed_batch_without_overlap(tiny_model_dir):
    with LLM(tiny_model_dir, disable_overlap_scheduler=True, **LLM_ARGS) as llm:
        check_mixed_batch(llm, PROMPTS)


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


def test_abort_frees_grammar_state_and_kv_blocks(engine):
    llm = engine.llm
    result = llm.generate_async(engine.prompts(PROMPTS)[0], SamplingParams(
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
