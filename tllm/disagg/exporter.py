"""The context server's side of KV transfer: a context-only request's blocks outlive it
(held under its export id) until a generation server has fetched them, or until a timeout;
a TCP endpoint serves them (their bytes, or CUDA IPC handles to the pool and block ids) to
generation servers that pass the handshake (tllm/disagg/handshake.py).

The KV pool is the executor thread's: blocks are retained there (the exporter is a resource
manager whose free() runs before the KV cache's) and released there (through
`executor.call_soon`). Transfer threads only read held blocks, which nothing writes while a
reference is held."""
from __future__ import annotations

import ipaddress
import logging
import secrets
import socket
import socketserver
import threading
import time
from dataclasses import dataclass
from typing import Callable

from tllm.disagg.handshake import recv_or_refuse, server_handshake
from tllm.disagg.messages import (Fetch, IpcFetchReply, IpcPool, PoolRequest,
                                  Refusal, Release, Released, TcpFetchReply, prompt_sha256)
from tllm.disagg.wire import TransferError, dtype_name, send_message, tensor_bytes
from tllm.kv_cache.manager import KVCacheManager
from tllm.request import FinishReason, Request
from tllm.scheduler.interface import ResourceManager

logger = logging.getLogger(__name__)
CHUNK_BLOCKS = 16   # blocks read out and sent at a time: host memory per transfer stays small
MAX_CONNECTIONS = 64        # at once; more are closed at once (each holds a thread)
IDLE_TIMEOUT_S = 30.0       # a connection that sends nothing this long is closed


@dataclass
class HeldBlocks:
    block_ids: list[int]
    num_tokens: int             # prompt tokens whose keys and values they hold
    token_ids: list[int]        # those tokens (the generation side checks its prompt)
    deadline: float


@dataclass
class ExportStats:
    num_exported: int = 0       # requests whose blocks were held for a generation server
    num_fetched: int = 0
    num_expired: int = 0        # released by the timeout, never fetched
    bytes_sent: int = 0


class KVExporter(ResourceManager):
    """Holds context-only requests' blocks and serves them on a TCP endpoint."""

    def __init__(self, kv_cache: KVCacheManager, call_soon: Callable[[Callable[[], None]], None],
                 host: str, port: int, hold_timeout_s: float,
                 secret: bytes | None = None) -> None:
        self.kv_cache = kv_cache
        self.call_soon = call_soon      # runs a function on the executor thread
        self.hold_timeout_s = hold_timeout_s
        self.stats = ExportStats()
        self._held: dict[str, HeldBlocks] = {}
        self._lock = threading.Lock()
        self._ipc_pool: IpcPool | None = None
        # named in requests instead of this server's address; new at each start, so a
        # generation server sees a restart (and opens a restarted pool again)
        self.source_id = secrets.token_hex(16)
        self.secret = secret
        self.connection_slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._server = _ThreadingServer((host, port), _make_handler(self))
        self.endpoint = "tcp://%s:%d" % self._server.server_address[:2]
        if secret is None and not _is_loopback(host):
            logger.warning("the KV endpoint listens on %s without a shared secret: any host "
                           "that reaches it may fetch held KV by id (set --kv-secret-file "
                           "or TLLM_KV_SECRET on every server of the deployment)", host)
        self._stopped = threading.Event()
        self._threads = [threading.Thread(target=self._server.serve_forever, daemon=True,
                                          name="tllm-kv-export"),
                         threading.Thread(target=self._expire_loop, daemon=True,
                                          name="tllm-kv-expiry")]
        for thread in self._threads:
            thread.start()

    # ---- executor thread ----

    def free(self, request: Request) -> None:
        """A context-only request that ended well: its blocks stay, held for the fetch."""
        if (request.kv_export_id is None or request.error is not None
                or request.finish_reason is FinishReason.ABORT):
            return
        held = HeldBlocks(self.kv_cache.retain(request), request.num_computed_tokens,
                          list(request.prompt_token_ids), time.monotonic() + self.hold_timeout_s)
        with self._lock:
            previous = self._held.pop(request.kv_export_id, None)
            self._held[request.kv_export_id] = held
            self.stats.num_exported += 1
        if previous is not None:    # an id sent twice: the newer prefill wins
            self.kv_cache.release(previous.block_ids)

    # ---- any thread ----

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    def get(self, export_id: str) -> HeldBlocks | None:
        with self._lock:
            return self._held.get(export_id)

    def release(self, export_id: str, expired: bool = False) -> bool:
        with self._lock:
            held = self._held.pop(export_id, None)
            if held is not None:
                self.stats.num_expired += expired
                self.stats.num_fetched += not expired
        if held is not None:
            self.call_soon(lambda: self.kv_cache.release(held.block_ids))
        return held is not None

    def ipc_pool(self) -> IpcPool:
        """The KV pool's tensors as CUDA IPC handles, as plain data (made once)."""
        with self._lock:
            if self._ipc_pool is None:
                from tllm.disagg.cuda_ipc import describe_pool
                self._ipc_pool = describe_pool(self.kv_cache.slot_caches)
            return self._ipc_pool

    def close(self) -> None:
        self._stopped.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            ids = list(self._held)
        for export_id in ids:
            self.release(export_id, expired=True)

    def _expire_loop(self) -> None:
        while not self._stopped.wait(0.25):
            now = time.monotonic()
            with self._lock:
                expired = [i for i, held in self._held.items() if held.deadline < now]
            for export_id in expired:
                logger.warning("KV blocks of %s were not fetched within %.0f s: released",
                               export_id, self.hold_timeout_s)
                self.release(export_id, expired=True)


class _ThreadingServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128    # a burst of fetches waits in the backlog, not in SYN retries


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _make_handler(exporter: KVExporter):
    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            if not exporter.connection_slots.acquire(blocking=False):
                return      # too many at once: closed unanswered
            sock: socket.socket = self.request
            try:
                sock.settimeout(IDLE_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                server_handshake(sock, exporter.source_id, exporter.secret)
                while True:
                    _serve_one(exporter, sock, recv_or_refuse(sock))
            except (TransferError, OSError) as exc:
                # the peer closed, timed out or spoke nonsense: held blocks wait for their
                # timeout
                logger.debug("KV connection from %s ended: %s", self.client_address, exc)
            finally:
                exporter.connection_slots.release()
    return Handler


def _serve_one(exporter: KVExporter, sock: socket.socket, message) -> None:
    if isinstance(message, Release):
        send_message(sock, Released(ok=exporter.release(message.id)))
    elif isinstance(message, PoolRequest):
        send_message(sock, exporter.ipc_pool())
    elif isinstance(message, Fetch):
        _serve_fetch(exporter, sock, message)
    else:
        send_message(sock, Refusal(error=f"unexpected {message.op}"))
        raise TransferError(f"unexpected {message.op}")


def _serve_fetch(exporter: KVExporter, sock: socket.socket, fetch: Fetch) -> None:
    held = exporter.get(fetch.id)
    if held is None:
        send_message(sock, Refusal(error="no KV held under this id (never prefilled here, "
                                   "already fetched, or expired)"))
        return
    prompt = dict(num_tokens=held.num_tokens, prompt_len=len(held.token_ids),
                  prompt_sha256=prompt_sha256(held.token_ids))
    if fetch.transport == "cuda_ipc":
        try:
            exporter.ipc_pool()
        except TransferError as exc:    # a KV cache that is not on a GPU
            send_message(sock, Refusal(error=str(exc)))
            return
        send_message(sock, IpcFetchReply(**prompt, block_ids=held.block_ids))
        return
    _send_blocks(exporter, sock, prompt, held.block_ids)


def _send_blocks(exporter: KVExporter, sock: socket.socket, prompt: dict,
                 block_ids: list[int]) -> None:
    """The blocks' bytes, read out CHUNK_BLOCKS at a time."""
    kv_cache = exporter.kv_cache
    first = kv_cache.read_blocks(block_ids[:1])
    nbytes = first.numel() * first.element_size() * len(block_ids)
    send_message(sock, TcpFetchReply(**prompt, dtype=dtype_name(first.dtype),
                                     block_shape=list(first.shape[1:]),
                                     num_blocks=len(block_ids), nbytes=nbytes))
    for start in range(0, len(block_ids), CHUNK_BLOCKS):
        chunk = kv_cache.read_blocks(block_ids[start:start + CHUNK_BLOCKS]).cpu()
        sock.sendall(tensor_bytes(chunk))
    exporter.stats.bytes_sent += nbytes
