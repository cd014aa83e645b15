"""An admitted request's block tables and what admitting it decided: the KV cache manager's
own records, shared with the parts mixed into it (beam search's block sharing,
disaggregated serving's KV import and export)."""
from __future__ import annotations

from dataclasses import dataclass, field


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class BlockTable:
    """One admitted request's blocks: a table per KV cache group, all of one length (the
    tokens they cover); a window group's first `num_null` entries are the null block."""
    groups: list[list[int]]
    num_null: list[int]
    block_hashes: list[int] = field(default_factory=list)  # of its first published blocks
    reserved: int = 0      # blocks promised to it and not allocated yet
    num_pending: int = 0   # blocks per group this step's prepare() allocates
    copy_index: int | None = None  # a shared block prepare() copies before it is written
    # a block index known to be this table's alone (no copy needed to write it): a block
    # gains holders only when full (prefix reuse) or forked, which resets this
    exclusive_index: int = -1

    def num_live(self, group: int) -> int:
        return len(self.groups[group]) - self.num_null[group]


@dataclass(frozen=True)
class Admission:
    """What admitting a request decided: how many of its tokens already have their keys and
    values in the blocks it now holds (a cached prefix, or what it had before a swap)."""
    num_computed_tokens: int
