"""Draft-target speculation (DraftTargetDecodingConfig): a second, smaller model with its own
paged KV cache proposes k tokens per request, greedily or by sampling from its own
distribution (whose probabilities go to rejection sampling).

The draft's KV cache is a KVCacheManager of its own (the resource-manager interface the
target's cache has), driven through a `DraftSequence` per request: the drafter's count of
the request's positions the draft cache holds. Each `propose` first catches up on the tokens
the target accepted since the last one (drafts it fed that the target kept are reused), then
runs k - 1 one-token steps.

A layer-skip draft (`speculative_model="self:layers=N"`) is the target's own model cut to its
first N layers: the same modules (no weight copy), its own KV cache of N layers."""
from __future__ import annotations

import copy
import itertools
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from tllm import loader
from tllm.attention.interface import AttentionBackend, AttentionMetadata
from tllm.kv_cache.manager import KVCacheManager
from tllm.request import Request
from tllm.scheduler.interface import ScheduledBatch
from tllm.speculative.interface import Drafter, Drafts

logger = logging.getLogger(__name__)
LAYER_SKIP_PREFIX = "self:layers="


# ---- building the draft model ----

def layer_skip_layers(speculative_model: str) -> int | None:
    """N of `self:layers=N` (the target cut to its first N layers), else None."""
    if not speculative_model.startswith(LAYER_SKIP_PREFIX):
        return None
    value = speculative_model.removeprefix(LAYER_SKIP_PREFIX)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"speculative_model: expected 'self:layers=N' with N >= 1, got "
                         f"{speculative_model!r}")
    return int(value)


def first_layers_model(target: nn.Module, num_layers: int) -> nn.Module:
    """The target model running only its first `num_layers` layers, then its final norm and
    LM head: a shallow copy sharing every module, with its own layer range."""
    stage_layers = getattr(target, "stage_layers", None)
    if stage_layers is None or not hasattr(target, "kv_cache_spec"):
        raise ValueError(f"speculative_model 'self:layers=N': {type(target).__name__} cannot "
                         "run cut to its first layers (tllm's own model files only)")
    total = target.config.num_hidden_layers
    if not (target.is_first_stage and target.is_last_stage):
        raise ValueError("speculative_model 'self:layers=N' does not run under pipeline "
                         "parallelism")
    if not 1 <= num_layers < total:
        raise ValueError(f"speculative_model 'self:layers={num_layers}': N must be in "
                         f"1..{total - 1} (the target has {total} layers)")
    draft = copy.copy(target)  # shares _modules; only the plain attribute below differs
    draft.stage_layers = range(num_layers)
    return draft


def attention_backend_of(model: nn.Module) -> type[AttentionBackend]:
    """The attention backend class the target runs (the draft runs the same)."""
    for module in model.modules():
        backend = getattr(module, "attn", None)
        if isinstance(backend, AttentionBackend):
            return type(backend)
    raise ValueError(f"{type(model).__name__} has no tllm attention backend to share")


def load_draft_model(speculative_model: str, target_parts) -> nn.Module:
    """The draft model of a checkpoint, .gguf or dummy:<preset> (built and loaded as the
    target is, in its dtype and attention backend), or the layer-skip cut of the target.
    Refuses a draft whose tokenizer is not the target's."""
    num_layers = layer_skip_layers(speculative_model)
    if num_layers is not None:
        return first_layers_model(target_parts.model, num_layers)
    source = loader.resolve_model(speculative_model)
    config, checkpoint = loader.load_config(source)
    check_same_tokenizer(target_parts, source, config, speculative_model)
    quant = loader.quant_config(source, config, None)
    model = loader.build_model(config, attention_backend_of(target_parts.model),
                               target_parts.dtype, target_parts.device,
                               target_parts.max_seq_len + 64, quant, "tllm")
    loader.load_weights(model, source, checkpoint, seed=1)
    return model


def check_same_tokenizer(target_parts, draft_source, draft_config, name: str) -> None:
    """The draft must tokenize as the target does: the same vocabulary (ids and strings)
    when both ship a tokenizer, else at least the same vocabulary size."""
    target_vocab = target_parts.config.vocab_size
    draft_vocab = draft_config.vocab_size
    target_tok = loader.load_tokenizer(target_parts.source)
    draft_tok = loader.load_tokenizer(draft_source)
    if target_tok is not None and draft_tok is not None:
        if target_tok.hf.get_vocab() != draft_tok.hf.get_vocab():
            raise ValueError(f"speculative_model {name!r}: its tokenizer differs from the "
                             f"target's ({draft_tok.vocab_size} vs {target_tok.vocab_size} "
                             "tokens, or the same ids mean other strings); a draft model "
                             "must share the target's tokenizer")
    elif draft_vocab != target_vocab:
        raise ValueError(f"speculative_model {name!r}: vocabulary of {draft_vocab} tokens, "
                         f"the target has {target_vocab}; a draft model must share the "
                         "target's tokenizer")


def draft_kv_cache(model: nn.Module, target_kv: KVCacheManager, device: torch.device,
                   dtype: torch.dtype) -> KVCacheManager:
    """The draft's own paged cache: as many tokens as the target's (so it never runs out
    first), one group of full layers (a window layer masks; its blocks are kept), no prefix
    reuse (its blocks are not the target's), no reservations."""
    spec = model.kv_cache_spec
    return KVCacheManager(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                          head_dim=spec.head_dim, num_blocks=target_kv.num_blocks,
                          tokens_per_block=target_kv.tokens_per_block, dtype=dtype,
                          device=device, enable_block_reuse=False,
                          reserve_full_generation=False, keys_only=spec.keys_only)


# ---- running it ----

@dataclass(eq=False)
class DraftSequence:
    """A request as the draft KV cache sees it: `num_computed_tokens` of its positions hold
    draft keys and values (the drafter's count, not the target's); `fed_from` and `fed` are
    the position and tokens of the drafts fed last time (kept when the target accepts them)."""

    request: Request
    num_computed_tokens: int = 0
    fed_from: int = 0
    fed: list[int] = field(default_factory=list)
    admitted: bool = False         # the draft KV cache holds a block table for it
    draft_token_ids: tuple = ()    # the KV manager's window bookkeeping: no drafts here
    kv_import: None = None         # nor KV imported from a prefill server
    error: Exception | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def max_new_tokens(self) -> int:
        return self.request.max_new_tokens

    @property
    def cache_salt(self) -> str | None:
        return self.request.cache_salt

    wants_prompt_logprobs = False

    def valid_positions(self) -> int:
        """Positions whose draft KV still matches the request's tokens (fed drafts the
        target rejected do not), leaving the last known token to feed."""
        tokens = self.request.token_ids
        kept = sum(1 for _ in itertools.takewhile(
            lambda pair: pair[0] == pair[1], zip(self.fed, tokens[self.fed_from:])))
        valid = min(self.num_computed_tokens, self.fed_from + kept) if self.fed else \
            self.num_computed_tokens
        return min(valid, len(tokens) - 1)


def paged_metadata(tables: list[list[int]], starts: list[int], ends: list[int],
                   tokens_per_block: int, device: torch.device) -> AttentionMetadata:
    """Metadata of one forward where sequence i computes positions starts[i]..ends[i] - 1
    over its block table (the model runner's layout, for a drafter's own cache)."""
    bs = tokens_per_block
    positions = [p for s, e in zip(starts, ends) for p in range(s, e)]
    slots = [t[p // bs] * bs + p % bs for t, s, e in zip(tables, starts, ends)
             for p in range(s, e)]
    query_lens = [e - s for s, e in zip(starts, ends)]
    width = max(len(t) for t in tables)

    def to_device(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return AttentionMetadata(
        positions=to_device(positions, torch.long), slot_mapping=to_device(slots, torch.long),
        query_start_loc=to_device([0, *itertools.accumulate(query_lens)], torch.int32),
        seq_lens=to_device(ends, torch.int32),
        block_tables=to_device([t + [0] * (width - len(t)) for t in tables], torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(ends), tokens_per_block=bs,
        query_lens_cpu=query_lens, seq_lens_cpu=list(ends))


class DraftCache:
    """The draft KV cache's per-request sequences: room for a forward, then its metadata."""

    def __init__(self, kv_cache: KVCacheManager, device: torch.device) -> None:
        self.kv_cache = kv_cache
        self.device = device
        self.sequences: dict[str, DraftSequence] = {}

    def sequence(self, request: Request) -> DraftSequence:
        seq = self.sequences.get(request.request_id)
        if seq is None or seq.request is not request:
            if seq is not None:
                self.kv_cache.free(seq)
            seq = self.sequences[request.request_id] = DraftSequence(request)
        return seq

    def reserve(self, seq: DraftSequence, end: int) -> bool:
        """Blocks for positions up to `end`; False when the draft cache has no room (the
        request then goes without drafts this step)."""
        kv = self.kv_cache
        if not seq.admitted:
            if kv.try_admit(seq) is None:
                return False
            seq.admitted = True
        if not kv.try_grow(seq, end - seq.num_computed_tokens):
            return False
        kv.prepare(ScheduledBatch([seq], [end - seq.num_computed_tokens]))
        return True

    def metadata(self, seqs: list[DraftSequence], starts: list[int],
                 ends: list[int]) -> AttentionMetadata:
        tables = [self.kv_cache.block_ids(s) for s in seqs]
        return paged_metadata(tables, starts, ends, self.kv_cache.tokens_per_block,
                              self.device)

    def free(self, request: Request) -> None:
        seq = self.sequences.pop(request.request_id, None)
        if seq is not None:
            self.kv_cache.free(seq)


def choose_tokens(logits: torch.Tensor, requests: list[Request], vocab_size: int,
                  generators: list[torch.Generator | None]
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N, V'] draft logits -> (token ids [N], probs [N, vocab_size] or None when every
    request is greedy): argmax for greedy requests, else a sample from softmax(logits / T)
    (that distribution is the one rejection sampling must be given)."""
    logits = fit_vocab(logits.float(), vocab_size)
    greedy = [r.sampling_params.is_greedy for r in requests]
    tokens = logits.argmax(dim=-1)
    if all(greedy):
        return tokens, None
    temps = torch.tensor([1.0 if g else r.sampling_params.temperature
                          for g, r in zip(greedy, requests)], device=logits.device)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    for i, (is_greedy, gen) in enumerate(zip(greedy, generators)):
        if is_greedy:
            probs[i] = 0.0
            probs[i, tokens[i]] = 1.0
        else:
            tokens[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
    return tokens, probs


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over exactly the target's vocabulary (a draft's padded rows cut off)."""
    if logits.shape[-1] >= vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def stack_drafts(drafts: list[list[int]], probs: list[list[torch.Tensor]],
                 vocab_size: int, device: torch.device) -> Drafts:
    """Per-request drafts (and their per-position probs, when some request sampled)."""
    if not any(p is not None for row in probs for p in row):
        return Drafts(drafts)
    k = max(len(d) for d in drafts)
    out = torch.zeros(len(drafts), max(k, 1), vocab_size, device=device)
    for i, (tokens, rows) in enumerate(zip(drafts, probs)):
        for j, (token, p) in enumerate(zip(tokens, rows)):
            if p is None:
                out[i, j, token] = 1.0
            else:
                out[i, j] = p
    return Drafts(drafts, out)


class DraftModelDrafter(Drafter):
    """Proposes with a second model (or the target cut to its first layers) over its own
    paged KV cache."""

    def __init__(self, model: nn.Module, kv_cache: KVCacheManager, max_draft_len: int,
                 vocab_size: int, device: torch.device) -> None:
        super().__init__(max_draft_len)
        self.model = model
        self.cache = DraftCache(kv_cache, device)
        self.vocab_size = vocab_size
        self.device = device
        self._generators: dict[str, torch.Generator | None] = {}

    @property
    def kv_cache(self) -> KVCacheManager:
        return self.cache.kv_cache

    def own_module(self) -> nn.Module:
        """(A layer-skip draft's modules are the target's; a separate draft model is left
        as it is by the target's new weights.)"""
        return self.model

    @torch.inference_mode()
    def propose(self, requests: list[Request], max_draft_lens: list[int]) -> Drafts:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor | None]] = [[] for _ in requests]
        lens = [min(k, self.max_draft_len) for k in max_draft_lens]
        seqs = [self.cache.sequence(r) for r in requests]
        active = []
        for i, (seq, k) in enumerate(zip(seqs, lens)):
            seq.num_computed_tokens = seq.valid_positions()
            seq.fed_from, seq.fed = seq.num_tokens, []
            if self.cache.reserve(seq, seq.num_tokens + k - 1):
                active.append(i)
        feeds = {i: seqs[i].token_ids[seqs[i].num_computed_tokens:] for i in active}
        while active:
            tokens, step_probs = self._step([seqs[i] for i in active],
                                            [feeds[i] for i in active])
            for row, i in enumerate(active):
                drafts[i].append(int(tokens[row]))
                probs[i].append(None if step_probs is None else step_probs[row])
            active = [i for i in active if len(drafts[i]) < lens[i]]
            for i in active:
                feeds[i] = [drafts[i][-1]]
                seqs[i].fed.append(drafts[i][-1])
        return stack_drafts(drafts, probs, self.vocab_size, self.device)

    def _step(self, seqs: list[DraftSequence], feeds: list[list[int]]):
        """One draft forward: each sequence computes its `feeds` after what it holds; the
        next token of each from the logits of its last fed position."""
        starts = [s.num_computed_tokens for s in seqs]
        ends = [s + len(f) for s, f in zip(starts, feeds)]
        metadata = self.cache.metadata(seqs, starts, ends)
        ids = torch.tensor([t for f in feeds for t in f], dtype=torch.long,
                           device=self.device)
        hidden = self.model(ids, self.kv_cache.kv_caches, metadata)
        last = torch.tensor(list(itertools.accumulate(len(f) for f in feeds)),
                            device=self.device) - 1
        logits = self.model.compute_logits(hidden[last])
        for seq, end in zip(seqs, ends):
            seq.num_computed_tokens = end
        requests = [s.request for s in seqs]
        return choose_tokens(logits, requests, self.vocab_size,
                             [self._generator(r) for r in requests])

    def _generator(self, request: Request) -> torch.Generator | None:
        """The drafter's own stream per seeded request (the target's stays untouched)."""
        if request.request_id not in self._generators:
            seed = request.sampling_params.seed
            gen = None
            if seed is not None:
                gen = torch.Generator(self.device).manual_seed(seed + 0x5EED)
            self._generators[request.request_id] = gen
        return self._generators[request.request_id]

    def free(self, request: Request) -> None:
        self.cache.free(request)
        self._generators.pop(request.request_id, None)


def build_drafter(config, target_parts) -> DraftModelDrafter:
    """The drafter of a DraftTargetDecodingConfig, next to the target's RankParts."""
    model = load_draft_model(config.speculative_model, target_parts)
    kv = draft_kv_cache(model, target_parts.kv_cache, target_parts.device,
                        target_parts.dtype)
    logger.info("draft model %s: %d layers, KV cache of %d blocks",
                config.speculative_model, len(model.stage_layers), kv.num_blocks)
    return DraftModelDrafter(model, kv, config.max_draft_len, target_parts.config.vocab_size,
                             target_parts.device)
