"""The start of every KV transfer connection: the context server names its source id, and,
where the deployment shares a secret, each side proves it knows the secret (HMAC-SHA256 over
both sides' fresh nonces) without sending it: a generation server fetches from no impostor,
and a context server serves no stranger."""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

from tllm.disagg.messages import PROTOCOL_VERSION, Auth, Hello, HelloReply, Message, Refusal
from tllm.disagg.wire import (MalformedMessage, TransferError, recv_reply, recv_request,
                              send_message)


def new_nonce() -> str:
    return secrets.token_hex(16)


def _proof(secret: bytes, side: bytes, client_nonce: str, server_nonce: str,
           source_id: str) -> str:
    message = b"|".join((b"tllm-kv", side, client_nonce.encode(), server_nonce.encode(),
                         source_id.encode()))
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def client_handshake(sock: socket.socket, secret: bytes | None) -> str:
    """(The generation server.) The source id of the context server at the other end,
    authenticated where a secret is set (TransferError otherwise)."""
    nonce = new_nonce()
    send_message(sock, Hello(version=PROTOCOL_VERSION, nonce=nonce))
    reply = recv_reply(sock, HelloReply)
    if reply.version != PROTOCOL_VERSION:
        raise TransferError(f"the KV source speaks protocol {reply.version}, this server "
                            f"{PROTOCOL_VERSION}")
    if secret is None:
        if reply.proof is not None:
            raise TransferError("the KV source expects a shared secret and this server has "
                                "none (--kv-secret-file or TLLM_KV_SECRET)")
        return reply.source_id
    expected = _proof(secret, b"context", nonce, reply.nonce, reply.source_id)
    if reply.proof is None or not hmac.compare_digest(reply.proof, expected):
        raise TransferError("the KV source did not prove it knows the shared secret")
    send_message(sock, Auth(proof=_proof(secret, b"generation", nonce, reply.nonce,
                                         reply.source_id)))
    return reply.source_id


def server_handshake(sock: socket.socket, source_id: str, secret: bytes | None) -> None:
    """(The context server.) Answer a generation server's Hello; with a secret, require its
    proof (TransferError, after a Refusal, if it has none)."""
    hello = recv_or_refuse(sock)
    if not isinstance(hello, Hello) or hello.version != PROTOCOL_VERSION:
        _refuse(sock, f"expected hello, protocol version {PROTOCOL_VERSION}")
    nonce = new_nonce()
    proof = (None if secret is None
             else _proof(secret, b"context", hello.nonce, nonce, source_id))
    send_message(sock, HelloReply(version=PROTOCOL_VERSION, source_id=source_id,
                                  nonce=nonce, proof=proof))
    if secret is None:
        return
    auth = recv_or_refuse(sock)
    expected = _proof(secret, b"generation", hello.nonce, nonce, source_id)
    if not isinstance(auth, Auth) or not hmac.compare_digest(auth.proof, expected):
        _refuse(sock, "the shared secret was not proven")


def recv_or_refuse(sock: socket.socket) -> Message:
    """(The context server.) The next request; a malformed one is answered with a Refusal
    saying why, then TransferError (the connection ends)."""
    try:
        return recv_request(sock)
    except MalformedMessage as exc:
        _refuse(sock, str(exc))


def _refuse(sock: socket.socket, reason: str) -> None:
    send_message(sock, Refusal(error=reason))
    raise TransferError(reason)
