"""From a request body to the engine's SamplingParams, plus the checks the engine leaves to
the server: the context length (the engine would silently shorten max_tokens) and
logit_bias."""
from __future__ import annotations

from tllm.sampling_params import SamplingParams
from tllm.serve.errors import APIError, bad_request, from_value_error
from tllm.serve.protocol import _SamplingRequest

# Below this temperature sampling is greedy (as in vLLM): dividing logits by it overflows.
GREEDY_TEMPERATURE = 1e-5


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
    for key, bias in logit_bias.items():
        if not key.isdigit():
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                              param="logit_bias")
        if not -100 <= bias <= 100:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {bias}",
                              param="logit_bias")
    return {int(key): float(bias) for key, bias in logit_bias.items()}


def sampling_params(body: _SamplingRequest, max_tokens: int, logprobs: int | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's parameters for one prompt of this request; 400 naming the bad field."""
    logit_bias = check_logit_bias(body.logit_bias)
    temperature = 1.0 if body.temperature is None else body.temperature
    if 0 <= temperature < GREEDY_TEMPERATURE:
        temperature = 0.0
    try:
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=body.min_tokens, temperature=temperature,
            top_k=-1 if body.top_k is None else body.top_k,
            top_p=1.0 if body.top_p is None else body.top_p,
            min_p=0.0 if body.min_p is None else body.min_p,
            seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos, logit_bias=logit_bias,
            repetition_penalty=(1.0 if body.repetition_penalty is None
                                else body.repetition_penalty),
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, n=body.n,
            skip_special_tokens=body.skip_special_tokens)
    except ValueError as exc:
        raise from_value_error(exc) from exc
