"""Engine logprobs ({token_id: Logprob(logprob, rank)} per position, the chosen token first)
in OpenAI's two formats: completions (tokens, token_logprobs, top_logprobs, text_offset) and
chat (content: [{token, logprob, bytes, top_logprobs}])."""
from __future__ import annotations

from functools import lru_cache

from tllm.outputs import Logprob, PositionLogprobs
from tllm.serve.openai.protocol import (ChatLogprob, CompletionLogprobs, PromptLogprob,
                                        TopLogprob)

# JSON has no -inf; vLLM reports impossible tokens with this value too.
_MIN_LOGPROB = -9999.0


def _finite(value: float) -> float:
    return max(value, _MIN_LOGPROB) if value == value else _MIN_LOGPROB


def _top(position: PositionLogprobs, k: int) -> list[tuple[int, Logprob]]:
    ranked = [(t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= k]
    return sorted(ranked, key=lambda item: item[1].rank)


class LogprobFormatter:
    """Turns token ids into token strings (cached) and logprobs into the wire formats."""

    def __init__(self, tokenizer) -> None:
        def decode(token_id: int) -> str:
            if tokenizer is None:
                return f"token_id:{token_id}"
            return tokenizer.decode([token_id], skip_special_tokens=False)
        self._token_text = lru_cache(maxsize=1 << 16)(decode)
        self._as_ids = self if tokenizer is None else None

    def for_request(self, body) -> LogprobFormatter:
        """This formatter, or one rendering tokens as "token_id:<id>" where the request asks
        (vLLM's return_tokens_as_token_ids: a trainer gets ids, not text it would have to
        re-tokenize)."""
        if not getattr(body, "return_tokens_as_token_ids", False):
            return self
        if self._as_ids is None:
            self._as_ids = LogprobFormatter(None)
        return self._as_ids

    def token_text(self, token_id: int) -> str:
        return self._token_text(token_id)

    def completion(self, token_ids: list[int], positions: list[PositionLogprobs | None],
                   num_top: int, text_offset: int) -> CompletionLogprobs:
        """Completions format; a None position (the first prompt token) has no logprob.
        text_offset is where the first token's text starts in the choice's text."""
        out = CompletionLogprobs()
        for token_id, position in zip(token_ids, positions):
            text = self.token_text(token_id)
            out.tokens.append(text)
            out.text_offset.append(text_offset)
            text_offset += len(text)
            if position is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_finite(position[token_id].logprob))
            top = {self.token_text(t): _finite(lp.logprob) for t, lp in _top(position, num_top)}
            top.setdefault(text, _finite(position[token_id].logprob))
            out.top_logprobs.append(top)
        return out

    def chat(self, token_ids: list[int], positions: list[PositionLogprobs],
             num_top: int) -> list[ChatLogprob]:
        return [ChatLogprob(**self._entry(token_id, position[token_id].logprob),
                            top_logprobs=[TopLogprob(**self._entry(t, lp.logprob))
                                          for t, lp in _top(position, num_top)])
                for token_id, position in zip(token_ids, positions)]

    def prompt(self, token_ids: list[int], positions: list[PositionLogprobs | None],
               num_top: int) -> list[dict[str, PromptLogprob] | None]:
        """vLLM's prompt_logprobs: per position, the prompt's token and the top ones."""
        out: list[dict[str, PromptLogprob] | None] = []
        for token_id, position in zip(token_ids, positions):
            if position is None:
                out.append(None)
                continue
            entries = [(token_id, position[token_id])] + _top(position, num_top)
            out.append({str(t): PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank,
                                              decoded_token=self.token_text(t))
                        for t, lp in entries})
        return out

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}
