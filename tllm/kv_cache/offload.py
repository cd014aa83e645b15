"""Secondary tiers for KV blocks evicted from the device: host memory, then disk.

A block's contents (all layers, keys and values) are stored under the block's chained hash,
so a later request with the same prefix can bring them back instead of recomputing them.
Both tiers are LRU; the host tier spills its oldest entries to disk when one is configured.
"""
from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch


class DiskBlockStore:
    """Block contents as files in a private subdirectory of `root` (removed on close)."""

    def __init__(self, root: str | Path, capacity_blocks: int) -> None:
        Path(root).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="tllm-kv-", dir=root))
        self.capacity_blocks = capacity_blocks
        self._entries: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash & 0xFFFFFFFFFFFFFFFF:016x}.pt"

    def put(self, block_hash: int, data: torch.Tensor) -> None:
        if self.capacity_blocks < 1:
            return
        while len(self._entries) >= self.capacity_blocks:
            old, _ = self._entries.popitem(last=False)
            self._path(old).unlink(missing_ok=True)
        torch.save(data, self._path(block_hash))
        self._entries[block_hash] = None

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def get(self, block_hash: int) -> torch.Tensor | None:
        if block_hash not in self._entries:
            return None
        self._entries.move_to_end(block_hash)
        return torch.load(self._path(block_hash), weights_only=True)

    def clear(self) -> None:
        for block_hash in self._entries:
            self._path(block_hash).unlink(missing_ok=True)
        self._entries.clear()

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class HostBlockStore:
    """Block contents in host memory (pinned when the cache lives on CUDA)."""

    def __init__(self, capacity_blocks: int, pin: bool,
                 next_tier: DiskBlockStore | None = None) -> None:
        self.capacity_blocks = capacity_blocks
        self.pin = pin
        self.next_tier = next_tier
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries or (self.next_tier is not None
                                              and block_hash in self.next_tier)

    def put(self, block_hash: int, device_data: torch.Tensor) -> None:
        if block_hash in self._entries:
            return
        if self.capacity_blocks < 1:  # no host tier of its own: straight to disk
            if self.next_tier is not None:
                self.next_tier.put(block_hash, device_data.to("cpu"))
            return
        while len(self._entries) >= self.capacity_blocks:
            old_hash, old_data = self._entries.popitem(last=False)
            if self.next_tier is not None:
                self.next_tier.put(old_hash, old_data)
        host = torch.empty(device_data.shape, dtype=device_data.dtype, pin_memory=self.pin)
        host.copy_(device_data, non_blocking=self.pin)
        self._entries[block_hash] = host

    def get(self, block_hash: int) -> tuple[torch.Tensor, str] | None:
        """(contents, tier name) or None."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return self._entries[block_hash], "host"
        if self.next_tier is not None:
            data = self.next_tier.get(block_hash)
            if data is not None:
                return data, "disk"
        return None

    def clear(self) -> None:
        """Forget every block, on disk too (the files are removed)."""
        self._entries.clear()
        if self.next_tier is not None:
            self.next_tier.clear()

    def close(self) -> None:
        self._entries.clear()
        if self.next_tier is not None:
            self.next_tier.close()
