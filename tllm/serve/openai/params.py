"""From a request body to the engine's SamplingParams, plus the checks the engine leaves to
the server: every integer that becomes a tensor index or size against the model (vocabulary),
the context length (the engine would silently shorten max_tokens) and logit_bias."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tllm.sampling_params import SamplingParams
from tllm.serve.http.errors import APIError, bad_request, from_value_error
from tllm.serve.openai.protocol import INT64_MAX, CompletionRequest, _SamplingRequest

# Below this temperature sampling is greedy (as in vLLM): dividing logits by it overflows.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class ModelLimits:
    """What the model accepts beyond the protocol's own bounds: token ids and top_k within
    the vocabulary. vocab_size None (a model without a known vocabulary) checks against the
    64-bit range the engine's tensors hold."""

    vocab_size: int | None

    @classmethod
    def of(cls, llm) -> ModelLimits:
        """The LLM's vocabulary: its own `vocab_size` if it has one, else its tokenizer's."""
        vocab_size = getattr(llm, "vocab_size", None)
        if not isinstance(vocab_size, int):
            vocab_size = getattr(getattr(llm, "tokenizer", None), "vocab_size", None)
        return cls(vocab_size if isinstance(vocab_size, int) and vocab_size > 0 else None)

    @property
    def max_token_id(self) -> int:
        return INT64_MAX if self.vocab_size is None else self.vocab_size - 1

    def check(self, body: _SamplingRequest) -> None:
        """400 naming the field for an integer the engine could not index or size with."""
        top_k = body.top_k
        if top_k is not None and top_k > self.max_token_id + 1:
            raise bad_request(f"top_k must be -1 or 0 (disabled) or at most the vocabulary "
                              f"size ({self.max_token_id + 1}), got {top_k}", param="top_k")
        for token in body.stop_token_ids or ():
            self._check_token(token, "stop_token_ids")
        for key in body.logit_bias or {}:
            self._check_token(_token_key(key), "logit_bias")
        if isinstance(body, CompletionRequest):
            for prompt in body.prompts():
                for token in prompt if not isinstance(prompt, str) else ():
                    self._check_token(token, "prompt")

    def _check_token(self, token: int, param: str) -> None:
        if not 0 <= token <= self.max_token_id:
            where = ("the vocabulary" if self.vocab_size is None
                     else f"the vocabulary [0, {self.vocab_size})")
            raise bad_request(f"{param}: token id {token} is outside {where}", param=param)


def _token_key(key: str) -> int:
    """A logit_bias key as a token id: ASCII digits only (int() also takes "²", "٣", " 5"),
    and no longer than a 64-bit integer (int() refuses past 4,300 digits, with a ValueError
    that would be a 500)."""
    if not (key.isascii() and key.isdigit()):
        raise bad_request(f"logit_bias keys must be token ids (decimal digits), got "
                          f"{_shortened(key)}", param="logit_bias")
    if len(key.lstrip("0")) > len(str(INT64_MAX)):
        raise bad_request(f"logit_bias: token id {_shortened(key)} is outside the vocabulary",
                          param="logit_bias")
    return int(key)


def _shortened(text: str, limit: int = 40) -> str:
    """A client's text for an error message, cut (it may be megabytes)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def max_new_tokens(prompt_len: int, requested: int | None, max_seq_len: int,
                   prompt_param: str) -> int:
    """The tokens to generate after this prompt; 400 context_length_exceeded if they (or the
    prompt alone) do not fit the context. None asks for all the room there is."""
    is_prompt_too_long = prompt_len >= max_seq_len
    if not is_prompt_too_long and (requested is None or prompt_len + requested <= max_seq_len):
        return requested if requested is not None else max_seq_len - prompt_len
    wanted = f" + {requested} to generate" if requested is not None else ""
    raise APIError(400, f"this model's maximum context length is {max_seq_len} tokens; the "
                   f"request has {prompt_len} prompt tokens{wanted}. Shorten the prompt or "
                   "lower max_tokens", code="context_length_exceeded",
                   param=prompt_param if is_prompt_too_long else "max_tokens")


def check_logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """The OpenAI map (token id strings -> bias) as the engine's {int: float}."""
    if not logit_bias:
        return None
    for bias in logit_bias.values():
        if not -100 <= bias <= 100:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {bias}",
                              param="logit_bias")
    return {_token_key(key): float(bias) for key, bias in logit_bias.items()}


# vLLM's extra body fields -> GuidedDecodingParams' keyword
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar",
                 "guided_choice": "choice"}


def guided_request(body: _SamplingRequest,
                   others: dict[str, dict[str, Any]] | None = None) -> tuple[str, dict] | None:
    """(the field that asked, GuidedDecodingParams keywords) of the one guided_* field set, or
    of one of `others` (chat's response_format or tool_choice: field -> keywords); None when
    nothing asks; 400 when two do."""
    asked = {field: {keyword: value} for field, keyword in GUIDED_FIELDS.items()
             if (value := getattr(body, field, None)) is not None}
    asked.update(others or {})
    if len(asked) > 1:
        first, second = list(asked)[:2]
        raise bad_request(f"{first} and {second} cannot both constrain the output",
                          param=second)
    return next(iter(asked.items()), None)


def guided_decoding(guided: tuple[str, dict] | None, tokenizer):
    """GuidedDecodingParams for guided_request's answer, its grammar compiled (and cached) for
    the tokenizer; a grammar that does not compile is a 400 with the compiler's message."""
    if guided is None:
        return None
    field, keywords = guided
    from tllm import GuidedDecodingParams
    from tllm.guided import compile_check
    try:
        params = GuidedDecodingParams(**keywords)
        compile_check(params, tokenizer)
    except ValueError as exc:
        raise bad_request(f"{field}: {exc}", param=field) from exc
    return params


def beam_search_fields(body) -> dict[str, Any]:
    """vLLM's best_of / use_beam_search / length_penalty / early_stopping as SamplingParams
    keywords (bodies without them: none); 400 if they are asked to stream."""
    fields = {name: getattr(body, name) for name in
              ("best_of", "use_beam_search", "length_penalty", "early_stopping")
              if hasattr(body, name)}
    n = getattr(body, "n", 1)
    ranks = fields.get("use_beam_search") or (fields.get("best_of") or n) > n
    if ranks and getattr(body, "stream", False):
        param = "use_beam_search" if fields.get("use_beam_search") else "best_of"
        raise bad_request(f"{param}: the n best sequences are known only once all have "
                          "ended, so the response cannot stream", param=param)
    return fields


# What a request without these fields gets, unless the model's generation_config.json says
# otherwise (`defaults` below).
SERVER_DEFAULTS = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0,
                   "repetition_penalty": 1.0}


def sampling_params(body: _SamplingRequest, max_tokens: int, logprobs: int | None = None,
                    prompt_logprobs: int | None = None, guided_decoding=None,
                    defaults: Mapping[str, float] = MappingProxyType({})) -> SamplingParams:
    """The engine's parameters for one prompt of this request; 400 naming the bad field.
    `guided_decoding`: GuidedDecodingParams (from guided_decoding()) or None; `defaults`:
    the model's sampling defaults (LLM.sampling_defaults) for the fields the body lacks."""
    guided = {} if guided_decoding is None else {"guided_decoding": guided_decoding}
    logit_bias = check_logit_bias(body.logit_bias)
    beams = beam_search_fields(body)
    # beam search is deterministic: an absent temperature is 0, and no sampling default
    # of the model's applies
    given = ({**SERVER_DEFAULTS, "temperature": 0.0} if beams.get("use_beam_search")
             else {**SERVER_DEFAULTS, **defaults})
    given.update({name: value for name in SERVER_DEFAULTS
                  if (value := getattr(body, name)) is not None})
    if 0 <= given["temperature"] < GREEDY_TEMPERATURE:
        given["temperature"] = 0.0
    try:
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=body.min_tokens, **given,
            seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos, logit_bias=logit_bias,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, n=body.n,
            logprobs_mode=body.logprobs_mode,
            skip_special_tokens=body.skip_special_tokens, **guided, **beams)
    except ValueError as exc:
        raise from_value_error(exc) from exc
