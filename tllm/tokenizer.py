"""Tokenizer wrapper over HF tokenizers, chat templates, and incremental detokenization with
stop strings that never cut a character or stream part of a stop string."""
from __future__ import annotations

import os
from typing import Any

from tllm.sampling_params import SamplingParams


class Tokenizer:
    """A thin wrapper over an HF tokenizer (transformers), the only place that calls it."""

    def __init__(self, hf_tokenizer, eos_token_ids: set[int] | None = None) -> None:
        self.hf = hf_tokenizer
        ids = set(eos_token_ids or ())
        if hf_tokenizer.eos_token_id is not None:
            ids.add(hf_tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(ids)
        self.backend = getattr(hf_tokenizer, "backend_tokenizer", None)

    @classmethod
    def from_pretrained(cls, path: str, gguf_file: str | None = None,
                        eos_token_ids: set[int] | None = None,
                        tokenizer_type: str | None = None) -> Tokenizer:
        """`tokenizer_type`: an HF model type whose tokenizer class to build (for a GGUF file
        whose architecture transformers cannot read a config from)."""
        from transformers import AutoTokenizer
        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        if tokenizer_type:
            kwargs["tokenizer_type"] = tokenizer_type
        hf = AutoTokenizer.from_pretrained(os.fspath(path), **kwargs)
        return cls(hf, eos_token_ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """encode() of each text, in one call: the Rust tokenizer spreads a batch over its
        threads (a tokenizer without a Rust backend encodes them one by one)."""
        if self.backend is None or not texts:
            return [self.encode(text, add_special_tokens) for text in texts]
        encoded = self.hf(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
        return [list(ids) for ids in encoded]

    def encode_pair(self, text: str, text_pair: str) -> tuple[list[int], list[int] | None]:
        """A (query, document) pair as one prompt, as a cross-encoder reads it: its token
        ids and, where the tokenizer makes them, its segment (token type) ids."""
        encoded = self.hf(text, text_pair)
        types = encoded.get("token_type_ids")
        return list(encoded["input_ids"]), list(types) if types is not None else None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.has_chat_template and kwargs.get("chat_template") is None:
            raise ValueError("this model's tokenizer has no chat template; pass a plain prompt")
        return self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs) -> list[int]:
        # The template writes the special tokens itself; adding them again would double BOS.
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a request's output tokens into text as they arrive, and finds stop strings.

    `text` is all text so far; `stream_len` is how much of it is safe to stream: it holds
    back the last len(longest stop) - 1 characters, which could be the start of a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.text = ""
        self._stream = None
        self._ids: list[int] = []
        if tokenizer.backend is not None:
            from tokenizers.decoders import DecodeStream
            # Primed with the prompt's tail so the first word's leading space survives.
            self._stream = DecodeStream(ids=prompt_token_ids[-6:],
                                        skip_special_tokens=params.skip_special_tokens)
        self._holdback = max((len(s) for s in params.stop_strings), default=1) - 1
        self.stopped_by: str | None = None

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token's text; returns the stop string if one now appears."""
        previous_len = len(self.text)
        self.text += self._decode_next(token_id)
        return self._find_stop(previous_len) if check_stop else None

    @property
    def stream_len(self) -> int:
        if self.stopped_by is not None:
            return len(self.text)
        return max(0, len(self.text) - self._holdback)

    def finalize(self) -> None:
        """No more tokens: everything left is safe to stream (bytes that never made a whole
        character stay out of the text)."""
        self._holdback = 0

    def _decode_next(self, token_id: int) -> str:
        if self._stream is not None:
            return self._stream.step(self.tokenizer.backend, token_id) or ""
        # Slow tokenizers: decode everything and keep only completed characters.
        self._ids.append(token_id)
        full = self.tokenizer.decode(self._ids, self.params.skip_special_tokens)
        if full.endswith("\ufffd"):
            return ""
        return full[len(self.text):]

    def _find_stop(self, previous_len: int) -> str | None:
        stops = self.params.stop_strings
        if not stops:
            return None
        start = max(0, previous_len - self._holdback)
        found = [(idx, stop) for stop in stops if (idx := self.text.find(stop, start)) != -1]
        if not found:
            return None
        idx, stop = min(found)
        end = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self.text = self.text[:end]
        self.stopped_by = stop
        return stop
