"""CUDA IPC transport (two processes on one GPU host): the generation server opens the
context server's KV pool once through CUDA IPC handles, and a request's KV moves with one
device-to-device gather/scatter per layer when the request is admitted. The context server
frees its blocks once that copy has finished (an event recorded after it).

The handles travel as plain data (messages.IpcTensor: the data fields of torch's
`reduce_tensor`); the receiver checks each against its own pool's layout and rebuilds the
tensor with torch's `rebuild_cuda_tensor`, chosen here, never named by the wire."""
from __future__ import annotations

import inspect
import re
import socket
import threading
from typing import Callable

import torch

from tllm.disagg.messages import IpcFetchReply, IpcPool, IpcTensor, PoolRequest
from tllm.disagg.wire import TransferError, dtype_name, recv_reply, send_message

# torch's rebuild_cuda_tensor, in the order it takes them (checked before use)
REBUILD_PARAMETERS = ("tensor_cls", "tensor_size", "tensor_stride", "tensor_offset",
                      "storage_cls", "dtype", "storage_device", "storage_handle",
                      "storage_size_bytes", "storage_offset_bytes", "requires_grad",
                      "ref_counter_handle", "ref_counter_offset", "event_handle",
                      "event_sync_required")
# a ref counter is a shared-memory file of the context server's: one name, no path
_SHM_NAME = re.compile(rb"^/[A-Za-z0-9_.-]{1,200}$")

RemotePool = list[tuple[torch.Tensor, torch.Tensor]]


# ---- the context server ----

def describe_pool(slot_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> IpcPool:
    """Every (key, value) pool tensor's IPC handles, as plain data."""
    if slot_caches[0][0].device.type != "cuda":
        raise TransferError("transport cuda_ipc: this context server's KV cache is not on a "
                            "GPU")
    return IpcPool(layers=[(describe_tensor(k), describe_tensor(v)) for k, v in slot_caches])


def describe_tensor(tensor: torch.Tensor) -> IpcTensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor
    rebuild, args = reduce_tensor(tensor)
    if rebuild is not rebuild_cuda_tensor or len(args) != len(REBUILD_PARAMETERS):
        raise TransferError("transport cuda_ipc: this torch shares CUDA tensors in a way "
                            "tllm does not know")
    fields = dict(zip(REBUILD_PARAMETERS, args))
    return IpcTensor(
        size=list(fields["tensor_size"]), stride=list(fields["tensor_stride"]),
        offset=fields["tensor_offset"], dtype=dtype_name(fields["dtype"]),
        device=fields["storage_device"], handle=fields["storage_handle"].hex(),
        storage_size_bytes=fields["storage_size_bytes"],
        storage_offset_bytes=fields["storage_offset_bytes"],
        ref_counter_handle=fields["ref_counter_handle"].hex(),
        ref_counter_offset=fields["ref_counter_offset"],
        event_handle=None if fields["event_handle"] is None else fields["event_handle"].hex(),
        event_sync_required=bool(fields["event_sync_required"]))


# ---- the generation server ----

def check_remote_tensor(remote: IpcTensor, local: torch.Tensor) -> None:
    """A remote pool tensor must have our pool's dtype and block layout, be contiguous, lie
    inside the storage it names, and name a device of this host (TransferError if not)."""
    if remote.dtype != dtype_name(local.dtype):
        raise TransferError(f"the KV source's pool is {remote.dtype}, ours "
                            f"{dtype_name(local.dtype)}")
    if len(remote.size) != local.dim() or remote.size[1:] != list(local.shape[1:]):
        raise TransferError(f"the KV source's pool has blocks of {remote.size[1:]}, ours "
                            f"{list(local.shape[1:])}")
    if remote.stride != _contiguous_strides(remote.size):
        raise TransferError("the KV source's pool tensor is not contiguous")
    numel = 1
    for dim in remote.size:
        numel *= dim
    if (remote.offset + numel) * local.element_size() > remote.storage_size_bytes:
        raise TransferError("the KV source's pool tensor runs past its storage")
    if not _SHM_NAME.match(bytes.fromhex(remote.ref_counter_handle)):
        raise TransferError("the KV source's IPC reference counter is not a shared-memory "
                            "name")
    if remote.device >= torch.cuda.device_count():
        raise TransferError(f"the KV source's pool is on device {remote.device}, which this "
                            "host does not have")


def _contiguous_strides(size: list[int]) -> list[int]:
    strides, step = [], 1
    for dim in reversed(size):
        strides.append(step)
        step *= dim
    return strides[::-1]


def rebuild_remote_tensor(remote: IpcTensor, local: torch.Tensor) -> torch.Tensor:
    """The context server's pool tensor, opened through its IPC handle (checked first)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    check_remote_tensor(remote, local)
    if tuple(inspect.signature(rebuild_cuda_tensor).parameters) != REBUILD_PARAMETERS:
        raise TransferError("transport cuda_ipc: this torch rebuilds CUDA tensors in a way "
                            "tllm does not know")
    event = None if remote.event_handle is None else bytes.fromhex(remote.event_handle)
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(remote.size), tuple(remote.stride), remote.offset,
        torch.storage.TypedStorage, local.dtype, remote.device, bytes.fromhex(remote.handle),
        remote.storage_size_bytes, remote.storage_offset_bytes, False,
        bytes.fromhex(remote.ref_counter_handle), remote.ref_counter_offset, event,
        remote.event_sync_required)


def open_pool(pool: IpcPool, slot_caches: list[tuple[torch.Tensor, torch.Tensor]]
              ) -> RemotePool:
    if len(pool.layers) != len(slot_caches):
        raise TransferError(f"the KV source's pool has {len(pool.layers)} layers, ours "
                            f"{len(slot_caches)}")
    for (remote_k, remote_v), (k, _) in zip(pool.layers, slot_caches):
        check_remote_tensor(remote_k, k)
        check_remote_tensor(remote_v, k)
        if remote_v.size[0] != remote_k.size[0]:
            raise TransferError("the KV source's key and value pools differ in size")
    return [(rebuild_remote_tensor(rk, k), rebuild_remote_tensor(rv, v))
            for (rk, rv), (k, v) in zip(pool.layers, slot_caches)]


def check_block_ids(reply: IpcFetchReply, num_remote_blocks: int,
                    tokens_per_block: int) -> None:
    """As many block ids as the tokens need, each inside the KV source's pool."""
    if len(reply.block_ids) != -(-reply.num_tokens // tokens_per_block):
        raise TransferError(f"{len(reply.block_ids)} block ids for {reply.num_tokens} tokens")
    if max(reply.block_ids) >= num_remote_blocks:
        raise TransferError(f"a block id past the KV source's {num_remote_blocks} blocks")


class IpcImportedKV:
    """KV still in the context server's pool, copied over at admission."""

    def __init__(self, num_tokens: int, remote: RemotePool, block_ids: list[int],
                 on_copied: Callable[[torch.cuda.Event], None]) -> None:
        self.num_tokens = num_tokens
        self.remote = remote
        self.block_ids = block_ids
        self._on_copied = on_copied
        self._is_pending = True

    @property
    def is_pending(self) -> bool:
        return self._is_pending

    def write_into(self, kv_cache, block_ids: list[int]) -> None:
        device = kv_cache.slot_caches[0][0].device
        src = torch.tensor(self.block_ids, dtype=torch.long, device=device)
        dst = torch.tensor(block_ids, dtype=torch.long, device=device)
        for (remote_k, remote_v), (k, v) in zip(self.remote, kv_cache.slot_caches):
            k.index_copy_(0, dst, remote_k.index_select(0, src))
            v.index_copy_(0, dst, remote_v.index_select(0, src))
        self._done()

    def discard(self) -> None:
        if self._is_pending:
            self._done()

    def _done(self) -> None:
        self._is_pending = False
        event = torch.cuda.Event()
        event.record()
        self._on_copied(event)


class IpcSources:
    """Context servers' pools opened through CUDA IPC, once per endpoint and source id (a
    restarted context server has a new id, and a new pool)."""

    def __init__(self) -> None:
        self._opened: dict[str, tuple[str, RemotePool]] = {}   # endpoint -> (source id, pool)
        self._lock = threading.Lock()

    def imported(self, sock: socket.socket, endpoint: str, source_id: str,
                 reply: IpcFetchReply, slot_caches, tokens_per_block: int,
                 on_copied: Callable[[torch.cuda.Event], None]) -> IpcImportedKV:
        if slot_caches[0][0].device.type != "cuda":
            raise TransferError("transport cuda_ipc: this server's KV cache is not on a GPU")
        remote = self._pool(sock, endpoint, source_id, slot_caches)
        check_block_ids(reply, remote[0][0].shape[0], tokens_per_block)
        return IpcImportedKV(reply.num_tokens, remote, list(reply.block_ids), on_copied)

    def _pool(self, sock: socket.socket, endpoint: str, source_id: str,
              slot_caches) -> RemotePool:
        with self._lock:
            opened = self._opened.get(endpoint)
            if opened is None or opened[0] != source_id:
                send_message(sock, PoolRequest())
                self._opened[endpoint] = (source_id, open_pool(recv_reply(sock, IpcPool),
                                                               slot_caches))
            return self._opened[endpoint][1]
