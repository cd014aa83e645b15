"""Prompts whose returned samples are chosen among more sequences: best_of sampling (the n
of best_of samples with the highest cumulative logprob) and beam search (the n best
hypotheses of a beam group). Their deltas are held back until every sequence has ended,
then each returned sample gets one final delta, as sample 0..n-1, best first (a streamed
result yields only that; the server refuses to stream them, as vLLM does)."""
from __future__ import annotations

from typing import Callable

from tllm.llmapi.result import DeltaBuilder, bind_deltas
from tllm.outputs import CompletionDelta
from tllm.request import FinishReason, Request
from tllm.sampling.beam import BeamGroup
from tllm.sampling_params import SamplingParams
from tllm.tokenizer import IncrementalDetokenizer, Tokenizer

OnDelta = Callable[[CompletionDelta], None]


def make_beam_group(requests: list[Request], params: SamplingParams, *, max_blocks: int,
                    num_blocks: int, max_batch_size: int, max_num_tokens: int) -> None:
    """Make the requests (one per beam) a beam group; ValueError if the engine could never
    run it: all beams are admitted, and step, together."""
    width = params.beam_width
    for limit, name in ((max_batch_size, "max_batch_size"), (max_num_tokens, "max_num_tokens")):
        if width > limit:
            raise ValueError(f"SamplingParams.best_of: a beam width of {width} exceeds the "
                             f"engine's {name} ({limit})")
    if width * max_blocks > num_blocks:
        raise ValueError(f"inputs: {width} beams of this prompt need up to "
                         f"{width * max_blocks} KV blocks, more than the cache has "
                         f"({num_blocks}); raise kv_cache_config.max_tokens or lower "
                         "max_tokens or the beam width")
    for request in requests:
        request.detokenizer = None  # a beam's tokens are rewritten as beams fork
    BeamGroup(requests, params.length_penalty, params.early_stopping, params.n)


def bind_outputs(requests: list[Request], on_delta: OnDelta,
                 tokenizer: Tokenizer | None) -> None:
    """bind_deltas, or for best_of / beam search a collector that hands on the n best."""
    params = requests[0].sampling_params
    if not params.ranks_by_logprob:
        bind_deltas(requests, on_delta)
        return
    collector = (_BeamOutputs if params.use_beam_search else _BestOfOutputs)(
        requests, on_delta, tokenizer)
    for request in requests:
        request.on_update = collector.on_update


class _RankedOutputs:
    """Waits (on the executor thread) until every sequence of the prompt has finished."""

    def __init__(self, requests: list[Request], on_delta: OnDelta,
                 tokenizer: Tokenizer | None) -> None:
        self.requests = requests
        self.on_delta = on_delta
        self.tokenizer = tokenizer
        self.num_results = requests[0].sampling_params.n
        self._is_sent = False

    def on_update(self, request: Request) -> None:
        if self._is_sent or not all(r.is_finished for r in self.requests):
            return
        self._is_sent = True
        failed = next((r for r in self.requests if r.error is not None), None)
        if failed is not None or self._was_aborted():
            deltas = self._abort_deltas(failed.error if failed is not None else None)
        else:
            deltas = self._final_deltas()
        for delta in deltas:
            self.on_delta(delta)

    def _was_aborted(self) -> bool:
        return any(r.finish_reason is FinishReason.ABORT for r in self.requests)

    def _abort_deltas(self, error: Exception | None) -> list[CompletionDelta]:
        metrics = DeltaBuilder().build(self.requests[0]).metrics
        return [CompletionDelta(i, [], "", finish_reason="abort", error=error,
                                metrics=metrics) for i in range(self.num_results)]

    def _final_deltas(self) -> list[CompletionDelta]:
        raise NotImplementedError


class _BestOfOutputs(_RankedOutputs):
    def _final_deltas(self) -> list[CompletionDelta]:
        ranked = sorted(self.requests, key=lambda r: -r.cumulative_logprob)
        deltas = []
        for index, request in enumerate(ranked[:self.num_results]):
            delta = DeltaBuilder().build(request)
            delta.index = index
            delta.cumulative_logprob = request.cumulative_logprob
            delta.prompt_logprobs = None
            deltas.append(delta)
        prompt_logprobs = self.requests[0].prompt_logprobs
        deltas[0].prompt_logprobs = prompt_logprobs or None
        return deltas


class _BeamOutputs(_RankedOutputs):
    def _was_aborted(self) -> bool:
        return not self.requests[0].beam_group.is_done

    def _final_deltas(self) -> list[CompletionDelta]:
        leader = self.requests[0]
        metrics = DeltaBuilder().build(leader).metrics
        deltas = []
        for index, hypothesis in enumerate(leader.beam_group.results()):
            tokens = hypothesis.token_ids
            deltas.append(CompletionDelta(
                index, list(tokens), self._text(leader, tokens),
                finish_reason=hypothesis.finish_reason, stop_reason=hypothesis.stop_reason,
                cumulative_logprob=hypothesis.cumulative_logprob,
                metrics={**metrics, "num_output_tokens": len(tokens)}))
        deltas[0].prompt_logprobs = leader.prompt_logprobs or None
        return deltas

    def _text(self, leader: Request, token_ids: list[int]) -> str:
        params = leader.sampling_params
        if self.tokenizer is None or not params.detokenize:
            return ""
        detokenizer = IncrementalDetokenizer(self.tokenizer, leader.prompt_token_ids, params)
        for token in token_ids:
            detokenizer.add_token(token, check_stop=False)
        return detokenizer.text
