"""Guided decoding (structured outputs) with xgrammar: compiled grammars cached by schema, a
matcher per request as a resource manager, token bitmasks applied in the sampler."""
from tllm.guided.grammar import GrammarCache, compile_check, grammar_cache
from tllm.guided.manager import GuidedDecoding
from tllm.sampling_params import GuidedDecodingParams

__all__ = ["GrammarCache", "GuidedDecoding", "GuidedDecodingParams", "compile_check",
           "grammar_cache"]
