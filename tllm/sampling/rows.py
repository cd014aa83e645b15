"""The sampling parameters of a sampler call's rows, as device tensors, and where they come
from: `SlotParams` keeps every batch slot's parameters in arrays written once, when a
request takes the slot, so the executor's rows are a gather over slot indices; a list of
requests (speculative verification, the last pipeline stage, probing a failure) gives them
through the same per-request rule (`_row_values`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tllm.request import Request
from tllm.upload import Uploader

# float parameters, then integer ones, in the order _row_values gives them
_FLOATS = ("temperature", "top_p", "min_p", "repetition", "presence", "frequency")
_INTS = ("top_k", "min_tokens", "logprobs", "seed")
_GREEDY_TEMPERATURE = 1e-5  # SamplingParams.is_greedy's threshold


@dataclass
class SamplingRows:
    """Per-row parameters of one call. Tensors are on the logits' device; a filter nobody
    in the call uses is None (and costs nothing)."""
    greedy: np.ndarray                  # [R] bool (host)
    temperature: torch.Tensor           # [R] float32
    top_k: torch.Tensor | None          # [R] int64, vocab where off
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    repetition: torch.Tensor | None     # penalties: None when no row has any
    presence: torch.Tensor | None
    frequency: torch.Tensor | None
    seeds: torch.Tensor                 # [R] int64: each row's noise key ...
    counters: torch.Tensor              # ... and position (the token being drawn)
    logprobs: np.ndarray                # [R] int64 top-k asked for (-1: none) (host)
    wants_logprob: np.ndarray           # [R] bool: logprobs, or best_of/beam ranking
    stop_masks: tuple[torch.Tensor, torch.Tensor] | None  # (rows, ids) below min_tokens
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, ids, values

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())

    @property
    def max_logprobs(self) -> int | None:
        """The widest top-k asked for (None: no row wants logprobs)."""
        return max(int(self.logprobs.max()), 1) if self.wants_logprob.any() else None


def _row_values(request: Request, vocab_size: int) -> tuple[list[float], list[int]]:
    p = request.sampling_params
    top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
    return ([max(p.temperature, _GREEDY_TEMPERATURE), p.top_p, p.min_p,
             p.repetition_penalty, p.presence_penalty, p.frequency_penalty],
            [top_k, p.min_tokens, -1 if p.logprobs is None else p.logprobs, 0])


def _stop_ids(request: Request, vocab_size: int) -> np.ndarray:
    """The tokens masked while the request is below min_tokens."""
    params = request.sampling_params
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids |= request.eos_token_ids
    return np.array(sorted(t for t in ids if t < vocab_size), dtype=np.int64)


def _logit_bias(request: Request, vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    bias = request.sampling_params.logit_bias
    if not bias:
        return None
    kept = [(int(t), float(v)) for t, v in bias.items() if int(t) < vocab_size]
    return (np.array([t for t, _ in kept], np.int64), np.array([v for _, v in kept], np.float32))


class SlotParams:
    """Every batch slot's sampling parameters, written when a request takes the slot."""

    def __init__(self, num_slots: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.floats = np.zeros((num_slots, len(_FLOATS)), dtype=np.float32)
        self.ints = np.zeros((num_slots, len(_INTS)), dtype=np.int64)
        self.greedy = np.ones(num_slots, dtype=bool)
        self.wants_logprob = np.zeros(num_slots, dtype=bool)
        self.has_penalty = np.zeros(num_slots, dtype=bool)
        # anything besides the argmax of the raw logits: random, logprobs, penalties, logit
        # bias, stop tokens masked below min_tokens
        self.needs_more = np.zeros(num_slots, dtype=bool)
        self.stop_ids: list[np.ndarray | None] = [None] * num_slots
        self.logit_bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * num_slots

    def assign(self, slot: int, request: Request, seed: int) -> None:
        floats, ints = _row_values(request, self.vocab_size)
        ints[-1] = seed
        self.floats[slot] = floats
        self.ints[slot] = ints
        params = request.sampling_params
        self.greedy[slot] = params.is_greedy
        self.wants_logprob[slot] = params.logprobs is not None or params.ranks_by_logprob
        self.has_penalty[slot] = has_penalty(request)
        stop_ids = _stop_ids(request, self.vocab_size) if params.min_tokens else None
        self.stop_ids[slot] = stop_ids if stop_ids is not None and len(stop_ids) else None
        self.logit_bias[slot] = _logit_bias(request, self.vocab_size)
        self.needs_more[slot] = (not self.greedy[slot] or self.wants_logprob[slot]
                                 or self.has_penalty[slot] or self.stop_ids[slot] is not None
                                 or self.logit_bias[slot] is not None)

    def is_plain_greedy(self, slots: np.ndarray) -> bool:
        """Whether the argmax of the raw logits is every row's whole answer."""
        return not self.needs_more[slots].any()

    def rows(self, slots: np.ndarray, requests: list[Request],
             uploaders: tuple[Uploader, Uploader]) -> SamplingRows:
        """The rows of these slots (requests in the same order, for their progress)."""
        return _make_rows(self.floats[slots], self.ints[slots], self.greedy[slots],
                          self.wants_logprob[slots], requests,
                          [self.stop_ids[s] for s in slots] if self._any(self.stop_ids, slots)
                          else None,
                          [self.logit_bias[s] for s in slots]
                          if self._any(self.logit_bias, slots) else None, self.vocab_size,
                          uploaders)

    @staticmethod
    def _any(values: list, slots: np.ndarray) -> bool:
        return any(values[s] is not None for s in slots)


def rows_of_requests(requests: list[Request], vocab_size: int,
                     uploaders: tuple[Uploader, Uploader], seeds: list[int]) -> SamplingRows:
    """Rows from requests that hold no slot (or whose slot is not at hand)."""
    values = [_row_values(r, vocab_size) for r in requests]
    ints = np.array([v[1] for v in values], dtype=np.int64).reshape(len(requests), len(_INTS))
    ints[:, -1] = seeds
    params = [r.sampling_params for r in requests]
    stop_ids = [_stop_ids(r, vocab_size) if r.sampling_params.min_tokens else None
                for r in requests]
    biases = [_logit_bias(r, vocab_size) for r in requests]
    return _make_rows(
        np.array([v[0] for v in values], dtype=np.float32).reshape(len(requests), len(_FLOATS)),
        ints, np.array([p.is_greedy for p in params], dtype=bool),
        np.array([p.logprobs is not None or p.ranks_by_logprob for p in params], dtype=bool),
        requests, stop_ids if any(s is not None for s in stop_ids) else None,
        biases if any(b is not None for b in biases) else None, vocab_size, uploaders)


def has_penalty(request: Request) -> bool:
    p = request.sampling_params
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)


def _make_rows(floats: np.ndarray, ints: np.ndarray, greedy: np.ndarray,
               wants_logprob: np.ndarray, requests: list[Request],
               stop_ids: list[np.ndarray | None] | None,
               biases: list[tuple[np.ndarray, np.ndarray] | None] | None,
               vocab_size: int, uploaders: tuple[Uploader, Uploader]) -> SamplingRows:
    """Two transfers (the float and the integer parameters), then views of them."""
    counters = np.fromiter((r.num_tokens for r in requests), np.int64, len(requests))
    [f], [i] = (uploaders[0].upload([floats]),
                uploaders[1].upload([np.concatenate([ints, counters[:, None]], axis=1)]))
    device = f.device
    penalties = bool((floats[:, 3] != 1.0).any() or floats[:, 4].any() or floats[:, 5].any())
    return SamplingRows(
        greedy=greedy, temperature=f[:, 0],
        top_k=i[:, 0] if (ints[:, 0] < vocab_size).any() else None,
        top_p=f[:, 1] if (floats[:, 1] < 1.0).any() else None,
        min_p=f[:, 2] if (floats[:, 2] > 0.0).any() else None,
        repetition=f[:, 3] if penalties else None,
        presence=f[:, 4] if penalties else None,
        frequency=f[:, 5] if penalties else None,
        seeds=i[:, 3], counters=i[:, 4], logprobs=ints[:, 2], wants_logprob=wants_logprob,
        stop_masks=_stop_masks(stop_ids, ints[:, 1], requests, device),
        logit_bias=_bias_entries(biases, device))


def _stop_masks(stop_ids: list[np.ndarray | None] | None, min_tokens: np.ndarray,
                requests: list[Request], device: torch.device):
    """(rows, token ids) to mask: each row below its min_tokens, its stop tokens."""
    if stop_ids is None:
        return None
    rows, ids = [], []
    for row, (stops, request) in enumerate(zip(stop_ids, requests)):
        if stops is not None and len(stops) and request.num_output_tokens < min_tokens[row]:
            rows.append(np.full(len(stops), row, np.int64))
            ids.append(stops)
    if not rows:
        return None
    both = torch.from_numpy(np.stack([np.concatenate(rows), np.concatenate(ids)]))
    both = both.to(device, non_blocking=True)
    return both[0], both[1]


def _bias_entries(biases: list[tuple[np.ndarray, np.ndarray] | None] | None,
                  device: torch.device):
    if biases is None:
        return None
    rows = [np.full(len(b[0]), row, np.int64) for row, b in enumerate(biases) if b is not None]
    if not rows or not sum(len(r) for r in rows):
        return None
    ids = np.concatenate([b[0] for b in biases if b is not None])
    values = np.concatenate([b[1] for b in biases if b is not None])
    index = torch.from_numpy(np.stack([np.concatenate(rows), ids])).to(device, non_blocking=True)
    return index[0], index[1], torch.from_numpy(values).to(device, non_blocking=True)
