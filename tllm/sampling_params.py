"""User-facing sampling parameters, validated once at the edge."""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

_GUIDED_KINDS = ("json", "json_object", "regex", "grammar", "choice")
# Which distribution `logprobs` (the sampled token's and the top ones) come from:
# "raw_logprobs": the model's own (log_softmax of its logits; vLLM's default);
# "tempered_logprobs": after logit bias, penalties, masks and the temperature, before the
#   top-k / top-p / min-p filters;
# "processed_logprobs": the distribution the token was drawn from (after the filters too:
#   tokens they removed are -inf). A greedy request's temperature counts as 1 here.
LOGPROBS_MODES = ("raw_logprobs", "tempered_logprobs", "processed_logprobs")


@dataclass
class GuidedDecodingParams:
    """What the output must match (vLLM's names); exactly one of: `json` (a JSON schema, a
    dict or its JSON text), `json_object=True` (any JSON object), `regex`, `grammar` (EBNF,
    as xgrammar reads it) or `choice` (one of these strings). Compiled by tllm.guided."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    # (start, end) tokens of a reasoning model's thinking, e.g. ("<think>", "</think>"): the
    # grammar applies only once the thinking has ended (the server sets them with
    # --reasoning-parser; tllm.guided.manager says how)
    reasoning_tags: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        given = [k for k in _GUIDED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("GuidedDecodingParams needs exactly one of json, json_object, "
                             f"regex, grammar, choice; got {given or 'none'}")
        if self.json is not None:
            self._check_json()
        if self.json_object not in (True, False):
            raise ValueError(f"GuidedDecodingParams.json_object must be a bool, "
                             f"got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"GuidedDecodingParams.{name} must be a non-empty string, "
                                 f"got {value!r}")
        if self.choice is not None and not (
                isinstance(self.choice, (list, tuple)) and self.choice
                and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("GuidedDecodingParams.choice must be a non-empty list of "
                             f"non-empty strings, got {self.choice!r}")
        tags = self.reasoning_tags
        if tags is not None and not (isinstance(tags, (list, tuple)) and len(tags) == 2
                                     and all(isinstance(t, str) and t for t in tags)):
            raise ValueError("GuidedDecodingParams.reasoning_tags must be two non-empty "
                             f"strings (start, end), got {tags!r}")

    def _check_json(self) -> None:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = _json.loads(schema)
            except (ValueError, RecursionError) as exc:  # also: huge integers, deep nesting
                raise ValueError(f"GuidedDecodingParams.json is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("GuidedDecodingParams.json must be a JSON schema (an object), "
                             f"got {type(schema).__name__}")

    @property
    def kind(self) -> str:
        return next(k for k in _GUIDED_KINDS if getattr(self, k) not in (None, False))

    @property
    def cache_key(self) -> tuple[str, str]:
        """(kind, canonical text): equal for the same schema however it was written."""
        kind = self.kind
        if kind == "json":
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            return kind, _json.dumps(schema, sort_keys=True)
        if kind == "choice":
            return kind, _json.dumps(list(self.choice))
        return kind, "" if kind == "json_object" else getattr(self, kind)


@dataclass
class SamplingParams:
    """How to sample one prompt's continuation (names as in TensorRT-LLM / vLLM).

    temperature 0 means greedy. top_k -1 (or 0) and top_p 1.0 disable those filters.
    """

    max_tokens: int | None = 32
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str = "raw_logprobs"   # one of LOGPROBS_MODES
    n: int = 1
    # best_of sequences are generated and the n best by cumulative logprob returned; with
    # beam search best_of (or beam_width, TensorRT-LLM's name) is the beam width
    best_of: int | None = None
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False   # True, False or "never", as HF transformers'
    detokenize: bool = True
    skip_special_tokens: bool = True
    guided_decoding: GuidedDecodingParams | None = None
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif self.stop is None:
            self.stop_strings = []
        else:
            _check(isinstance(self.stop, (list, tuple)), "stop", self.stop,
                   "must be a non-empty string or a list of non-empty strings")
            self.stop_strings = list(self.stop)
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
               "stop_token_ids", self.stop_token_ids, "must be a list of non-negative integers")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._validate()
        check_best_of(self)

    @property
    def num_sequences(self) -> int:
        """How many sequences the engine runs for this prompt: n, best_of or the beams."""
        return self.beam_width if self.use_beam_search else (self.best_of or self.n)

    @property
    def ranks_by_logprob(self) -> bool:
        """Whether the returned sequences are chosen among more by cumulative logprob."""
        return self.use_beam_search or self.num_sequences > self.n

    @property
    def is_greedy(self) -> bool:
        # below this, dividing logits by the temperature overflows; it is greedy in effect
        return self.temperature < 1e-5

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        if self.max_tokens is not None:
            _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
                   self.max_tokens, "must be an integer >= 1")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"must be <= max_tokens ({self.max_tokens})")
        _check(_is_num(self.temperature) and self.temperature >= 0, "temperature",
               self.temperature, "must be >= 0")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p,
               "must be in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k", self.top_k,
               "must be -1 (disabled) or >= 1")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p,
               "must be in [0, 1]")
        _check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", self.repetition_penalty, "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2 <= value <= 2, name, value, "must be in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= 0), name, value,
                   "must be None or an integer >= 0")
        _check(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", self.logprobs_mode,
               f"must be one of {', '.join(LOGPROBS_MODES)}")
        if self.seed is not None:
            _check(_is_int(self.seed), "seed", self.seed, "must be an integer")
        _check(all(isinstance(s, str) and s for s in self.stop_strings), "stop", self.stop,
               "must be a non-empty string or a list of non-empty strings")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict) and all(
                _is_int(k) and k >= 0 and _is_num(v) and -100 <= v <= 100
                for k, v in self.logit_bias.items()), "logit_bias", self.logit_bias,
                "must map token ids (ints >= 0) to biases in [-100, 100]")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "must be a list of non-negative integers")
        _check(self.guided_decoding is None
               or isinstance(self.guided_decoding, GuidedDecodingParams), "guided_decoding",
               self.guided_decoding, "must be None or a GuidedDecodingParams")


# Beam scores are divided by length ** length_penalty: within this bound that stays a finite,
# non-zero float for any length up to 2**20 tokens (2**(20 * 50) < 2**1024). Used values are
# about 0.5 to 2.
MAX_LENGTH_PENALTY = 50.0

_BEAM_SEARCH_DEFAULTS = (("temperature", 0.0, "must be 0 with use_beam_search (beam search is "
                         "deterministic)"), ("top_p", 1.0, "must be 1"), ("top_k", -1, "must be -1"),
                         ("min_p", 0.0, "must be 0"), ("repetition_penalty", 1.0, "must be 1"),
                         ("presence_penalty", 0.0, "must be 0"),
                         ("frequency_penalty", 0.0, "must be 0"), ("logit_bias", None, "must be None"),
                         ("logprobs", None, "must be None (per-token logprobs of beams are not "
                          "supported; cumulative_logprob is returned)"),
                         ("guided_decoding", None, "must be None"))


def check_best_of(params: SamplingParams) -> None:
    """best_of, beam search and their fields (vLLM's rules); resolves the beam width."""
    if params.best_of is not None:
        _check(_is_int(params.best_of) and params.best_of >= params.n, "best_of",
               params.best_of, f"must be an integer >= n ({params.n})")
    if params.beam_width is not None:
        _check(_is_int(params.beam_width) and params.beam_width >= 1, "beam_width",
               params.beam_width, "must be an integer >= 1")
        _check(params.best_of in (None, params.beam_width), "beam_width", params.beam_width,
               f"must equal best_of ({params.best_of}) when both are given")
        params.use_beam_search = True
    _check(params.use_beam_search in (True, False), "use_beam_search", params.use_beam_search,
           "must be a bool")
    _check(_is_num(params.length_penalty) and abs(params.length_penalty) <= MAX_LENGTH_PENALTY,
           "length_penalty", params.length_penalty,
           f"must be a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}]")
    _check(isinstance(params.early_stopping, bool) or params.early_stopping == "never",
           "early_stopping", params.early_stopping, 'must be True, False or "never"')
    if not params.use_beam_search:
        _check(params.length_penalty == 1.0, "length_penalty", params.length_penalty,
               "must be 1.0 without use_beam_search")
        _check(params.early_stopping is False, "early_stopping", params.early_stopping,
               "must be False without use_beam_search")
        return
    width = params.beam_width or params.best_of or params.n
    params.beam_width = params.best_of = width
    _check(params.n <= width, "n", params.n, f"must be <= the beam width ({width})")
    for name, default, rule in _BEAM_SEARCH_DEFAULTS:
        _check(getattr(params, name) == default, name, getattr(params, name), rule)
    _check(not params.stop_strings, "stop", params.stop,
           "must be None with use_beam_search (stop token ids are supported)")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check(ok: bool, name: str, value, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {rule}, got {value!r}")
