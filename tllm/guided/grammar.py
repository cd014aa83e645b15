"""Compiling GuidedDecodingParams into xgrammar grammars, once per tokenizer and schema.

xgrammar is imported on first use, so engines that never see a guided request never load it."""
from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import Any

from tllm.guided.probe import probe
from tllm.sampling_params import GuidedDecodingParams


class GrammarCache:
    """xgrammar's compiler for one tokenizer (its vocabulary as the model's logits see it)
    and the grammars it compiled, kept by (kind, canonical schema) up to `max_entries`."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int | None = None,
                 stop_token_ids: list[int] | None = None, max_entries: int = 512) -> None:
        import xgrammar as xgr
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.vocab_size = self.tokenizer_info.vocab_size
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2)
        self._grammars: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()  # the server's threads and the loop compile
        self.num_compiles = 0

    def compile(self, params: GuidedDecodingParams) -> Any:
        """The compiled grammar; ValueError with xgrammar's message when it does not compile,
        or when it provably admits no output (tllm.guided.probe)."""
        key = params.cache_key
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
            try:
                compiled = self._compile(params)
            except Exception as exc:  # xgrammar raises RuntimeError/ValueError of its own
                raise ValueError(f"guided_decoding.{params.kind} does not compile: "
                                 f"{exc}") from None
            self._check_satisfiable(compiled, params.kind)
            self.num_compiles += 1
            self._grammars[key] = compiled
            if len(self._grammars) > self._max_entries:
                self._grammars.popitem(last=False)
            return compiled

    def _check_satisfiable(self, compiled: Any, kind: str) -> None:
        stop_token_ids = set(self.tokenizer_info.stop_token_ids)
        if stop_token_ids and probe(compiled, self.vocab_size, stop_token_ids) is False:
            raise ValueError(f"guided_decoding.{kind} admits no output: no sequence of this "
                             "model's tokens satisfies it (an empty character class such as "
                             "[^\\s\\S], a rule that never ends, an impossible pattern)")

    def _compile(self, params: GuidedDecodingParams) -> Any:
        kind, compiler = params.kind, self._compiler
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            schema = json.dumps(_bounded_strings_as_patterns(json.loads(schema)))
            # compact JSON: a free-whitespace grammar lets a weak model pad forever
            return compiler.compile_json_schema(schema, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "grammar":
            return compiler.compile_grammar(params.grammar)
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return compiler.compile_grammar(f"root ::= {alternatives}")


_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_engine_vocab_sizes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def register_engine_vocab_size(tokenizer: Any, vocab_size: int | None) -> None:
    """The width of the engine's logits for this tokenizer, so that a check made before the
    first guided request (the server's) compiles into the cache the engine will use."""
    with _caches_lock:
        _engine_vocab_sizes[getattr(tokenizer, "hf", tokenizer)] = vocab_size


def grammar_cache(tokenizer: Any, vocab_size: int | None = None) -> GrammarCache:
    """The one GrammarCache of this tokenizer (a tllm Tokenizer or an HF tokenizer) and
    vocabulary size (None: the engine's, when one registered it); building one reads the
    whole vocabulary, so it is shared."""
    hf = getattr(tokenizer, "hf", tokenizer)
    stop = sorted(getattr(tokenizer, "eos_token_ids", ())) or None
    with _caches_lock:
        by_vocab = _caches.setdefault(hf, {})
        if vocab_size is None:
            vocab_size = _engine_vocab_sizes.get(hf)
        if vocab_size not in by_vocab:
            by_vocab[vocab_size] = GrammarCache(hf, vocab_size, stop)
        return by_vocab[vocab_size]


def compile_check(params: GuidedDecodingParams, tokenizer: Any,
                  vocab_size: int | None = None) -> None:
    """Raise ValueError (with xgrammar's message) if `params` cannot be compiled for this
    tokenizer; the server calls it to answer 400 before submitting. The grammar stays cached."""
    grammar_cache(tokenizer, vocab_size).compile(params)


# xgrammar 0.2.9 writes a string with minLength/maxLength as any characters, control
# characters included, which JSON forbids unescaped; the same bounds as a pattern keep it JSON
_PLAIN_CHARS = r'[^\x00-\x1f"\\]'


def _bounded_strings_as_patterns(node: Any) -> Any:
    """The schema with each length-bounded string (no pattern or format) as a pattern."""
    if isinstance(node, list):
        return [_bounded_strings_as_patterns(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {k: _bounded_strings_as_patterns(v) for k, v in node.items()}
    bounded = "minLength" in node or "maxLength" in node
    if node.get("type") == "string" and bounded and not {"pattern", "format"} & node.keys():
        low, high = node.pop("minLength", 0), node.pop("maxLength", "")
        node["pattern"] = f"^{_PLAIN_CHARS}{{{low},{high}}}$"
    return node
