"""Whether a compiled grammar can end at all, asked before a request runs.

An empty regex class (`[^\\s\\S]`), a rule that never ends (`root ::= root "a"`) or a JSON
schema whose required string has an impossible pattern compile fine in xgrammar, and then
admit no token at some point: the request would fail mid-generation. `probe` searches the
token sequences the grammar admits, depth first, for one that reaches a stop token, within a
budget of mask fills and of time (a fill takes 0.05 ms to a few ms: more in long free
strings). It refuses only what it has proved: every path explored to a dead end. A grammar it cannot settle within the budget (most grammars: free
text is a wide tree) is let through, and a dead end met later fails that request alone
(`UnsatisfiableGrammarError`, from the manager's `accept`)."""
from __future__ import annotations

import time
from typing import Any

import numpy as np

# Per grammar, once (the compiled grammar is cached after). An impossible required pattern
# behind a JSON object's first key took 24 fills (1.6 ms) with SmolLM2's vocabulary.
PROBE_FILLS = 48
PROBE_SECONDS = 0.05


class UnsatisfiableGrammarError(ValueError):
    """A request's grammar admits no further token: no output can satisfy it. A client's
    error (the server answers 400), not the engine's."""


def allowed_token_ids(bitmask: Any, row: int = 0) -> np.ndarray:
    """The token ids one row of xgrammar's packed int32 bitmask allows (bit i of word w is
    token 32 w + i)."""
    words = bitmask[row].numpy().view(np.uint8)
    return np.flatnonzero(np.unpackbits(words, bitorder="little"))


def admits_no_token(matcher: Any, vocab_size: int) -> bool:
    """The matcher's grammar has not ended and no token may come next: a dead end."""
    import xgrammar as xgr
    if matcher.is_terminated():
        return False
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return not bool(bitmask.any())


def probe(compiled: Any, vocab_size: int, stop_token_ids: set[int],
          max_fills: int = PROBE_FILLS, max_seconds: float = PROBE_SECONDS) -> bool | None:
    """True: some token sequence ends the grammar; False: none does (every path explored is
    a dead end); None: the budget ran out first."""
    import xgrammar as xgr
    search = _Search(xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab_size),
                     stop_token_ids, max_fills, time.perf_counter() + max_seconds)
    return search.can_end()


class _Search:
    def __init__(self, matcher: Any, bitmask: Any, stop_token_ids: set[int],
                 max_fills: int, deadline: float) -> None:
        self.matcher = matcher
        self.bitmask = bitmask
        self.stop_token_ids = stop_token_ids
        self.fills_left = max_fills
        self.deadline = deadline

    def can_end(self) -> bool | None:
        """Whether the grammar can end from the matcher's state (None: undecided)."""
        if self.matcher.is_terminated():
            return True
        if self.fills_left <= 0 or time.perf_counter() > self.deadline:
            return None
        self.fills_left -= 1
        self.matcher.fill_next_token_bitmask(self.bitmask)
        if any(_allows(self.bitmask, t) for t in self.stop_token_ids):
            return True
        for token in allowed_token_ids(self.bitmask):
            if not self.matcher.accept_token(int(token)):
                continue
            found = self.can_end()
            self.matcher.rollback(1)
            if found is not False:
                return found
        return False


def _allows(bitmask: Any, token: int) -> bool:
    word = int(bitmask[0, token // 32]) if token // 32 < bitmask.shape[1] else 0
    return bool((word >> (token % 32)) & 1)
