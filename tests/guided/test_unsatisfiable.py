"""Issue 31: guided decoding that no output can satisfy. What provably admits nothing is
refused when compiled (a ValueError at submission: the server's 400); what the bounded
search cannot settle fails, at its dead end, that request alone with
UnsatisfiableGrammarError (it was "token 0 does not continue the grammar")."""
from __future__ import annotations

import pytest

from tllm import LLM, GuidedDecodingParams, KvCacheConfig, SamplingParams
from tllm.guided import compile_check
from tllm.guided.probe import UnsatisfiableGrammarError

IMPOSSIBLE_STRING = {"type": "string", "pattern": "[^\\s\\S]"}
UNSATISFIABLE = {
    "empty character class": dict(regex="[^\\s\\S]"),
    "left recursion without a base": dict(grammar='root ::= root "a"'),
    "a rule that is only itself": dict(grammar="root ::= x\nx ::= x"),
    "a dead end after a prefix": dict(regex="ab[^\\s\\S]"),
    "a required property with an impossible pattern": dict(json={
        "type": "object", "properties": {"x": IMPOSSIBLE_STRING}, "required": ["x"]}),
}
SATISFIABLE = {
    "an optional property with an impossible pattern": dict(json={
        "type": "object", "properties": {"x": IMPOSSIBLE_STRING}}),
    "an impossible alternative": dict(regex="a|[^\\s\\S]"),
    "recursion with a base": dict(grammar='root ::= "a" | root "a"'),
    "only the empty string": dict(regex="a{0}"),
    "free text": dict(regex="[a-z ]+"),
    "any object": dict(json_object=True),
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(tiny_model_dir, max_seq_len=256, max_batch_size=4,
             kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=4096)) as engine:
        yield engine


@pytest.mark.parametrize("kind", list(UNSATISFIABLE.values()), ids=list(UNSATISFIABLE))
def test_unsatisfiable_grammars_are_refused_when_compiled(llm, kind):
    with pytest.raises(ValueError, match=r"guided_decoding\.\w+ admits no output"):
        compile_check(GuidedDecodingParams(**kind), llm._engine.tokenizer)
    params = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(**kind))
    with pytest.raises(ValueError, match="admits no output"):
        llm.generate_async({"prompt_token_ids": [5, 6, 7]}, params)


@pytest.mark.parametrize("kind", list(SATISFIABLE.values()), ids=list(SATISFIABLE))
def test_satisfiable_grammars_pass(llm, kind):
    compile_check(GuidedDecodingParams(**kind), llm._engine.tokenizer)


def test_a_dead_end_past_the_search_fails_that_request_alone(llm):
    """Three letters of any kind, then nothing: too many paths to search at submission."""
    dead_end = GuidedDecodingParams(regex="[a-z]{3}[^\\s\\S]")
    compile_check(dead_end, llm._engine.tokenizer)   # not settled: let through
    prompt = {"prompt_token_ids": [5, 6, 7]}
    doomed = llm.generate_async(prompt, SamplingParams(max_tokens=8, temperature=0,
                                                       guided_decoding=dead_end))
    neighbour = llm.generate_async(prompt, SamplingParams(max_tokens=8, temperature=0,
                                                          ignore_eos=True))
    with pytest.raises(RuntimeError) as failed:
        doomed.result(timeout=60)
    assert isinstance(failed.value.__cause__, UnsatisfiableGrammarError), failed.value
    assert "admits no further token" in str(failed.value.__cause__)
    assert len(neighbour.result(timeout=60).outputs[0].token_ids) == 8
    assert llm._engine.executor.guided.num_active == 0
