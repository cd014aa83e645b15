"""The KV transfer wire between a generation server and the context servers it was configured
with. Each message is a 4-byte big-endian length and a JSON header of that length (at most
MAX_HEADER_BYTES), validated against the model (tllm/disagg/messages.py) the reader expects
at that point; a TCP fetch's answer is followed by the blocks' raw bytes, received straight
into a tensor whose dtype and shape the generation side chose from its own KV cache. Nothing
on this wire is unpickled or names code to run.

    generation -> context   Hello {version, nonce}
    context -> generation   HelloReply {version, source_id, nonce, proof}
    generation -> context   Auth {proof}                          (with a shared secret)
    then, any number of times:
    generation -> context   Fetch {id, transport}
    context -> generation   TcpFetchReply + the blocks' bytes       (tcp)
                            IpcFetchReply (the blocks' ids)          (cuda_ipc)
    generation -> context   PoolRequest -> IpcPool    (cuda_ipc: the pool's IPC handles)
    generation -> context   Release {id} -> Released {ok}
    any answer may be a Refusal {ok: false, error} instead.
"""
from __future__ import annotations

import socket
import struct
from typing import TypeVar

import torch
from pydantic import BaseModel, ValidationError

from tllm.disagg.messages import AnyRequest, Message, Refusal

_LENGTH = struct.Struct(">I")
MAX_HEADER_BYTES = 16 << 20     # a long prompt's block ids or a pool's IPC handles fit
M = TypeVar("M", bound=BaseModel)


class TransferError(RuntimeError):
    """The other side refused, broke the protocol or went away."""


class MalformedMessage(TransferError):
    """A message that is not what the protocol expects at this point."""


def send_message(sock: socket.socket, message: Message, payload: bytes = b"") -> None:
    data = message.model_dump_json().encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)
    if payload:
        sock.sendall(payload)


def recv_reply(sock: socket.socket, model: type[M]) -> M:
    """The next message as `model` (TransferError if it is a Refusal or malformed)."""
    data = _recv_header(sock)
    try:
        refusal = Refusal.model_validate_json(data)
    except ValidationError:
        return _validated(model, data)
    raise TransferError(f"the KV source refused: {refusal.error}")


def recv_request(sock: socket.socket) -> Message:
    """(The context server.) The next request from a generation server, validated."""
    data = _recv_header(sock)
    try:
        return AnyRequest.validate_json(data)
    except ValidationError as exc:
        raise MalformedMessage(f"a malformed KV request: {_summary(exc)}") from None


def _validated(model: type[M], data: bytes) -> M:
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise MalformedMessage(f"a malformed {model.__name__} from the KV source: "
                               f"{_summary(exc)}") from None


def _summary(exc: ValidationError) -> str:
    """The fields that failed and why (never the values: they came off the network)."""
    errors = exc.errors(include_input=False, include_url=False)
    text = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'message'}: {e['msg']}"
                     for e in errors[:3])
    return text + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else "")


def _recv_header(sock: socket.socket) -> bytes:
    (length,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size))
    if length > MAX_HEADER_BYTES:
        raise MalformedMessage(f"a KV transfer header of {length} bytes (at most "
                               f"{MAX_HEADER_BYTES})")
    return recv_exact(sock, length)


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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A connection to a configured context server's KV endpoint."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
