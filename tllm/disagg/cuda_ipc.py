"""CUDA IPC transport (two processes on one GPU host): the generation server opens the
context server's KV pool once through CUDA IPC handles, and a request's KV moves with one
device-to-device gather/scatter per layer when the request is admitted. The context server
frees its blocks once that copy has finished (an event recorded after it)."""
from __future__ import annotations

import pickle
import threading
from typing import Callable

import torch

from tllm.disagg.wire import recv_exact


class IpcImportedKV:
    """KV still in the context server's pool, copied over at admission."""

    def __init__(self, num_tokens: int, remote: list[tuple[torch.Tensor, torch.Tensor]],
                 block_ids: list[int], on_copied: Callable[[torch.cuda.Event], None]) -> None:
        self.num_tokens = num_tokens
        self.remote = remote
        self.block_ids = block_ids
        self._on_copied = on_copied
        self._is_pending = True

    @property
    def is_pending(self) -> bool:
        return self._is_pending

    def write_into(self, kv_cache, block_ids: list[int]) -> None:
        device = kv_cache.slot_caches[0][0].device
        src = torch.tensor(self.block_ids, dtype=torch.long, device=device)
        dst = torch.tensor(block_ids, dtype=torch.long, device=device)
        for (remote_k, remote_v), (k, v) in zip(self.remote, kv_cache.slot_caches):
            k.index_copy_(0, dst, remote_k.index_select(0, src))
            v.index_copy_(0, dst, remote_v.index_select(0, src))
        self._done()

    def discard(self) -> None:
        if self._is_pending:
            self._done()

    def _done(self) -> None:
        self._is_pending = False
        event = torch.cuda.Event()
        event.record()
        self._on_copied(event)


class IpcSources:
    """Context servers' pools opened through CUDA IPC, once per endpoint."""

    def __init__(self) -> None:
        self._opened: dict[tuple[str, bytes], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lock = threading.Lock()

    def imported(self, source, header: dict, sock, release_later) -> IpcImportedKV:
        handles = recv_exact(sock, int(header["nbytes"]))
        remote = self._open(source.endpoint, handles)
        return IpcImportedKV(int(header["num_tokens"]), remote, list(header["block_ids"]),
                             lambda event: release_later(source, event))

    def _open(self, endpoint: str, handles: bytes) -> list[tuple[torch.Tensor, torch.Tensor]]:
        key = (endpoint, handles)
        with self._lock:
            if key not in self._opened:
                self._opened = {k: v for k, v in self._opened.items() if k[0] != endpoint}
                self._opened[key] = [(fn(*args), gn(*gargs))
                                     for (fn, args), (gn, gargs) in pickle.loads(handles)]
            return self._opened[key]
