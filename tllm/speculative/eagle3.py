"""EAGLE-3 drafting (EagleDecodingConfig): a one-layer head (tllm.models.eagle3) over its own
paged KV cache drafts from the target's hidden states of three layers.

Draft position p reads the token after p and the target's fused hidden state of p, and
predicts the token after that; so once the target has verified tokens t_0..t_{m-1}, the head
catches up on positions up to m - 2 (their target hidden states came with `on_verified`),
whose last output is draft 1; draft j + 1 then comes from feeding draft j with the head's
own pre-norm hidden state of the step before (EAGLE's chain). Only catch-up positions (made
from the target's states) stay in the draft cache; a chain's positions are recomputed."""
from __future__ import annotations

import logging

import torch

from tllm.layers.linear import process_loaded_weights
from tllm.loader import hf
from tllm.loader.hf import CheckpointError
from tllm.loader.weight_update import update_model_weights
from tllm.models.eagle3 import Eagle3LlamaHead, captured_target_layers
from tllm.request import Request
from tllm.speculative.draft_model import (DraftCache, DraftSequence, attention_backend_of,
                                          choose_tokens, draft_kv_cache, stack_drafts)
from tllm.speculative.head_graphs import build_head_graphs
from tllm.speculative.interface import Drafter, Drafts, VerifyResult

logger = logging.getLogger(__name__)


class _FusedStates:
    """A request's fused target hidden states for the positions from `start` on that the
    head has not consumed yet."""

    def __init__(self, start: int, rows: torch.Tensor) -> None:
        self.start, self.rows = start, rows

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]


class Eagle3Drafter(Drafter):
    """Proposes with an EAGLE-3 head; `hidden_state_layers` are the target layers it fuses."""

    def __init__(self, head: Eagle3LlamaHead, kv_cache, max_draft_len: int,
                 layers: tuple[int, ...], vocab_size: int, device: torch.device) -> None:
        super().__init__(max_draft_len)
        self.head = head
        self.cache = DraftCache(kv_cache, device)
        self.layers = layers
        self.vocab_size = vocab_size
        self.device = device
        self._states: dict[str, _FusedStates] = {}
        # the head's CUDA graphs (tllm.speculative.head_graphs), where the target has some
        self.graphs = None

    @property
    def hidden_state_layers(self) -> tuple[int, ...]:
        return self.layers

    @property
    def kv_cache(self):
        return self.cache.kv_cache

    def own_module(self) -> torch.nn.Module:
        """(The embedding, and MTP's final norm, are the target's: its new weights are
        seen here at once.)"""
        return self.head

    def takes_target_weight(self, name: str) -> bool:
        takes = getattr(self.head, "takes_checkpoint_weight", None)   # MTP's module
        return takes is not None and takes(name)

    def update_weights(self, tensors: list[tuple[str, torch.Tensor]],
                       dtype: torch.dtype) -> None:
        update_model_weights(self.head, tensors, dtype)

    @torch.inference_mode()
    def on_verified(self, result: VerifyResult) -> None:
        """Keep the fused states of the positions whose inputs the target has now confirmed
        (a verify step's rejected drafts' rows are dropped)."""
        if result.hidden_states is None:
            return
        for i, request in enumerate(result.requests):
            if request.is_finished:  # freed already
                continue
            first, start = result.first_positions[i], result.row_starts[i]
            num_valid = min(result.num_scheduled[i], request.num_tokens - 1 - first)
            if num_valid <= 0:
                continue
            rows = self.head.fuse(result.hidden_states[start:start + num_valid])
            self._add_states(self.cache.sequence(request), first, rows)

    def _add_states(self, seq: DraftSequence, first: int, rows: torch.Tensor) -> None:
        """Positions `first`.. get `rows`; a recompute from earlier (preemption) rolls the
        head's cache back; a gap (a prefix the target took from its cache) is filled with
        zero states, so the head attends to its embeddings alone there."""
        states = self._states.get(seq.request_id)
        seq.num_computed_tokens = min(seq.num_computed_tokens, first)
        if states is None or states.end < seq.num_computed_tokens:
            states = _FusedStates(seq.num_computed_tokens, rows[:0])
        keep = states.rows[:max(0, min(first, states.end) - states.start)]
        gap = rows.new_zeros(max(0, first - states.start - keep.shape[0]), rows.shape[1])
        start = min(states.start, seq.num_computed_tokens)
        self._states[seq.request_id] = _FusedStates(start, torch.cat([keep, gap, rows]))

    @torch.inference_mode()
    def propose(self, requests: list[Request], max_draft_lens: list[int]) -> Drafts:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor | None]] = [[] for _ in requests]
        lens = [min(k, self.max_draft_len) for k in max_draft_lens]
        seqs = [self.cache.sequence(r) for r in requests]
        feeds, hidden, caught_up = {}, {}, {}
        for i, (seq, k) in enumerate(zip(seqs, lens)):
            begin, end = seq.num_computed_tokens, seq.num_tokens - 1  # inputs confirmed
            states = self._states.get(seq.request_id)
            if (states is None or states.start != begin or states.end < end or end <= begin
                    or not self.cache.reserve(seq, end + k - 1)):
                continue
            feeds[i] = seq.token_ids[begin + 1:end + 1]
            hidden[i] = states.rows[:end - begin]
            states.start, states.rows = end, states.rows[end - begin:]
            caught_up[i] = end
        active = list(caught_up)
        while active:
            tokens, step_probs, last_hidden = self._step(
                [seqs[i] for i in active], [feeds[i] for i in active],
                [hidden[i] for i in active])
            for row, i in enumerate(active):
                drafts[i].append(int(tokens[row]))
                probs[i].append(None if step_probs is None else step_probs[row])
                hidden[i], feeds[i] = last_hidden[row:row + 1], [drafts[i][-1]]
            active = [i for i in active if len(drafts[i]) < lens[i]]
        for i, end in caught_up.items():  # the chain's positions are recomputed next time
            seqs[i].num_computed_tokens = end
        return stack_drafts(drafts, probs, self.vocab_size, self.device)

    def _step(self, seqs: list[DraftSequence], feeds: list[list[int]],
              hidden: list[torch.Tensor]):
        """One head forward: sequence i computes len(feeds[i]) positions after what its
        cache holds; the next draft of each from its last position, with that position's
        pre-norm state for the one after."""
        starts = [s.num_computed_tokens for s in seqs]
        ends = [s + len(f) for s, f in zip(starts, feeds)]
        metadata = self.cache.metadata(seqs, starts, ends)
        ids = torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=self.device)
        last = torch.cumsum(torch.tensor([len(f) for f in feeds], device=self.device), 0) - 1
        if self.graphs is not None and self.graphs.can_run(metadata):
            draft_logits, last_prenorm = self.graphs.run(ids, torch.cat(hidden), metadata, last)
        else:
            normed, prenorm = self.head(ids, torch.cat(hidden), self.kv_cache.kv_caches,
                                        metadata)
            draft_logits, last_prenorm = self.head.compute_logits(normed[last]), prenorm[last]
        logits = self.target_logits(draft_logits)
        for seq, end in zip(seqs, ends):
            seq.num_computed_tokens = end
        requests = [s.request for s in seqs]
        tokens, probs = choose_tokens(logits, requests, self.vocab_size, [None] * len(seqs))
        # (a replay's state is its graph's buffer: the next step's torch.cat copies it first)
        return tokens, probs, last_prenorm

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits placed at their target ids; -inf elsewhere (MTP's
        module predicts the target's own vocabulary: as they are)."""
        if getattr(self.head, "predicts_target_vocabulary", False):
            return draft_logits
        out = draft_logits.new_full((draft_logits.shape[0], self.vocab_size), float("-inf"))
        ids = torch.arange(draft_logits.shape[1], device=draft_logits.device)
        out[:, self.head.to_target_ids(ids)] = draft_logits
        return out

    def free(self, request: Request) -> None:
        self.cache.free(request)
        self._states.pop(request.request_id, None)


def load_head(path: str, target_parts) -> Eagle3LlamaHead:
    """An EAGLE-3 head from its checkpoint directory (config.json + safetensors), in the
    target's dtype, device and attention backend, sharing the target's embedding."""
    from pathlib import Path
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise CheckpointError(f"speculative_model {path!r}: expected an EAGLE-3 head "
                              "directory (config.json and safetensors)")
    config = hf.load_hf_config(directory)
    target = target_parts.config
    target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
    if config.vocab_size != target.vocab_size or target_hidden != target.hidden_size:
        raise ValueError(f"EAGLE-3 head {path}: built for a target of vocabulary "
                         f"{config.vocab_size} and hidden size {target_hidden}; this target "
                         f"has {target.vocab_size} and {target.hidden_size}")
    with torch.device(target_parts.device):
        head = Eagle3LlamaHead(config, attention_backend_of(target_parts.model),
                               target_parts.max_seq_len + 64)
    head = head.to(target_parts.dtype).eval()
    loaded = head.load_weights(hf.iter_safetensors(hf.safetensors_files(directory),
                                                   str(target_parts.device)))
    missing = head.expected_weights() - loaded
    if missing:
        names = sorted(m.split("#")[0] for m in missing)
        raise CheckpointError(f"EAGLE-3 head {path} lacks {len(names)} weights, e.g. "
                              f"{names[:3]}")
    process_loaded_weights(head)
    head.share_embedding(target_parts.model.embed_tokens)
    return head


def build_drafter(config, target_parts) -> Eagle3Drafter:
    """The drafter of an EagleDecodingConfig, next to the target's RankParts."""
    head = load_head(config.speculative_model, target_parts)
    layers = captured_target_layers(head.config, target_parts.config.num_hidden_layers,
                                    getattr(config, "eagle3_layers_to_capture", None))
    kv = draft_kv_cache(head, target_parts.kv_cache, target_parts.device, target_parts.dtype)
    drafter = Eagle3Drafter(head, kv, config.max_draft_len, layers,
                            target_parts.config.vocab_size, target_parts.device)
    drafter.graphs = build_head_graphs(head, kv, target_parts, config.max_draft_len,
                                       head.config.hidden_size)
    return drafter
