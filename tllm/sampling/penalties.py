"""Token counts for repetition, presence and frequency penalties, kept on the device: a row
per batch slot whose request uses a penalty (most use none, so rows are handed out from a
pool that grows as needed rather than one per slot at [slots, vocab]). A row is written
from the request's known tokens when it takes the slot; afterwards each step adds the
tokens it sampled, on the device, so the next step's penalties never wait for the host."""
from __future__ import annotations

import numpy as np
import torch

from tllm.request import Request


class PenaltyCounts:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.row_of = np.full(num_slots, -1, dtype=np.int64)
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._free_rows: list[int] = []

    def assign(self, slot: int, request: Request) -> None:
        """The slot's request uses penalties: its row, from the tokens the host knows (a
        request takes a slot only with none in flight)."""
        row = self._take_row()
        self.row_of[slot] = row
        self.output_counts[row].zero_()
        self.prompt_seen[row].zero_()
        prompt = _ids(request.prompt_token_ids, self.vocab_size, self.device)
        self.prompt_seen[row, prompt] = True
        outputs = _ids(request.output_token_ids, self.vocab_size, self.device)
        if len(outputs):
            self.output_counts[row].index_add_(
                0, outputs, torch.ones_like(outputs, dtype=torch.int32))

    def release(self, slot: int) -> None:
        row = int(self.row_of[slot])
        if row >= 0:
            self.row_of[slot] = -1
            self._free_rows.append(row)

    def counts(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts float32, seen in prompt or output bool), [len(slots), vocab]; rows
        without penalties are zero (their penalty parameters leave them alone anyway)."""
        rows = self.row_of[slots]
        has_row = rows >= 0
        index = torch.from_numpy(np.where(has_row, rows, 0)).to(self.device, non_blocking=True)
        keep = torch.from_numpy(has_row).to(self.device, non_blocking=True)[:, None]
        counts = self.output_counts.index_select(0, index).float() * keep
        seen = (self.prompt_seen.index_select(0, index) | (counts > 0)) & keep
        return counts, seen

    def add(self, slots: np.ndarray, token_ids: torch.Tensor) -> None:
        """Count the tokens just sampled for these slots (those with a row)."""
        rows = self.row_of[slots]
        picked = np.flatnonzero(rows >= 0)
        if not len(picked):
            return
        index = torch.from_numpy(np.stack([rows[picked], picked])).to(self.device,
                                                                     non_blocking=True)
        tokens = token_ids[index[1]]
        self.output_counts.index_put_((index[0], tokens),
                                      torch.ones_like(tokens, dtype=torch.int32),
                                      accumulate=True)

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.output_counts.shape[0]
            new = max(8, 2 * old)
            self.output_counts = _grown(self.output_counts, new)
            self.prompt_seen = _grown(self.prompt_seen, new)
            self._free_rows = list(range(new - 1, old - 1, -1))
        return self._free_rows.pop()


def _grown(table: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros(rows, table.shape[1], dtype=table.dtype, device=table.device)
    out[:table.shape[0]] = table
    return out


def _ids(token_ids: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    ids = torch.tensor([t for t in token_ids if 0 <= t < vocab_size], dtype=torch.long)
    return ids.to(device, non_blocking=True)
