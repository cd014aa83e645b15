"""The generation server's side of KV transfer: before a generation-only request is
submitted, a transfer thread fetches its prompt's KV from the context server (over TCP into
host memory, bounded by a byte budget; or, with CUDA IPC, the source block ids only) while the
executor goes on computing; the request is submitted with it, and the KV is written into its
fresh blocks when it is admitted (KVCacheManager.try_admit).

If the fetch fails (the context server went away, the blocks expired, the prompt differs),
the request is submitted without it and computes its prompt itself: the same output, later."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from tllm.disagg.wire import (TransferError, connect, dtype_from_name, recv_header, recv_into,
                              send_message, tensor_bytes)
from tllm.kv_cache.manager import KVCacheManager
from tllm.request import Request
from tllm.scheduler.interface import ResourceManager

logger = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class KVSource:
    """Where a generation-only request's KV is: a context server's endpoint and export id."""

    endpoint: str
    export_id: str


@dataclass
class ImportStats:
    num_imported: int = 0
    num_failed: int = 0         # fetches that failed: the prompt was computed here instead
    bytes_received: int = 0
    transfer_seconds: float = 0.0


class ByteBudget:
    """Bytes of staged KV in host memory: acquire waits while the budget is spent (one
    request larger than the whole budget still runs, alone)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self._cond = threading.Condition()

    def acquire(self, num_bytes: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.in_use == 0
                                or self.in_use + num_bytes <= self.capacity)
            self.in_use += num_bytes

    def release(self, num_bytes: int) -> None:
        with self._cond:
            self.in_use -= num_bytes
            self._cond.notify_all()


class StagedKV:
    """KV fetched over TCP, in host memory until admission (then written and dropped)."""

    def __init__(self, num_tokens: int, data: torch.Tensor, on_done: Callable[[], None]) -> None:
        self.num_tokens = num_tokens
        self.data: torch.Tensor | None = data
        self._on_done = on_done

    @property
    def is_pending(self) -> bool:
        return self.data is not None

    def write_into(self, kv_cache: KVCacheManager, block_ids: list[int]) -> None:
        kv_cache.write_blocks(block_ids, self.data)
        self.discard()

    def discard(self) -> None:
        if self.data is not None:
            self.data = None
            self._on_done()


class KVImporter(ResourceManager):
    """Fetches generation-only requests' KV on transfer threads, then submits them."""

    def __init__(self, kv_cache: KVCacheManager, submit: Callable[[Request], None],
                 abort: Callable[[str], None], transport: str, max_staging_bytes: int,
                 num_threads: int = 4) -> None:
        self.kv_cache = kv_cache
        self._submit = submit
        self._abort = abort
        self.transport = transport
        self.budget = ByteBudget(max_staging_bytes)
        self.stats = ImportStats()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tllm-kv-import")
        self._fetching: dict[str, bool] = {}    # request id -> aborted meanwhile
        self._lock = threading.Lock()
        self._ipc = None
        if transport == "cuda_ipc":
            from tllm.disagg.cuda_ipc import IpcSources
            self._ipc = IpcSources()

    def submit(self, request: Request, source: KVSource) -> None:
        with self._lock:
            self._fetching[request.request_id] = False
        self._pool.submit(self._fetch_and_submit, request, source)

    def abort(self, request_id: str) -> bool:
        """Abort a request still being fetched (True), else leave it to the executor."""
        with self._lock:
            if request_id in self._fetching:
                self._fetching[request_id] = True
                return True
        return False

    def free(self, request: Request) -> None:
        """(Executor thread.) A request that ended before admission drops its staged KV."""
        if request.kv_import is not None:
            request.kv_import.discard()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _fetch_and_submit(self, request: Request, source: KVSource) -> None:
        try:
            request.kv_import = self._fetch(request, source)
            self.stats.num_imported += 1
        except Exception as exc:  # noqa: BLE001 - any failure: compute the prompt here
            self.stats.num_failed += 1
            logger.warning("KV fetch for %s from %s failed (%s); computing its prompt here",
                           request.request_id, source.endpoint, exc)
        try:
            self._submit(request)
        except Exception as exc:  # noqa: BLE001 - refused now: end it as the executor would
            self._fetching_done(request.request_id)
            if request.kv_import is not None:
                request.kv_import.discard()
            _fail(request, exc)
            return
        # an abort that came while fetching applies now (one that comes later goes to the
        # executor, after the submission)
        if self._fetching_done(request.request_id):
            self._abort(request.request_id)

    def _fetching_done(self, request_id: str) -> bool:
        """Whether it was aborted while being fetched."""
        with self._lock:
            return self._fetching.pop(request_id)

    def _fetch(self, request: Request, source: KVSource):
        with connect(source.endpoint, CONNECT_TIMEOUT_S) as sock:
            send_message(sock, {"op": "fetch", "id": source.export_id,
                                "transport": self.transport})
            header = recv_header(sock)
            if not header.get("ok"):
                raise TransferError(header.get("error", "refused"))
            if header["token_ids"] != request.prompt_token_ids[:len(header["token_ids"])] \
                    or header["num_tokens"] > request.num_prompt_tokens:
                send_message(sock, {"op": "release", "id": source.export_id})
                raise TransferError("the context server prefilled a different prompt")
            if self._ipc is not None:
                return self._ipc.imported(source, header, sock, self._release_later)
            imported = self._receive(sock, header)
            send_message(sock, {"op": "release", "id": source.export_id})
            recv_header(sock)
            return imported

    def _receive(self, sock, header: dict) -> StagedKV:
        """The blocks' bytes straight into a staging tensor (pinned memory for a GPU)."""
        started = time.perf_counter()
        nbytes = int(header["nbytes"])
        self.budget.acquire(nbytes)
        try:
            pin = self.kv_cache.slot_caches[0][0].device.type == "cuda"
            data = torch.empty(header["shape"], dtype=dtype_from_name(header["dtype"]),
                               pin_memory=pin)
            view = tensor_bytes(data)
            if len(view) != nbytes:
                raise TransferError(f"announced {nbytes} bytes for a {header['shape']} "
                                    "tensor")
            recv_into(sock, view)
        except BaseException:
            self.budget.release(nbytes)
            raise
        self.stats.bytes_received += nbytes
        self.stats.transfer_seconds += time.perf_counter() - started
        return StagedKV(int(header["num_tokens"]), data, lambda: self.budget.release(nbytes))

    def _release_later(self, source: KVSource, event) -> None:
        """(CUDA IPC.) Once the device copy is done, the context server may free the blocks."""
        def release() -> None:
            event.synchronize()
            try:
                with connect(source.endpoint, CONNECT_TIMEOUT_S) as sock:
                    send_message(sock, {"op": "release", "id": source.export_id})
                    recv_header(sock)
            except (OSError, TransferError) as exc:
                logger.warning("could not release KV %s at %s: %s", source.export_id,
                               source.endpoint, exc)
        self._pool.submit(release)


def _fail(request: Request, error: Exception) -> None:
    from tllm.request import FinishReason
    request.error = error
    request.finish(FinishReason.ABORT)
    if request.on_update is not None:
        request.on_update(request)
