"""The runner's persistent batch: a slot per live request, with the block tables of every
slot kept in preallocated arrays and changed by diff (vLLM v1's persistent batch, in our
terms). A step's attention inputs (token positions, KV slots, padded block tables, where
each request's queries start) are a few array operations over the scheduled slots, not a
loop over tokens.

Every rank keeps one. Rank 0 turns each ScheduledBatch into a `StepDiff` (which slots run
how many tokens from where, and which block-table entries changed: `SlotAssigner`); every
rank, rank 0 included, applies that diff to its own `BatchTables` and builds the same
arrays from it, so what crosses process boundaries is the diff, never whole tables."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tllm.kv_cache.block_table import cdiv
from tllm.request import Request
from tllm.scheduler.interface import ResourceManager


@dataclass
class TableWrite:
    """Entries `start:` of one slot's table of one KV cache group become `blocks` (the row
    then ends there: a shorter table is a truncated one)."""
    slot: int
    group: int
    start: int
    blocks: list[int]


@dataclass
class StepDiff:
    """What one step runs, by slot: the scheduled requests' slots in batch order, how many
    tokens each had computed before the step and computes in it, and the block-table
    entries that changed since the previous step."""
    slots: np.ndarray          # [B] int64
    num_computed: np.ndarray   # [B] int64
    query_lens: np.ndarray     # [B] int64
    table_writes: list[TableWrite] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())


@dataclass
class StepArrays:
    """A step's attention inputs as host arrays (int64), built from its StepDiff."""
    positions: np.ndarray        # [T]
    slot_mapping: np.ndarray     # [T] group 0's KV slots
    query_start_loc: np.ndarray  # [B + 1]
    seq_lens: np.ndarray         # [B]
    block_tables: np.ndarray     # [B, width] group 0's
    group_slot_mappings: list[np.ndarray]   # groups 1..
    group_block_tables: list[np.ndarray]
    token_seqs: np.ndarray       # [T] the index in the batch of each token's request
    request_slots: np.ndarray | None = None  # [B] each request's batch slot

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.query_start_loc).max()) if len(self.seq_lens) else 0


class BatchTables:
    """Every slot's block table of every KV cache group, [groups, slots, max_blocks] int64,
    each row zero past its length (the padding attention kernels read as block 0)."""

    def __init__(self, num_slots: int, max_blocks: int, num_groups: int,
                 tokens_per_block: int) -> None:
        self.tables = np.zeros((num_groups, num_slots, max_blocks), dtype=np.int64)
        self.lengths = np.zeros((num_groups, num_slots), dtype=np.int64)
        self.tokens_per_block = tokens_per_block

    @property
    def num_groups(self) -> int:
        return self.tables.shape[0]

    def apply(self, writes: list[TableWrite]) -> None:
        for w in writes:
            end = w.start + len(w.blocks)
            if end > self.tables.shape[2]:
                raise ValueError(f"a block table of {end} blocks is longer than the "
                                 f"{self.tables.shape[2]} the batch was sized for")
            row = self.tables[w.group, w.slot]
            old = int(self.lengths[w.group, w.slot])
            row[w.start:end] = w.blocks
            if old > end:
                row[end:old] = 0
            self.lengths[w.group, w.slot] = end

    def build(self, diff: StepDiff) -> StepArrays:
        """The step's positions, KV slots and tables, vectorized over its tokens."""
        bs = self.tokens_per_block
        query_lens, starts = diff.query_lens, diff.num_computed
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        token_seqs = np.repeat(np.arange(len(query_lens)), query_lens)
        positions = np.arange(num_tokens) + np.repeat(starts - query_start_loc[:-1], query_lens)
        seq_lens = starts + query_lens
        width = cdiv(int(seq_lens.max()), bs) if len(seq_lens) else 0
        token_slots = diff.slots[token_seqs]
        block_index, offset = np.divmod(positions, bs)
        slot_mappings, tables = [], []
        for group in self.tables:
            slot_mappings.append(group[token_slots, block_index] * bs + offset)
            tables.append(group[diff.slots, :width])
        return StepArrays(positions, slot_mappings[0], query_start_loc, seq_lens, tables[0],
                          slot_mappings[1:], tables[1:], token_seqs, diff.slots)


class SlotAssigner(ResourceManager):
    """Rank 0's side: which slot each live request holds, and the StepDiff of a batch. A
    request takes a slot when it is first scheduled and gives it back when it ends or is
    preempted; its table rows are then rewritten whole, and afterwards only where the KV
    cache manager reports a change (`take_table_changes`)."""

    def __init__(self, num_slots: int, kv_cache) -> None:
        self.kv_cache = kv_cache
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[str, int] = {}
        # per slot: whether its request asked for prompt logprobs (rare: a step looks here
        # rather than at every request)
        self.wants_prompt_logprobs = np.zeros(num_slots, dtype=bool)
        # per slot: whether its request pools instead of sampling (as rare here)
        self.is_pooling = np.zeros(num_slots, dtype=bool)
        # told when a request takes a slot and when it gives it back (the sampler keeps
        # each slot's parameters): assign_slot(slot, request), release_slot(slot, request)
        self.listeners: list = []

    def slot_of(self, request: Request) -> int:
        return self._slot_of[request.request_id]

    def slots_of(self, requests: list[Request]) -> list[int]:
        slot_of = self._slot_of
        return [slot_of[r.request_id] for r in requests]

    def diff(self, requests: list[Request], num_scheduled: list[int],
             num_computed: np.ndarray) -> StepDiff:
        """The batch as slots; new requests take slots, changed tables become writes."""
        changes = self.kv_cache.take_table_changes()
        slot_of = self._slot_of
        slots = [slot_of.get(r.request_id, -1) for r in requests]
        if -1 in slots:
            for i, request in enumerate(requests):
                if slots[i] < 0:
                    slots[i] = self._assign(request)
                    changes[request.request_id] = 0
        writes: list[TableWrite] = []
        for request_id, first in changes.items():
            slot = slot_of.get(request_id)
            if slot is None:   # not running yet: written whole when it first runs
                continue
            for group, blocks in enumerate(self.kv_cache.group_block_ids_of(request_id)):
                first = min(first, len(blocks))
                writes.append(TableWrite(slot, group, first, blocks[first:]))
        return StepDiff(np.array(slots, dtype=np.int64), num_computed,
                        np.array(num_scheduled, dtype=np.int64), writes)

    def _assign(self, request: Request) -> int:
        slot = self._slot_of[request.request_id] = self._take_slot()
        self.wants_prompt_logprobs[slot] = request.wants_prompt_logprobs
        self.is_pooling[slot] = request.pooling_params is not None
        for listener in self.listeners:
            listener.assign_slot(slot, request)
        return slot

    def release(self, request: Request) -> None:
        """The request stops running (ended or preempted): its slot is free again."""
        slot = self._slot_of.pop(request.request_id, None)
        if slot is not None:
            self._free.append(slot)
            for listener in self.listeners:
                listener.release_slot(slot, request)

    def free(self, request: Request) -> None:
        self.release(request)

    def _take_slot(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} batch slots are taken")
        return self._free.pop()
