"""The context server's side of KV transfer: a context-only request's blocks outlive it
(held under its export id) until a generation server has fetched them, or until a timeout;
a TCP endpoint serves them (their bytes, or CUDA IPC handles to the pool and block ids).

The KV pool is the executor thread's: blocks are retained there (the exporter is a resource
manager whose free() runs before the KV cache's) and released there (through
`executor.call_soon`). Transfer threads only read held blocks, which nothing writes while a
reference is held."""
from __future__ import annotations

import logging
import pickle
import socket
import socketserver
import threading
import time
from dataclasses import dataclass
from typing import Callable

from tllm.disagg.wire import TransferError, recv_header, send_message, tensor_bytes
from tllm.kv_cache.manager import KVCacheManager
from tllm.request import FinishReason, Request
from tllm.scheduler.interface import ResourceManager

logger = logging.getLogger(__name__)
CHUNK_BLOCKS = 16   # blocks read out and sent at a time: host memory per transfer stays small


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
                 host: str, port: int, hold_timeout_s: float) -> None:
        self.kv_cache = kv_cache
        self.call_soon = call_soon      # runs a function on the executor thread
        self.hold_timeout_s = hold_timeout_s
        self.stats = ExportStats()
        self._held: dict[str, HeldBlocks] = {}
        self._lock = threading.Lock()
        self._ipc_handles: bytes | None = None
        self._server = _ThreadingServer((host, port), _make_handler(self))
        self.endpoint = "tcp://%s:%d" % self._server.server_address[:2]
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

    def ipc_handles(self) -> bytes:
        """The KV pool's tensors as CUDA IPC handles (pickled; made once)."""
        if self._ipc_handles is None:
            from torch.multiprocessing.reductions import reduce_tensor
            if self.kv_cache.slot_caches[0][0].device.type != "cuda":
                raise TransferError("transport cuda_ipc: this context server's KV cache is "
                                    "not on a GPU")
            self._ipc_handles = pickle.dumps([(reduce_tensor(k), reduce_tensor(v))
                                              for k, v in self.kv_cache.slot_caches])
        return self._ipc_handles

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


def _make_handler(exporter: KVExporter):
    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            sock: socket.socket = self.request
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                while True:
                    _serve_one(exporter, sock, recv_header(sock))
            except (TransferError, OSError, ValueError):
                pass    # the peer closed (or spoke nonsense): held blocks wait for their timeout
    return Handler


def _serve_one(exporter: KVExporter, sock: socket.socket, message: dict) -> None:
    op, export_id = message.get("op"), str(message.get("id"))
    if op == "release":
        send_message(sock, {"ok": exporter.release(export_id)})
        return
    if op != "fetch":
        send_message(sock, {"ok": False, "error": f"unknown op {op!r}"})
        return
    held = exporter.get(export_id)
    if held is None:
        send_message(sock, {"ok": False, "error": f"no KV held under {export_id!r} (never "
                            "prefilled here, already fetched, or expired)"})
        return
    header = {"ok": True, "num_tokens": held.num_tokens, "token_ids": held.token_ids}
    if message.get("transport") == "cuda_ipc":
        send_message(sock, {**header, "block_ids": held.block_ids}, exporter.ipc_handles())
        return
    _send_blocks(exporter, sock, header, held.block_ids)


def _send_blocks(exporter: KVExporter, sock: socket.socket, header: dict,
                 block_ids: list[int]) -> None:
    """The blocks' bytes, read out CHUNK_BLOCKS at a time."""
    kv_cache = exporter.kv_cache
    first = kv_cache.read_blocks(block_ids[:1])
    shape = [len(block_ids), *first.shape[1:]]
    nbytes = first.numel() * first.element_size() * len(block_ids)
    send_message(sock, {**header, "shape": shape, "dtype": str(first.dtype),
                        "nbytes": nbytes})
    for start in range(0, len(block_ids), CHUNK_BLOCKS):
        chunk = kv_cache.read_blocks(block_ids[start:start + CHUNK_BLOCKS]).cpu()
        sock.sendall(tensor_bytes(chunk))
    exporter.stats.bytes_sent += nbytes
