"""Hostile KV endpoints for tests: socket listeners that count the connections they get and
answer each with what an attacker would send (the payload of the audit: a JSON header that
announces `nbytes`, then a pickle that, unpickled, creates a directory)."""
from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import threading
from pathlib import Path
from typing import Callable

from tllm.disagg.handshake import server_handshake
from tllm.disagg.wire import TransferError, recv_request


class _CreatesDirectory:
    """Unpickling this runs os.mkdir(path): proof of code execution."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def crafted_pickle(marker: Path) -> bytes:
    return pickle.dumps(_CreatesDirectory(marker))


def old_style_answer(marker: Path) -> bytes:
    """The audit's answer: header {"ok": true, "token_ids": [], "nbytes": N} + the pickle."""
    payload = crafted_pickle(marker)
    header = json.dumps({"ok": True, "token_ids": [], "num_tokens": 1, "block_ids": [0],
                         "nbytes": len(payload)}).encode()
    return struct.pack(">I", len(header)) + header + payload


class FakeKVSource:
    """A listener on 127.0.0.1 that counts its connections; `answer(sock)` serves each."""

    def __init__(self, answer: Callable[[socket.socket], None]) -> None:
        self._answer = answer
        self.num_connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return      # closed
            self.num_connections += 1
            with sock:
                sock.settimeout(5)
                try:
                    self._answer(sock)
                except (OSError, TransferError):
                    pass    # the client hung up (a probe ends after the handshake)

    def close(self) -> None:
        self._listener.close()


def answers_old_style(marker: Path) -> Callable[[socket.socket], None]:
    """Whatever is asked: the audit's answer at once (an endpoint that predates the
    handshake, or an attacker's)."""
    def answer(sock: socket.socket) -> None:
        sock.recv(65536)
        sock.sendall(old_style_answer(marker))
    return answer


def impostor(source_id: str, marker: Path) -> Callable[[socket.socket], None]:
    """Speaks the handshake (no secret) as `source_id`, then answers a fetch with the
    audit's answer: a configured context server that was taken over."""
    def answer(sock: socket.socket) -> None:
        server_handshake(sock, source_id, None)
        recv_request(sock)
        sock.sendall(old_style_answer(marker))
    return answer
