"""The grammar state of each guided request, on the resource-manager interface: a matcher
made when the request is first scheduled, advanced with each token the host accepts, freed
with the request; and the batch's token bitmask, filled on the CPU and applied on the
logits' device.

Under the overlap scheduler the loop samples step N+1 only after the host has processed
step N's tokens, so the mask filled at sampling time is exact; it is filled while step N+1's
forward runs on the device, and guided requests never force the loop to sync.

With `reasoning_tags` the grammar waits for the thinking to end (a ReasoningGate); with
drafts to verify, each draft position gets the mask of the grammar after the drafts before
it (verify_bitmask), and the matcher is rolled back, so only the host's accepted tokens
advance it."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from tllm.guided.grammar import GrammarCache, grammar_cache, register_engine_vocab_size
from tllm.guided.probe import UnsatisfiableGrammarError, admits_no_token
from tllm.request import Request
from tllm.scheduler.interface import ResourceManager, ScheduledBatch


@dataclass
class ReasoningGate:
    """A request whose grammar waits for its thinking to end. Thinking (the prompt opened
    it, or the output did): nothing is masked until the end token. Not yet known (the
    prompt has neither tag): the first token may open the thinking or begin the answer."""

    start: int
    end: int
    is_thinking: bool

    def after(self, token: int) -> ReasoningGate | None:
        """The gate after `token` (None: the grammar applies from the next token on, or,
        for a first token that begins the answer, from this token itself)."""
        if self.is_thinking:
            return None if token == self.end else self
        return ReasoningGate(self.start, self.end, True) if token == self.start else None


class GuidedDecoding(ResourceManager):
    """Matchers of the live guided requests. `tokenizer` (a tllm Tokenizer) gives the token
    strings, `vocab_size` the width of the model's logits."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._cache: GrammarCache | None = None  # made on the first guided request
        self._matchers: dict[Request, Any] = {}
        self._gates: dict[Request, ReasoningGate] = {}
        self._batch_matcher = None  # xgrammar's threaded fill, on hosts with cores to spare
        self.fill_seconds = 0.0     # host time spent filling masks (benchmarks read it)
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
            if params.reasoning_tags is not None:
                self._tag_ids(params.reasoning_tags)

    def prepare(self, batch: ScheduledBatch) -> None:
        import xgrammar as xgr
        for request in batch.requests:
            params = request.sampling_params.guided_decoding
            if params is not None and request not in self._matchers:
                self._matchers[request] = xgr.GrammarMatcher(self.cache.compile(params))
                if params.reasoning_tags is not None:
                    self._open_gate(request, params.reasoning_tags)

    def _tag_ids(self, tags: tuple[str, str]) -> tuple[int, int]:
        ids = []
        for tag in tags:
            encoded = self._tokenizer.encode(tag, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"guided_decoding.reasoning_tags: {tag!r} is not one token "
                                 f"of this model's vocabulary (it encodes as {encoded})")
            ids.append(encoded[0])
        return ids[0], ids[1]

    def _open_gate(self, request: Request, tags: tuple[str, str]) -> None:
        """The gate from the prompt's last tag: its end (thinking disabled, as Qwen3's
        template writes it) means the grammar applies at once."""
        start, end = self._tag_ids(tags)
        for token in reversed(request.prompt_token_ids):
            if token in (start, end):
                if token == start:
                    self._gates[request] = ReasoningGate(start, end, is_thinking=True)
                return
        self._gates[request] = ReasoningGate(start, end, is_thinking=False)

    def accept(self, request: Request, token_id: int) -> bool:
        """Advance the request's matcher by its new token; True once the grammar has ended
        (the request stops). A token the grammar refuses fails the request: with
        UnsatisfiableGrammarError where the grammar admitted no token at all."""
        matcher = self._matchers.get(request)
        if matcher is None:
            return False
        gate = self._gates.pop(request, None)
        if gate is not None:
            after = gate.after(token_id)
            if after is not None or gate.is_thinking:
                if after is not None:
                    self._gates[request] = after
                return False
        if not matcher.accept_token(token_id):
            if admits_no_token(matcher, self.cache.vocab_size):
                raise UnsatisfiableGrammarError(
                    "guided decoding: the grammar admits no further token and has not "
                    "ended: no output satisfies it (an impossible pattern, or a rule that "
                    "never ends)")
            raise ValueError(f"guided decoding: token {token_id} does not continue the "
                             f"grammar of request {request.request_id}")
        return matcher.is_terminated()

    def has_guided(self, requests: list[Request]) -> bool:
        """Whether any of the requests decodes under a grammar."""
        return bool(self._matchers) and any(r in self._matchers for r in requests)

    def mask_logits(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """`logits` [rows, vocab] with the tokens each guided row's grammar forbids at -inf
        (a copy; unguided rows and rows still thinking untouched)."""
        if not self._matchers:
            return logits
        rows = [i for i, r in enumerate(requests) if r in self._matchers
                and not self._is_thinking(r)]
        if not rows:
            return logits
        import xgrammar as xgr
        start = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(len(requests), self.cache.vocab_size)  # by row
        matchers = [self._matchers[requests[i]] for i in rows]
        if len(rows) >= _MIN_ROWS_FOR_THREADS and _NUM_FILL_THREADS > 1:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=_NUM_FILL_THREADS)
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        else:
            for i, matcher in zip(rows, matchers):
                matcher.fill_next_token_bitmask(bitmask, i)
        for i in rows:    # a first token may open the thinking
            if (gate := self._gates.get(requests[i])) is not None:
                _allow(bitmask, i, gate.start)
        self.fill_seconds += time.perf_counter() - start
        return self._masked(logits, rows, bitmask)

    def _is_thinking(self, request: Request) -> bool:
        gate = self._gates.get(request)
        return gate is not None and gate.is_thinking

    @staticmethod
    def _fill(bitmask: torch.Tensor, row: int, matcher: Any,
              gate: ReasoningGate | None) -> None:
        """The row's mask: everything while thinking; the grammar's next tokens otherwise,
        and the thinking's start too while it may still open."""
        if gate is not None and gate.is_thinking:
            bitmask[row] = -1
            return
        matcher.fill_next_token_bitmask(bitmask, row)
        if gate is not None:
            _allow(bitmask, row, gate.start)

    def _masked(self, logits: torch.Tensor, rows: list[int],
                bitmask: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` (the step's stay raw) with `rows` masked by the same rows of
        `bitmask` (every other row of it allows everything): one copy, one masking pass.
        On a GPU nothing here waits for the device: the host tensors go over pinned, and
        no Python list becomes a device index (either would wait for the step's forward and
        cost the loop its overlap)."""
        import xgrammar as xgr
        out = logits.clone()
        vocab = self.cache.vocab_size
        on_host = logits.device.type == "cpu"
        xgr.apply_token_bitmask_inplace(
            out, _to_device(bitmask, logits.device), vocab_size=min(vocab, out.shape[1]),
            indices=rows if on_host and len(rows) < out.shape[0] else None)
        if out.shape[1] > vocab:  # padded columns past the tokenizer
            if len(rows) == out.shape[0]:
                out[:, vocab:] = float("-inf")
            else:
                guided = torch.zeros(out.shape[0], dtype=torch.bool)
                guided[rows] = True
                out[:, vocab:].masked_fill_(_to_device(guided, logits.device)[:, None],
                                            float("-inf"))
        return out

    def mask_verify_logits(self, target: torch.Tensor,
                           requests: list[Request]) -> torch.Tensor:
        """`target` [requests, K+1, vocab] (a verify step: each request's drafts and the
        position after them) with each position masked by the grammar after the drafts
        before it; the matchers end where they began."""
        num, width, vocab = target.shape
        guided = [s for s, r in enumerate(requests) if r in self._matchers]
        if not guided:
            return target
        import xgrammar as xgr
        bitmask = xgr.allocate_token_bitmask(num * width, self.cache.vocab_size)  # by row
        for s in guided:
            self._fill_drafts(bitmask, s * width, width, requests[s])
        rows = [s * width + c for s in guided for c in range(width)]
        return self._masked(target.reshape(num * width, vocab), rows,
                            bitmask).view(num, width, vocab)

    def _fill_drafts(self, bitmask: torch.Tensor, first_row: int, width: int,
                     request: Request) -> None:
        """Rows first_row.. : the mask before each draft of the request (and after the last).
        Past a draft the grammar refuses, rows repeat the last mask: the verify step rejects
        that draft, so nothing after it is used."""
        matcher, gate = self._matchers[request], self._gates.get(request)
        num_accepted, last_filled = 0, first_row
        drafts = request.draft_token_ids or []
        for position in range(width):
            if matcher.is_terminated():     # a draft ended the grammar: the request stops
                break
            last_filled = first_row + position
            self._fill(bitmask, last_filled, matcher, gate)
            if position == len(drafts):
                break
            token = drafts[position]
            if gate is not None:
                after = gate.after(token)
                if after is not None or gate.is_thinking:
                    gate = after
                    continue
                gate = None
            if not matcher.accept_token(token):
                break
            num_accepted += 1
        bitmask[last_filled + 1:first_row + width] = bitmask[last_filled]
        if num_accepted:
            matcher.rollback(num_accepted)

    def free(self, request: Request) -> None:
        self._matchers.pop(request, None)
        self._gates.pop(request, None)


# A batch's masks are filled by xgrammar's threads where the host has cores to spare (the
# loop's own thread and the device's launches need some): a GPU host, not a 2-core CPU box.
_NUM_FILL_THREADS = min(8, (os.cpu_count() or 1) // 2) if (os.cpu_count() or 1) >= 8 else 1
_MIN_ROWS_FOR_THREADS = 8


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device` without a wait: a copy from pageable memory would first wait for
    the stream's queued work; from pinned memory (torch's caching host allocator keeps the
    buffer until the copy is done) it is queued like a kernel."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _allow(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Set one token's bit in xgrammar's packed int32 bitmask."""
    bit = 1 << (token % 32)
    word = bitmask[row, token // 32].item() | (bit - (1 << 32) if bit >= 1 << 31 else bit)
    bitmask[row, token // 32] = word
