"""N-gram (prompt lookup) drafting: a request's next tokens are guessed from what followed an
earlier occurrence of its latest tokens in its own prompt and output. No model, no state:
input-grounded tasks (rewrite, extract, continue a list) repeat spans of their input."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tllm.config import NGramDecodingConfig
from tllm.request import Request
from tllm.speculative.interface import Drafter, Drafts


def ngram_draft(token_ids: list[int], max_ngram: int, max_len: int,
                use_oldest: bool = False) -> list[int]:
    """The tokens that followed the latest (or oldest) earlier occurrence of the sequence's
    last n tokens, for the largest n <= max_ngram that occurs; at most max_len of them."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        # windows that start early enough to be followed by at least one token
        windows = sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            start = int(starts[0] if use_oldest else starts[-1]) + n
            return tokens[start:start + max_len].tolist()
    return []


class NGramDrafter(Drafter):
    """NGramDecodingConfig's drafter (TensorRT-LLM's prompt lookup)."""

    def __init__(self, config: NGramDecodingConfig) -> None:
        super().__init__(config.max_draft_len)
        self.max_ngram = config.max_matching_ngram_size
        self.use_oldest = config.is_use_oldest

    def propose(self, requests: list[Request], max_draft_lens: list[int]) -> Drafts:
        return Drafts([ngram_draft(r.token_ids, self.max_ngram, k, self.use_oldest)
                       for r, k in zip(requests, max_draft_lens)])

    def free(self, request: Request) -> None:
        """Nothing is kept per request."""
