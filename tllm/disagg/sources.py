"""The context servers a generation server may fetch KV from: the endpoints it was configured
with (`--kv-sources`), each known by the source id it announces in the handshake. A request
names a source by that id; an id that none of them announces is refused, so no request ever
makes this server connect anywhere else."""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Sequence

from tllm.disagg.handshake import client_handshake
from tllm.disagg.wire import TransferError, connect
from tllm.config import parse_endpoint

logger = logging.getLogger(__name__)
PROBE_INTERVAL_S = 1.0      # an unknown id asks every source again at most this often


class KVSources:
    """Source id -> configured endpoint, learned by asking the endpoints (a handshake each)."""

    def __init__(self, endpoints: Sequence[str], secret: bytes | None,
                 timeout_s: float) -> None:
        self._addresses = {endpoint: parse_endpoint(endpoint) for endpoint in endpoints}
        self._secret = secret
        self._timeout_s = timeout_s
        self._by_id: dict[str, str] = {}
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()     # one round of asking at a time
        self._last_probe = -PROBE_INTERVAL_S

    def open(self, source_id: str) -> tuple[socket.socket, str]:
        """(connection, endpoint) to the configured source announcing `source_id`, its
        handshake done (TransferError if no configured source announces it)."""
        endpoint = self._endpoint_of(source_id)
        sock = connect(*self._addresses[endpoint], self._timeout_s)
        try:
            announced = client_handshake(sock, self._secret)
        except BaseException:
            sock.close()
            raise
        if announced != source_id:
            sock.close()
            self._learn(announced, endpoint)
            raise TransferError(f"the KV source at {endpoint} has restarted: the KV it held "
                                "is gone")
        return sock, endpoint

    def _endpoint_of(self, source_id: str) -> str:
        with self._lock:
            endpoint = self._by_id.get(source_id)
        if endpoint is not None:
            return endpoint
        with self._probe_lock:
            with self._lock:
                endpoint = self._by_id.get(source_id)   # a round that just ended found it
            if endpoint is None and time.monotonic() - self._last_probe >= PROBE_INTERVAL_S:
                self._probe()
                with self._lock:
                    endpoint = self._by_id.get(source_id)
        if endpoint is None:
            raise TransferError("none of this server's KV sources (--kv-sources) has the "
                                "source id the request names")
        return endpoint

    def _probe(self) -> None:
        for endpoint, address in self._addresses.items():
            try:
                with connect(*address, self._timeout_s) as sock:
                    self._learn(client_handshake(sock, self._secret), endpoint)
            except (OSError, TransferError) as exc:
                logger.warning("KV source %s did not answer: %s", endpoint, exc)
        self._last_probe = time.monotonic()

    def _learn(self, source_id: str, endpoint: str) -> None:
        with self._lock:
            self._by_id = {i: e for i, e in self._by_id.items() if e != endpoint}
            self._by_id[source_id] = endpoint
