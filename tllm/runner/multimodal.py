"""A vision-language model's extra step inputs: the image embeddings that replace the
placeholder tokens a step computes (an image's embeddings are sliced when a prompt chunk
cuts through it), and the tokens' M-RoPE positions. Images run through the encoder once:
`EncoderCache` keeps their embeddings by content hash, for later chunks of the same prompt
and for later requests with the same image."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from tllm.request import Request
from tllm.runner.batch_state import StepArrays, StepDiff

# embeddings rows kept for images no step needs right now (about 30 1-megapixel images)
DEFAULT_ENCODER_CACHE_TOKENS = 32768


@dataclass
class StepMultimodal:
    embed_rows: np.ndarray                # [N] rows of the flat token dimension
    embeds: torch.Tensor | None           # [N, hidden] (None: no image token this step)
    mrope_positions: np.ndarray | None    # [3, T] (None: the model has no M-RoPE)
    # [T] the last position each token attends (AttentionMetadata.causal_limits), for a
    # model whose image tokens attend within their image (Gemma 3); None: causal
    causal_limits: np.ndarray | None = None

    @property
    def is_text_only(self) -> bool:
        """No image token in the step (a decode graph may run it)."""
        return self.embeds is None and self.causal_limits is None


class EncoderCache:
    """Image embeddings by content hash, least recently used dropped past `max_tokens`
    rows. `num_encoded` / `num_hits` count items run through the encoder / found here."""

    def __init__(self, encode, max_tokens: int = DEFAULT_ENCODER_CACHE_TOKENS) -> None:
        self.encode = encode
        self.max_tokens = max_tokens
        self._embeds: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._num_tokens = 0
        self.num_encoded = 0
        self.num_hits = 0

    def get(self, items: list) -> list[torch.Tensor]:
        """Each item's embeddings; the missing ones encoded together, once per hash."""
        missing = {}
        for item in items:
            if item.content_hash in self._embeds:
                self._embeds.move_to_end(item.content_hash)
            else:
                missing.setdefault(item.content_hash, item)
        self.num_hits += len(items) - len(missing)
        found = {h: self._embeds[h] for h in {i.content_hash for i in items} - set(missing)}
        if missing:
            encoded = self.encode(list(missing.values()))
            self.num_encoded += len(missing)
            for content_hash, embeds in zip(missing, encoded):
                found[content_hash] = embeds
                self._put(content_hash, embeds)
        return [found[item.content_hash] for item in items]

    def stats(self) -> dict[str, int]:
        return {"encoder_num_encoded": self.num_encoded, "encoder_cache_hits": self.num_hits,
                "encoder_cache_items": len(self._embeds),
                "encoder_cache_tokens": self._num_tokens}

    def _put(self, content_hash: str, embeds: torch.Tensor) -> None:
        self._embeds[content_hash] = embeds
        self._num_tokens += len(embeds)
        while self._num_tokens > self.max_tokens and len(self._embeds) > 1:
            _, dropped = self._embeds.popitem(last=False)
            self._num_tokens -= len(dropped)


class MultimodalInputsBuilder:
    """Builds a step's StepMultimodal for a model with images (`model.encode`) and,
    when `model.uses_mrope`, M-RoPE positions."""

    def __init__(self, model, device: torch.device,
                 cache_tokens: int = DEFAULT_ENCODER_CACHE_TOKENS) -> None:
        self.cache = EncoderCache(model.encode, cache_tokens)
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.bidirectional_images = bool(getattr(model, "bidirectional_images", False))
        self.device = device

    def build(self, requests: list[Request], diff: StepDiff,
              arrays: StepArrays) -> StepMultimodal:
        mrope = None
        if self.uses_mrope:
            mrope = np.repeat(arrays.positions[None], 3, axis=0)
        spans, rows = [], []  # (item, first, end) slices the step needs, their rows
        starts = diff.num_computed
        for i, request in enumerate(requests):
            mm = request.multimodal
            if mm is None:
                continue
            start, end = int(starts[i]), int(starts[i] + diff.query_lens[i])
            first_row = int(arrays.query_start_loc[i])
            if mrope is not None and mm.mrope_positions is not None:
                _place_mrope(mrope, mm, start, end, first_row)
            for item in mm.items:
                lo, hi = max(start, item.offset), min(end, item.end)
                if lo < hi:
                    spans.append((item, lo - item.offset, hi - item.offset))
                    rows.append(np.arange(lo - start, hi - start) + first_row)
        if not spans:
            return StepMultimodal(np.zeros(0, np.int64), None, mrope)
        embeds = self.cache.get([item for item, _, _ in spans])
        pieces = [e[lo:hi] for e, (_, lo, hi) in zip(embeds, spans)]
        limits = None
        if self.bidirectional_images:  # up to the image's last token in this step
            limits = arrays.positions.astype(np.int64, copy=True)
            for (item, _, hi), span_rows in zip(spans, rows):
                limits[span_rows] = item.offset + hi - 1
        return StepMultimodal(np.concatenate(rows), torch.cat(pieces), mrope, limits)


def _place_mrope(mrope: np.ndarray, mm, start: int, end: int, first_row: int) -> None:
    """A request's M-RoPE positions in the step's columns: the prompt's own, and every
    later token's position shifted by the prompt's delta."""
    num_prompt = mm.mrope_positions.shape[1]
    prompt_end = min(end, num_prompt)
    if start < prompt_end:
        mrope[:, first_row:first_row + prompt_end - start] = mm.mrope_positions[:, start:prompt_end]
    later = max(start, num_prompt)
    if later < end:
        mrope[:, first_row + later - start:first_row + end - start] += mm.mrope_delta
