"""A step's host arrays on the device in one copy: they are packed into a pinned staging
buffer and sent together (each small `torch.tensor(...).to(device)` is a copy and an
allocation of its own, ~10 us apiece at every step). Staging buffers are used in turn and
reused only once their copy has finished, so the host can pack step N+1 while step N's
copy is still queued. On a CPU the arrays are used where they are."""
from __future__ import annotations

import numpy as np
import torch

_NUM_BUFFERS = 3  # steps whose copies may be queued at once (two in flight, one packing)


class Uploader:
    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self._np_dtype = torch.empty((), dtype=dtype).numpy().dtype
        self._buffers: list[torch.Tensor | None] = [None] * _NUM_BUFFERS
        self._events: list[torch.cuda.Event | None] = [None] * _NUM_BUFFERS
        self._turn = 0

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors with the arrays' shapes and this uploader's dtype."""
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=self._np_dtype))
                    for a in arrays]
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        staging = self._staging(max(total, 1))
        host = staging.numpy()
        offset = 0
        for a, n in zip(arrays, sizes):
            host[offset:offset + n] = a.reshape(-1)
            offset += n
        device = torch.empty(max(total, 1), dtype=self.dtype, device=self.device)
        device.copy_(staging[:max(total, 1)], non_blocking=True)
        self._events[self._turn].record()
        out, offset = [], 0
        for a, n in zip(arrays, sizes):
            out.append(device[offset:offset + n].view(a.shape))
            offset += n
        return out

    def _staging(self, size: int) -> torch.Tensor:
        """The next staging buffer, once its previous copy has finished; grown as needed."""
        self._turn = (self._turn + 1) % _NUM_BUFFERS
        event = self._events[self._turn]
        if event is None:
            event = self._events[self._turn] = torch.cuda.Event()
        else:
            event.synchronize()
        buffer = self._buffers[self._turn]
        if buffer is None or buffer.numel() < size:
            capacity = max(size, 2 * (buffer.numel() if buffer is not None else 4096))
            buffer = torch.empty(capacity, dtype=self.dtype, pin_memory=True)
            self._buffers[self._turn] = buffer
        return buffer
