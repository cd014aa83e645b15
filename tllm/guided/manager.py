"""The grammar state of each guided request, on the resource-manager interface: a matcher
made when the request is first scheduled, advanced with each token the host accepts, freed
with the request; and the batch's token bitmask, filled on the CPU and applied on the
logits' device.

Under the overlap scheduler the loop samples step N+1 only after the host has processed
step N's tokens, so the mask filled at sampling time is exact; it is filled while step N+1's
forward runs on the device, and guided requests never force the loop to sync."""
from __future__ import annotations

from typing import Any

import torch

from tllm.guided.grammar import GrammarCache, grammar_cache, register_engine_vocab_size
from tllm.request import Request
from tllm.scheduler.interface import ResourceManager, ScheduledBatch


class GuidedDecoding(ResourceManager):
    """Matchers of the live guided requests. `tokenizer` (a tllm Tokenizer) gives the token
    strings, `vocab_size` the width of the model's logits."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._cache: GrammarCache | None = None  # made on the first guided request
        self._matchers: dict[Request, Any] = {}
        register_engine_vocab_size(tokenizer, vocab_size)

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            self._cache = grammar_cache(self._tokenizer, self._vocab_size)
        return self._cache

    @property
    def num_active(self) -> int:
        """Requests holding a matcher (for tests and monitoring)."""
        return len(self._matchers)

    def check(self, request: Request) -> None:
        """At submission: ValueError if the request's grammar does not compile."""
        params = request.sampling_params.guided_decoding
        if params is not None:
            self.cache.compile(params)

    def prepare(self, batch: ScheduledBatch) -> None:
        import xgrammar as xgr
        for request in batch.requests:
            params = request.sampling_params.guided_decoding
            if params is not None and request not in self._matchers:
                self._matchers[request] = xgr.GrammarMatcher(self.cache.compile(params))

    def accept(self, request: Request, token_id: int) -> bool:
        """Advance the request's matcher by its new token; True once the grammar has ended
        (the request stops). A token the grammar refuses fails the request."""
        matcher = self._matchers.get(request)
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):
            raise ValueError(f"guided decoding: token {token_id} does not continue the "
                             f"grammar of request {request.request_id}")
        return matcher.is_terminated()

    def mask_logits(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """`logits` [rows, vocab] with the tokens each guided row's grammar forbids at -inf
        (a copy; unguided rows untouched)."""
        rows = [i for i, r in enumerate(requests) if r in self._matchers]
        if not rows:
            return logits
        import xgrammar as xgr
        bitmask = xgr.allocate_token_bitmask(len(rows), self.cache.vocab_size)
        for j, i in enumerate(rows):
            self._matchers[requests[i]].fill_next_token_bitmask(bitmask, j)
        guided = logits[rows].contiguous()  # indexing copies: the step's logits stay raw
        xgr.apply_token_bitmask_inplace(guided, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=min(self.cache.vocab_size, logits.shape[1]))
        if guided.shape[1] > self.cache.vocab_size:  # padded rows past the tokenizer
            guided[:, self.cache.vocab_size:] = float("-inf")
        out = logits.clone()
        out[rows] = guided
        return out

    def free(self, request: Request) -> None:
        self._matchers.pop(request, None)
