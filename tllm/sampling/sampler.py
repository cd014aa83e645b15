"""The sampler: one batched pass from the last-token logits of each request to its next
token (and logprobs when asked), with per-request parameters and seeded generators."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tllm.request import Request
from tllm.outputs import Logprob, PositionLogprobs
from tllm.sampling import processors as P


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]  # per row, None where not asked for
    sampled_logprobs: list[float | None]


class SampledBatch:
    """Sampled tokens (and logprob tensors) still on the device. On CUDA they are copied to
    pinned host memory without blocking; `host()` waits for that copy alone, not for
    whatever the GPU was given after it (the overlap scheduler relies on this)."""

    def __init__(self, requests: list[Request], token_ids: torch.Tensor,
                 logprob_tensors: tuple[torch.Tensor, ...] | None) -> None:
        self.requests = requests
        self.token_ids = token_ids  # stays on the device: the next step's inputs read it
        tensors = (token_ids,) + (logprob_tensors or ())
        self.device_tensors = tensors
        self._event = None
        if token_ids.is_cuda:
            self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                               for t in tensors)
            for host, dev in zip(self._host, tensors):
                host.copy_(dev, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensors
        self._has_logprobs = logprob_tensors is not None

    def host_token_ids(self) -> list[int]:
        """The sampled tokens on the host (waits for their copy only)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host[0].tolist()

    def host(self) -> SamplerOutput:
        token_ids = self.host_token_ids()
        if not self._has_logprobs:
            return SamplerOutput(token_ids, [None] * len(token_ids), [None] * len(token_ids))
        return _logprobs_output(token_ids, *self._host[1:], self.requests)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # tllm.guided.GuidedDecoding when the engine serves guided requests: its bitmask
        # removes the tokens each guided row's grammar forbids before any choice is made
        self.guided = None

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SampledBatch:
        logits = logits.float()
        want_logprobs = [_wants_logprob(r) for r in requests]
        raw_logprobs = logits.log_softmax(dim=-1) if any(want_logprobs) else None
        logits = self._apply_logit_bias(logits, requests)
        logits = self._apply_penalties(logits, requests)
        logits = self._mask_stop_tokens_before_min(logits, requests)
        if self.guided is not None:
            logits = self.guided.mask_logits(logits, requests)
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sampled = self._sample_random(logits[rows], [requests[i] for i in random_rows])
            token_ids[rows] = sampled
        if raw_logprobs is None:
            return SampledBatch(requests, token_ids, None)
        return SampledBatch(requests, token_ids, _logprob_tensors(raw_logprobs, token_ids,
                                                                  requests))

    def failing_rows(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """The rows whose request makes sampling fail on its own (after the batch failed).
        Random state is restored, so the probe changes no later sample."""
        states = [self.generator.get_state()] + [
            r.generator.get_state() for r in requests if r.generator is not None]
        failing = []
        try:
            for i, request in enumerate(requests):
                try:
                    self.sample(logits[i:i + 1], [request])
                except Exception:
                    failing.append(i)
        finally:
            self.generator.set_state(states[0])
            seeded = (r.generator for r in requests if r.generator is not None)
            for generator, state in zip(seeded, states[1:]):
                generator.set_state(state)
        return failing

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows, cols, values = [], [], []
        for i, request in enumerate(requests):
            for token, bias in (request.sampling_params.logit_bias or {}).items():
                if token < logits.shape[1]:
                    rows.append(i)
                    cols.append(token)
                    values.append(float(bias))
        if not rows:
            return logits
        return logits.index_put((torch.tensor(rows), torch.tensor(cols)),
                                torch.tensor(values, device=logits.device), accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        vocab, device = logits.shape[1], logits.device
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = P.token_mask([r.token_ids for r in requests], vocab, device)
            penalty = torch.tensor([p.repetition_penalty for p in params], device=device)
            logits = P.apply_repetition_penalty(logits, seen, penalty)
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            counts = P.token_counts([r.output_token_ids for r in requests], vocab, device)
            presence = torch.tensor([p.presence_penalty for p in params], device=device)
            frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
            logits = P.apply_presence_frequency_penalty(logits, counts, presence, frequency)
        return logits

    @staticmethod
    def _mask_stop_tokens_before_min(logits: torch.Tensor,
                                     requests: list[Request]) -> torch.Tensor:
        """Before min_tokens outputs, EOS and stop tokens may not be chosen."""
        rows, cols = [], []
        for i, r in enumerate(requests):
            if r.num_output_tokens < r.sampling_params.min_tokens:
                stop_ids = set(r.sampling_params.stop_token_ids)
                if not r.sampling_params.ignore_eos:
                    stop_ids |= r.eos_token_ids
                ids = [t for t in stop_ids if t < logits.shape[1]]
                rows += [i] * len(ids)
                cols += ids
        if rows:
            logits = logits.index_put((torch.tensor(rows), torch.tensor(cols)),
                                      torch.tensor(float("-inf"), device=logits.device))
        return logits

    def _sample_random(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        probs = self.processed_probs(logits, requests)
        return (probs / self._exponential_noise(probs, requests)).argmax(dim=-1)

    @staticmethod
    def processed_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The distribution each row samples from: its request's temperature, top-k, top-p
        and min-p applied to its (float) logits (speculative verification needs it too)."""
        params = [r.sampling_params for r in requests]
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temperature[:, None]
        vocab = logits.shape[1]
        if any(0 < p.top_k < vocab for p in params):  # top_k >= vocab keeps every token
            top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                                 device=device)
            logits = P.apply_top_k(logits, top_k)
        if any(p.top_p < 1.0 for p in params):
            logits = P.apply_top_p(logits, torch.tensor([p.top_p for p in params], device=device))
        if any(p.min_p > 0.0 for p in params):
            logits = P.apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
        return logits.softmax(dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Exp(1) noise; argmax(probs / noise) is a sample from probs (the Gumbel trick).
        Seeded requests draw their row from their own generator, so their samples do not
        depend on what else is in the batch."""
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, request in enumerate(requests):
            if request.generator is not None:
                noise[i].exponential_(generator=request.generator)
        return noise


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                   requests: list[Request]) -> SamplerOutput:
    """Each row's chosen token with its logprob, rank and the request's top-k (from the raw
    logits, as `Sampler.sample` reports them); rows of requests that asked for none get None."""
    raw_logprobs = logits.float().log_softmax(dim=-1)
    return _logprobs_output(token_ids.tolist(),
                            *_logprob_tensors(raw_logprobs, token_ids, requests), requests)


def _logprob_tensors(raw_logprobs: torch.Tensor, token_ids: torch.Tensor,
                     requests: list[Request]) -> tuple[torch.Tensor, ...]:
    """(chosen logprob, rank, top-k values, top-k ids), still on the device."""
    chosen = raw_logprobs.gather(1, token_ids[:, None])[:, 0]
    ranks = (raw_logprobs > chosen[:, None]).sum(dim=-1) + 1
    max_k = max(r.sampling_params.logprobs or 0 for r in requests)
    top_vals, top_ids = raw_logprobs.topk(max(max_k, 1), dim=-1)
    return chosen, ranks, top_vals, top_ids


def _logprobs_output(token_ids: list[int], chosen, ranks, top_vals, top_ids,
                     requests: list[Request]) -> SamplerOutput:
    chosen, ranks = chosen.tolist(), ranks.tolist()
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    results, sampled = [], []
    for i, request in enumerate(requests):
        k = request.sampling_params.logprobs
        if k is None:  # best_of ranks its samples by their cumulative logprob all the same
            results.append(None)
            sampled.append(chosen[i] if _wants_logprob(request) else None)
            continue
        entry = {token_ids[i]: Logprob(chosen[i], ranks[i])}
        for rank, (tid, val) in enumerate(zip(top_ids[i][:k], top_vals[i][:k]), start=1):
            entry.setdefault(tid, Logprob(val, rank))
        results.append(entry)
        sampled.append(chosen[i])
    return SamplerOutput(token_ids, results, sampled)


def _wants_logprob(request: Request) -> bool:
    params = request.sampling_params
    return params.logprobs is not None or params.ranks_by_logprob


def prompt_logprobs(logits: torch.Tensor, target_ids: list[int], k: int) -> list[PositionLogprobs]:
    """Logprobs of the actual next prompt tokens (plus the top-k) from the prompt logits."""
    logprobs = logits.float().log_softmax(dim=-1)
    targets = torch.tensor(target_ids, device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    out = []
    for i, token in enumerate(target_ids):
        entry = {token: Logprob(float(chosen[i]), ranks[i])}
        if k:
            for rank, (tid, val) in enumerate(zip(top_ids[i].tolist(), top_vals[i].tolist()), 1):
                entry.setdefault(tid, Logprob(val, rank))
        out.append(entry)
    return out
