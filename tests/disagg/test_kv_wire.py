"""The KV transfer wire's validation, without engines: framing (truncated, oversized), each
message checked field by field (no pickle, dtype names from an allow-list, bounds), a TCP
answer matched to our own KV layout and prompt, CUDA IPC handles and block ids checked before
anything is opened, and the shared-secret handshake."""
from __future__ import annotations

import json
import socket
import struct
import threading

import pytest
import torch

from tests.disagg.fake_kv_source import crafted_pickle
from tllm.disagg.cuda_ipc import (IpcSources, check_block_ids, check_remote_tensor,
                                  open_pool)
from tllm.disagg.handshake import client_handshake, server_handshake
from tllm.disagg.importer import check_layout, check_prompt
from tllm.disagg.messages import (IpcFetchReply, IpcPool, IpcTensor, TcpFetchReply,
                                  prompt_sha256)
from tllm.disagg.wire import MAX_HEADER_BYTES, TransferError, recv_reply, send_message
from tllm.kv_cache.manager import KVCacheManager

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(5), b.settimeout(5)
    yield a, b
    a.close(), b.close()


@pytest.fixture(scope="module")
def kv_cache():
    """2 layers, blocks of 4 tokens x 2 heads x 8, a pool of 6 blocks."""
    return KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=6,
                          tokens_per_block=4, dtype=torch.float32, device="cpu")


def _frame(header: bytes) -> bytes:
    return struct.pack(">I", len(header)) + header


def _tcp_reply(**changes) -> dict:
    reply = dict(ok=True, num_tokens=6, prompt_len=6, prompt_sha256=prompt_sha256(PROMPT),
                 dtype="float32", block_shape=[2, 2, 4, 2, 8], num_blocks=2,
                 nbytes=2 * 2 * 2 * 4 * 2 * 8 * 4)
    return {**reply, **changes}


# ---- framing ----

def test_truncated_header(pair):
    a, b = pair
    a.sendall(struct.pack(">I", 100) + b'{"ok": true')
    a.close()
    with pytest.raises(TransferError, match="closed early"):
        recv_reply(b, TcpFetchReply)


def test_oversized_header_length_is_refused_unread(pair):
    a, b = pair
    a.sendall(struct.pack(">I", MAX_HEADER_BYTES + 1))
    with pytest.raises(TransferError, match="at most"):
        recv_reply(b, TcpFetchReply)


@pytest.mark.parametrize("model", [TcpFetchReply, IpcFetchReply, IpcPool])
def test_a_pickle_is_never_a_message(pair, tmp_path, model):
    a, b = pair
    a.sendall(_frame(crafted_pickle(tmp_path / "ran")))
    with pytest.raises(TransferError, match="malformed"):
        recv_reply(b, model)
    assert not (tmp_path / "ran").exists()


# ---- a TCP fetch's answer ----

@pytest.mark.parametrize("changes", [
    {"dtype": "os.system"}, {"dtype": "torch.load"}, {"dtype": "torch.float32"},
    {"nbytes": 1 << 60}, {"nbytes": -1}, {"num_tokens": 0}, {"num_blocks": 1 << 30},
    {"block_shape": [2, 2, 4, 2]}, {"block_shape": [2, 2, 4, 2, 0]},
    {"num_blocks": "2"}, {"num_blocks": 2.0}, {"prompt_sha256": "xyz"},
    {"py/reduce": "os.system"}, {"ok": "yes"},
])
def test_malformed_tcp_reply(pair, changes):
    a, b = pair
    a.sendall(_frame(json.dumps(_tcp_reply(**changes)).encode()))
    with pytest.raises(TransferError, match="malformed TcpFetchReply"):
        recv_reply(b, TcpFetchReply)


def test_refusal_is_an_error(pair):
    a, b = pair
    a.sendall(_frame(b'{"ok": false, "error": "no KV held"}'))
    with pytest.raises(TransferError, match="refused: no KV held"):
        recv_reply(b, TcpFetchReply)


def test_tcp_reply_matching_our_layout_passes(kv_cache):
    reply = TcpFetchReply(**_tcp_reply())
    check_layout(reply, kv_cache)
    check_prompt(reply, PROMPT)
    check_prompt(reply, PROMPT + [1, 2])      # the held prompt is a prefix of ours


@pytest.mark.parametrize("changes, match", [
    ({"dtype": "bfloat16"}, "ours float32"),
    ({"block_shape": [2, 2, 4, 2, 16]}, "ours float32"),
    ({"num_blocks": 3, "nbytes": 3 * 1024}, "3 blocks for 6 tokens"),
    ({"num_tokens": 40, "prompt_len": 40, "num_blocks": 10, "nbytes": 10 * 1024},
     "whole pool"),
    ({"nbytes": 2 * 1024 + 1}, "bytes announced"),
])
def test_tcp_reply_not_matching_our_layout(kv_cache, changes, match):
    with pytest.raises(TransferError, match=match):
        check_layout(TcpFetchReply(**_tcp_reply(**changes)), kv_cache)


@pytest.mark.parametrize("prompt", [[5, 6, 7, 8, 9, 11], PROMPT[:5], []])
def test_held_kv_of_another_prompt(prompt):
    with pytest.raises(TransferError, match="different prompt"):
        check_prompt(TcpFetchReply(**_tcp_reply()), prompt)


# ---- CUDA IPC ----

def _ipc_reply(block_ids) -> dict:
    return dict(ok=True, num_tokens=6, prompt_len=6, prompt_sha256=prompt_sha256(PROMPT),
                block_ids=block_ids)


@pytest.mark.parametrize("block_ids", [[-1, 0], [0, 1 << 40], [], [0, "1"], [0, 1.5]])
def test_malformed_ipc_block_ids(pair, block_ids):
    a, b = pair
    a.sendall(_frame(json.dumps(_ipc_reply(block_ids)).encode()))
    with pytest.raises(TransferError, match="malformed IpcFetchReply"):
        recv_reply(b, IpcFetchReply)


@pytest.mark.parametrize("block_ids, match", [([0, 6], "past the KV source"),
                                              ([0], "1 block ids for 6"),
                                              ([0, 1, 2], "3 block ids")])
def test_ipc_block_ids_outside_the_source_pool(block_ids, match):
    with pytest.raises(TransferError, match=match):
        check_block_ids(IpcFetchReply(**_ipc_reply(block_ids)), 6, 4)
    check_block_ids(IpcFetchReply(**_ipc_reply([4, 5])), 6, 4)


def _ipc_tensor(**changes) -> dict:
    tensor = dict(size=[6, 4, 2, 8], stride=[64, 16, 8, 1], offset=0, dtype="float32",
                  device=0, handle="ab" * 64, storage_size_bytes=6 * 64 * 4,
                  storage_offset_bytes=0, ref_counter_handle=b"/torch_1_2_3".hex(),
                  ref_counter_offset=0, event_handle=None, event_sync_required=True)
    return {**tensor, **changes}


@pytest.mark.parametrize("changes", [
    {"dtype": "builtins.eval"}, {"handle": "not hex"}, {"handle": "ab" * 70000},
    {"size": [6, 4, 2, -8]}, {"device": -1}, {"offset": -5}, {"tensor_cls": "torch.Tensor"},
])
def test_malformed_ipc_tensor(changes):
    with pytest.raises(ValueError):
        IpcTensor.model_validate_json(json.dumps(_ipc_tensor(**changes)))


@pytest.mark.parametrize("changes, match", [
    ({"dtype": "float16"}, "ours float32"),
    ({"size": [6, 4, 2, 16], "stride": [128, 32, 16, 1]}, "blocks of"),
    ({"size": [6, 4, 2], "stride": [8, 2, 1]}, "blocks of"),
    ({"stride": [64, 16, 1, 2]}, "not contiguous"),
    ({"storage_size_bytes": 6 * 64 * 4 - 1}, "past its storage"),
    ({"offset": 1}, "past its storage"),
    ({"ref_counter_handle": b"/../../etc/passwd".hex()}, "shared-memory name"),
    ({"ref_counter_handle": b"torch_1".hex()}, "shared-memory name"),
])
def test_ipc_tensor_not_matching_our_pool(kv_cache, changes, match):
    with pytest.raises(TransferError, match=match):
        check_remote_tensor(IpcTensor(**_ipc_tensor(**changes)), kv_cache.slot_caches[0][0])


def test_ipc_pool_of_another_model_is_not_opened(kv_cache):
    layer = (IpcTensor(**_ipc_tensor()), IpcTensor(**_ipc_tensor()))
    with pytest.raises(TransferError, match="3 layers, ours 2"):
        open_pool(IpcPool(layers=[layer] * 3), kv_cache.slot_caches)
    if not torch.cuda.is_available():    # a device this host does not have
        with pytest.raises(TransferError, match="device 0"):
            open_pool(IpcPool(layers=[layer] * 2), kv_cache.slot_caches)


def test_ipc_pool_answered_with_a_pickle(pair, kv_cache, tmp_path):
    a, b = pair
    a.sendall(_frame(crafted_pickle(tmp_path / "ran")))
    with pytest.raises(TransferError, match="malformed IpcPool"):
        IpcSources()._pool(b, "127.0.0.1:1", "0" * 32, kv_cache.slot_caches)
    assert not (tmp_path / "ran").exists()


# ---- the handshake ----

SOURCE_ID = "ab" * 16


def _handshake(client_secret, server_secret):
    """(the client's result or error, the server's error or None)"""
    a, b = socket.socketpair()
    a.settimeout(5), b.settimeout(5)
    server_error = []

    def serve():
        try:
            server_handshake(b, SOURCE_ID, server_secret)
        except TransferError as exc:
            server_error.append(exc)
        finally:
            b.close()
    thread = threading.Thread(target=serve)
    thread.start()
    try:
        client = client_handshake(a, client_secret)
    except TransferError as exc:
        client = exc
    finally:
        a.close()
        thread.join(5)
    return client, (server_error or [None])[0]


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_handshake_names_the_source(secret):
    assert _handshake(secret, secret) == (SOURCE_ID, None)


@pytest.mark.parametrize("client_secret, server_secret, match", [
    (None, b"s3cret", "expects a shared secret"),
    (b"s3cret", None, "did not prove"),
    (b"s3cret", b"other", "did not prove"),
])
def test_handshake_without_the_same_secret_fails(client_secret, server_secret, match):
    client, server_error = _handshake(client_secret, server_secret)
    assert isinstance(client, TransferError) and match in str(client)


def test_context_server_refuses_a_wrong_proof(pair):
    a, b = pair
    errors = []
    thread = threading.Thread(target=lambda: _catch(errors, server_handshake, b, SOURCE_ID,
                                                    b"s3cret"))
    thread.start()
    send_message(a, _hello())
    a.recv(65536)       # its HelloReply
    a.sendall(_frame(json.dumps({"op": "auth", "proof": "0" * 64}).encode()))
    thread.join(5)
    assert "not proven" in str(errors[0])


def test_context_server_refuses_anything_but_hello(pair):
    a, b = pair
    errors = []
    thread = threading.Thread(target=lambda: _catch(errors, server_handshake, b, SOURCE_ID,
                                                    None))
    thread.start()
    a.sendall(_frame(json.dumps({"op": "fetch", "id": "x", "transport": "tcp"}).encode()))
    thread.join(5)
    assert "expected hello" in str(errors[0])
    with pytest.raises(TransferError, match="refused: expected hello"):
        recv_reply(a, TcpFetchReply)


def _hello():
    from tllm.disagg.messages import PROTOCOL_VERSION, Hello
    return Hello(version=PROTOCOL_VERSION, nonce="0" * 32)


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except TransferError as exc:
        errors.append(exc)


def test_ipc_pool_round_trips_as_plain_json():
    layer = (IpcTensor(**_ipc_tensor()), IpcTensor(**_ipc_tensor(event_handle="cd" * 64)))
    pool = IpcPool(layers=[layer, layer])
    text = pool.model_dump_json()
    assert IpcPool.model_validate_json(text) == pool
    assert json.loads(text)["layers"][0][1]["event_handle"] == "cd" * 64
