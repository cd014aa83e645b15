"""The sampler: one batched pass from the last-token logits of each request to its next
token (and logprobs when asked), with per-request parameters and seeded generators."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from tllm.kernels.sampling_noise import sample_tokens_ref
from tllm.request import Request
from tllm.outputs import Logprob, PositionLogprobs
from tllm.sampling import processors as P
from tllm.sampling.logprobs_mode import filtered_logits, reported_logprobs
from tllm.sampling.penalties import PenaltyCounts
from tllm.sampling.rows import SamplingRows, SlotParams, has_penalty, rows_of_requests
from tllm.upload import Uploader


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]  # per row, None where not asked for
    sampled_logprobs: list[float | None]
    has_no_logprobs: bool = False  # no row has any (both lists are all None)


class SampledBatch:
    """Sampled tokens (and logprob tensors) still on the device. On CUDA they are copied to
    pinned host memory without blocking; `host()` waits for that copy alone, not for
    whatever the GPU was given after it (the overlap scheduler relies on this)."""

    def __init__(self, requests: list[Request], token_ids: torch.Tensor,
                 logprob_tensors: tuple[torch.Tensor, ...] | None) -> None:
        self.requests = requests
        self.token_ids = token_ids  # stays on the device: the next step's inputs read it
        self.slots: np.ndarray | None = None  # the rows' batch slots, when sampled by slot
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
            return SamplerOutput(token_ids, [None] * len(token_ids), [None] * len(token_ids),
                                 has_no_logprobs=True)
        return _logprobs_output(token_ids, *self._host[1:], self.requests)


class Sampler:
    """Samples the rows of a step. The executor's rows come with their batch slots, whose
    parameters (and penalty token counts) were written once when each request took its
    slot; other callers pass requests alone and the parameters are read from them. Random
    rows draw counter-based noise (tllm.kernels.sampling_noise): a request's sample depends
    on its seed and position only, never on the rest of the batch."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu",
                 num_slots: int = 0, vocab_size: int = 0,
                 batch_invariant: bool = False) -> None:
        self.device = torch.device(device)
        # deterministic mode: the CPU noise row by row (its -log is vectorised with a
        # scalar tail, which rounds differently, wherever the batch's size puts the tail)
        self.batch_invariant = batch_invariant
        # speculative acceptance draws its uniforms from this one (tllm.executor.speculation)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seeds = random.Random(seed)  # the noise keys of requests without a seed
        self.vocab_size = vocab_size
        self.slot_params = SlotParams(num_slots, vocab_size) if num_slots else None
        self.penalties = (PenaltyCounts(num_slots, vocab_size, self.device) if num_slots
                          else None)
        self._uploaders = (Uploader(self.device, torch.float32),
                           Uploader(self.device, torch.int64))
        # tllm.guided.GuidedDecoding when the engine serves guided requests: its bitmask
        # removes the tokens each guided row's grammar forbids before any choice is made
        self.guided = None

    # ---- batch slots (the model runner's SlotAssigner tells) ----

    @torch.inference_mode()
    def assign_slot(self, slot: int, request: Request) -> None:
        self.slot_params.assign(slot, request, self._seed_of(request))
        if has_penalty(request):
            self.penalties.assign(slot, request)

    def release_slot(self, slot: int, request=None) -> None:
        self.penalties.release(slot)

    def _seed_of(self, request: Request) -> int:
        seed = request.sampling_params.seed
        if seed is None:
            return self._seeds.getrandbits(62)
        return (seed + request.sample_index) & ((1 << 63) - 1)

    # ---- sampling ----

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: list[Request],
               slots: np.ndarray | None = None) -> SampledBatch:
        """Each row's next token (and logprobs where asked). `slots`: the rows' batch slots
        (their parameters and token counts are kept there); None reads the requests."""
        if not requests:  # (a pooling model's logits have no vocabulary columns)
            return SampledBatch([], torch.empty(0, dtype=torch.long, device=logits.device),
                                None)
        guided = self.guided is not None and self.guided.has_guided(requests)
        if slots is not None and not guided and self.slot_params.is_plain_greedy(slots):
            return SampledBatch(requests, logits.argmax(dim=-1), None)  # (no float copy)
        rows = self._rows(requests, slots, logits.shape[1])
        if self._is_plain_greedy(rows, requests):
            return SampledBatch(requests, logits.argmax(dim=-1), None)
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if rows.wants_logprob.any() else None
        logits = self._processed_logits(logits, rows, requests, slots)
        token_ids = logits.argmax(dim=-1)
        random_rows = np.flatnonzero(~rows.greedy)
        if len(random_rows):
            index = torch.from_numpy(random_rows).to(logits.device, non_blocking=True)
            token_ids[index] = self._sample_random(logits[index], rows, index)
        if slots is not None and rows.repetition is not None:
            self.penalties.add(slots, token_ids)
        if raw_logprobs is None:
            return SampledBatch(requests, token_ids, None)
        raw_logprobs = reported_logprobs(raw_logprobs, logits, rows, requests)
        return SampledBatch(requests, token_ids,
                            _logprob_tensors(raw_logprobs, token_ids, rows.max_logprobs))

    def _rows(self, requests: list[Request], slots: np.ndarray | None,
              vocab_size: int) -> SamplingRows:
        if slots is not None:
            return self.slot_params.rows(slots, requests, self._uploaders)
        return rows_of_requests(requests, vocab_size, self._uploaders,
                                [self._seed_of(r) for r in requests])

    def _is_plain_greedy(self, rows: SamplingRows, requests: list[Request]) -> bool:
        """Argmax of the raw logits is the whole answer (no copy to float32 either)."""
        return (rows.all_greedy and not rows.wants_logprob.any() and rows.repetition is None
                and rows.stop_masks is None and rows.logit_bias is None
                and (self.guided is None or not self.guided.has_guided(requests)))

    def _processed_logits(self, logits: torch.Tensor, rows: SamplingRows,
                          requests: list[Request], slots: np.ndarray | None) -> torch.Tensor:
        """Logit bias, penalties, min_tokens' stop masks, then the grammar's mask."""
        if rows.logit_bias is not None:
            index_rows, ids, values = rows.logit_bias
            logits = logits.index_put((index_rows, ids), values, accumulate=True)
        if rows.repetition is not None:
            counts, seen = (self.penalties.counts(slots) if slots is not None
                            else _counts_of(requests, logits.shape[1], logits.device))
            logits = P.apply_repetition_penalty(logits, seen, rows.repetition)
            logits = P.apply_presence_frequency_penalty(logits, counts, rows.presence,
                                                        rows.frequency)
        if rows.stop_masks is not None:
            logits = logits.index_put(rows.stop_masks,
                                      torch.tensor(float("-inf"), device=logits.device))
        if self.guided is not None:
            logits = self.guided.mask_logits(logits, requests)
        return logits

    def failing_rows(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """The rows whose request makes sampling fail on its own (after the batch failed).
        Random state is restored, so the probe changes no later sample."""
        state = self._seeds.getstate()
        failing = []
        try:
            for i, request in enumerate(requests):
                try:
                    self.sample(logits[i:i + 1], [request])
                except Exception:
                    failing.append(i)
        finally:
            self._seeds.setstate(state)
        return failing

    def _sample_random(self, logits: torch.Tensor, rows: SamplingRows,
                       index: torch.Tensor) -> torch.Tensor:
        probs = _processed_probs(logits, rows, index)
        seeds, counters = rows.seeds[index], rows.counters[index]
        if probs.is_cuda:
            from tllm.kernels.triton.sample_tokens import sample_tokens
            return sample_tokens(probs, seeds, counters)
        if self.batch_invariant:
            return torch.cat([sample_tokens_ref(probs[i:i + 1], seeds[i:i + 1],
                                                counters[i:i + 1]) for i in range(len(probs))])
        return sample_tokens_ref(probs, seeds, counters)

    def request_rows(self, requests: list[Request], vocab_size: int) -> SamplingRows:
        """Sampling rows read from the requests (no slots, no seeds)."""
        return rows_of_requests(requests, vocab_size, self._uploaders, [0] * len(requests))

    def processed_probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The distribution each row samples from: its request's temperature, top-k, top-p
        and min-p applied to its (float) logits (speculative verification needs it too)."""
        rows = rows_of_requests(requests, logits.shape[1], self._uploaders, [0] * len(requests))
        return _processed_probs(logits, rows, None)


def _processed_probs(logits: torch.Tensor, rows: SamplingRows,
                     index: torch.Tensor | None) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on `logits` (the rows `index` of the call)."""
    return filtered_logits(logits, rows, index).softmax(dim=-1)


def _counts_of(requests: list[Request], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(output counts, seen in prompt or output) from the requests' own token lists."""
    counts = P.token_counts([r.output_token_ids for r in requests], vocab, device)
    seen = P.token_mask([r.token_ids for r in requests], vocab, device)
    return counts, seen


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, requests: list[Request],
                   rows: SamplingRows | None = None,
                   processed: torch.Tensor | None = None) -> SamplerOutput:
    """Each row's chosen token with its logprob, rank and the request's top-k; rows of
    requests that asked for none get None. From the raw logits, or with `rows` (the
    requests' sampling rows) from the distribution each request's logprobs_mode names, as
    `Sampler.sample` reports them (`processed`: the logits after the grammar's mask; None:
    `logits` themselves)."""
    raw_logprobs = logits.float().log_softmax(dim=-1)
    if rows is not None:
        processed = logits if processed is None else processed
        raw_logprobs = reported_logprobs(raw_logprobs, processed.float(), rows, requests)
    max_k = max(r.sampling_params.logprobs or 0 for r in requests)
    return _logprobs_output(token_ids.tolist(),
                            *_logprob_tensors(raw_logprobs, token_ids, max_k), requests)


def _logprob_tensors(raw_logprobs: torch.Tensor, token_ids: torch.Tensor,
                     max_k: int) -> tuple[torch.Tensor, ...]:
    """(chosen logprob, rank, top-k values, top-k ids), still on the device."""
    chosen = raw_logprobs.gather(1, token_ids[:, None])[:, 0]
    ranks = (raw_logprobs > chosen[:, None]).sum(dim=-1) + 1
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
