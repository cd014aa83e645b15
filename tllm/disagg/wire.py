"""The KV transfer wire format between a generation server and a context server: each
message is a 4-byte big-endian length, a JSON header of that length, then the `nbytes` of
payload the header announces (raw tensor bytes, received straight into their tensor).

    generation -> context   {"op": "fetch", "id": ID, "transport": "tcp" | "cuda_ipc"}
    context -> generation   {"ok": true, "num_tokens", "token_ids", "shape", "dtype",
                             "nbytes"} + the blocks   (tcp)
                            {"ok": true, "num_tokens", "token_ids", "block_ids",
                             "nbytes"} + the pool's IPC handles, pickled   (cuda_ipc)
                            {"ok": false, "error": "..."}
    generation -> context   {"op": "release", "id": ID}   -> {"ok": true}

The port is for the servers of one deployment only: a cuda_ipc answer is a pickle."""
from __future__ import annotations

import json
import socket
import struct
from typing import Any

import torch

_LENGTH = struct.Struct(">I")
MAX_HEADER_BYTES = 64 << 20  # token ids of a long prompt fit; a garbled length does not


class TransferError(RuntimeError):
    """The other side refused, broke the protocol or went away."""


def send_message(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    data = json.dumps({**header, "nbytes": len(payload)} if payload else header).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)
    if payload:
        sock.sendall(payload)


def recv_header(sock: socket.socket) -> dict[str, Any]:
    (length,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size))
    if length > MAX_HEADER_BYTES:
        raise TransferError(f"a KV transfer header of {length} bytes")
    return json.loads(recv_exact(sock, length))


def recv_exact(sock: socket.socket, num_bytes: int) -> bytes:
    buffer = bytearray(num_bytes)
    recv_into(sock, memoryview(buffer))
    return bytes(buffer)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket (TransferError if the peer closes first)."""
    received = 0
    while received < len(view):
        n = sock.recv_into(view[received:])
        if n == 0:
            raise TransferError("the KV transfer connection closed early")
        received += n


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, without a copy (any dtype, bfloat16 too)."""
    return memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy())


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"unknown KV dtype {name!r}")
    return dtype


def connect(endpoint: str, timeout_s: float) -> socket.socket:
    """A connection to a context server's KV endpoint, 'tcp://host:port' or 'host:port'."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"disaggregated_params.opaque_state: not a KV endpoint "
                         f"('tcp://host:port'): {endpoint!r}")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
