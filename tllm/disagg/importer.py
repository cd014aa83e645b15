"""The generation server's side of KV transfer: before a generation-only request is
submitted, a transfer thread fetches its prompt's KV from the configured context server the
request names by source id (over TCP into host memory, bounded by a byte budget; or, with CUDA
IPC, the source block ids only) while the executor goes on computing; the request is
submitted with it, and the KV is written into its fresh blocks when it is admitted
(KVCacheManager.try_admit). Every answer is checked against this server's own KV layout and
the request's own prompt before a byte of KV is taken.

If the fetch fails (the context server went away, the blocks expired, the prompt differs, an
answer is malformed), the request is submitted without it and computes its prompt itself:
the same output, later."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from tllm.disagg.messages import (Fetch, HeldPrompt, IpcFetchReply, Release, Released,
                                  TcpFetchReply, prompt_sha256)
from tllm.disagg.sources import KVSources
from tllm.disagg.wire import (TransferError, dtype_name, recv_into, recv_reply, send_message,
                              tensor_bytes)
from tllm.kv_cache.manager import KVCacheManager
from tllm.kv_cache.transfer import block_shape
from tllm.request import Request
from tllm.scheduler.interface import ResourceManager

logger = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class KVSource:
    """Where a generation-only request's KV is: a configured context server's source id
    and the id its KV is held under there."""

    source_id: str
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
                 sources: KVSources, num_threads: int = 4) -> None:
        self.kv_cache = kv_cache
        self.sources = sources
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
            logger.warning("KV fetch for %s from source %s failed (%s); computing its prompt "
                           "here", request.request_id, source.source_id, exc)
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
        sock, endpoint = self.sources.open(source.source_id)
        with sock:
            send_message(sock, Fetch(id=source.export_id, transport=self.transport))
            reply = recv_reply(sock, TcpFetchReply if self._ipc is None else IpcFetchReply)
            try:
                check_prompt(reply, request.prompt_token_ids)
                if self._ipc is not None:
                    return self._ipc.imported(
                        sock, endpoint, source.source_id, reply, self.kv_cache.slot_caches,
                        self.kv_cache.tokens_per_block,
                        lambda event: self._release_later(source, event))
                check_layout(reply, self.kv_cache)
            except TransferError:
                _release_quietly(sock, source.export_id)
                raise
            imported = self._receive(sock, reply)
            send_message(sock, Release(id=source.export_id))
            recv_reply(sock, Released)
            return imported

    def _receive(self, sock, reply: TcpFetchReply) -> StagedKV:
        """The blocks' bytes straight into a staging tensor (pinned memory for a GPU) of our
        own KV dtype and block shape (check_layout has matched the reply to them)."""
        started = time.perf_counter()
        nbytes = reply.nbytes
        self.budget.acquire(nbytes)
        try:
            k = self.kv_cache.slot_caches[0][0]
            data = torch.empty((reply.num_blocks, *block_shape(self.kv_cache)), dtype=k.dtype,
                               pin_memory=k.device.type == "cuda")
            recv_into(sock, tensor_bytes(data))
        except BaseException:
            self.budget.release(nbytes)
            raise
        self.stats.bytes_received += nbytes
        self.stats.transfer_seconds += time.perf_counter() - started
        return StagedKV(reply.num_tokens, data, lambda: self.budget.release(nbytes))

    def _release_later(self, source: KVSource, event) -> None:
        """(CUDA IPC.) Once the device copy is done, the context server may free the blocks."""
        def release() -> None:
            event.synchronize()
            try:
                sock, _ = self.sources.open(source.source_id)
                with sock:
                    send_message(sock, Release(id=source.export_id))
                    recv_reply(sock, Released)
            except (OSError, TransferError) as exc:
                logger.warning("could not release KV %s at source %s: %s", source.export_id,
                               source.source_id, exc)
        self._pool.submit(release)


def check_prompt(reply: HeldPrompt, prompt_token_ids: list[int]) -> None:
    """The held KV must be of this request's prompt (its first `prompt_len` tokens)."""
    if not (reply.num_tokens <= reply.prompt_len <= len(prompt_token_ids)) or \
            prompt_sha256(prompt_token_ids[:reply.prompt_len]) != reply.prompt_sha256:
        raise TransferError("the context server prefilled a different prompt")


def check_layout(reply: TcpFetchReply, kv_cache: KVCacheManager) -> None:
    """The blocks announced must be ours in dtype and shape, as many as the tokens need
    (and no more than our whole pool), and exactly `nbytes` long."""
    k = kv_cache.slot_caches[0][0]
    shape = list(block_shape(kv_cache))
    if reply.dtype != dtype_name(k.dtype) or reply.block_shape != shape:
        raise TransferError(f"the KV source's blocks are {reply.dtype} {reply.block_shape}, "
                            f"ours {dtype_name(k.dtype)} {shape}")
    if reply.num_blocks != -(-reply.num_tokens // kv_cache.tokens_per_block):
        raise TransferError(f"{reply.num_blocks} blocks for {reply.num_tokens} tokens")
    if reply.num_blocks > k.shape[0]:
        raise TransferError(f"{reply.num_blocks} blocks, more than this server's whole pool")
    block_nbytes = k.element_size()
    for dim in shape:
        block_nbytes *= dim
    if reply.nbytes != reply.num_blocks * block_nbytes:
        raise TransferError(f"{reply.nbytes} bytes announced for {reply.num_blocks} blocks "
                            f"of {block_nbytes}")


def _release_quietly(sock, export_id: str) -> None:
    """Best effort: the blocks expire on the context server anyway."""
    try:
        send_message(sock, Release(id=export_id))
    except OSError:
        pass


def _fail(request: Request, error: Exception) -> None:
    from tllm.request import FinishReason
    request.error = error
    request.finish(FinishReason.ABORT)
    if request.on_update is not None:
        request.on_update(request)
