"""The KV transfer protocol's messages, each a pydantic model a reader validates field by
field (unknown fields, wrong types and numbers out of bounds are refused) before it acts on
one. Only plain data travels: numbers, strings, lists and bytes written as hex. The order of
a conversation is in tllm/disagg/wire.py."""
from __future__ import annotations

import hashlib
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter

PROTOCOL_VERSION = 2
MAX_BLOCKS = 1 << 24            # blocks of one pool or one transfer
MAX_DIM = 1 << 20               # any other dimension of a KV block
MAX_LAYERS = 4096               # (key, value) pairs of a KV pool
MAX_HANDLE_BYTES = 64 << 10     # one CUDA IPC handle (an expandable segment's is longer)

Nonce = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
Proof = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
# A context server's KV source id: random per engine start, named in requests instead of
# its address.
SourceId = Nonce
ExportId = Annotated[str, StringConstraints(min_length=1, max_length=256)]
Sha256 = Proof
HexBytes = Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{2})+$",
                                            max_length=2 * MAX_HANDLE_BYTES)]
Count = Annotated[int, Field(ge=0, le=1 << 62)]
# The KV cache dtypes a block may have (a name outside this list is refused).
KVDtype = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8",
                  "uint8"]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# ---- generation -> context ----

class Hello(Message):
    op: Literal["hello"] = "hello"
    version: int
    nonce: Nonce


class Auth(Message):
    op: Literal["auth"] = "auth"
    proof: Proof


class Fetch(Message):
    """The blocks held under `id` (tcp: their bytes; cuda_ipc: their ids in the pool)."""
    op: Literal["fetch"] = "fetch"
    id: ExportId
    transport: Literal["tcp", "cuda_ipc"]


class Release(Message):
    op: Literal["release"] = "release"
    id: ExportId


class PoolRequest(Message):
    """(cuda_ipc) The context server's KV pool as CUDA IPC handles."""
    op: Literal["ipc_pool"] = "ipc_pool"


AnyRequest = TypeAdapter(Annotated[Union[Hello, Auth, Fetch, Release, PoolRequest],
                                   Field(discriminator="op")])


# ---- context -> generation ----

class Refusal(Message):
    ok: Literal[False] = False
    error: Annotated[str, StringConstraints(max_length=1000)]


class HelloReply(Message):
    ok: Literal[True] = True
    version: int
    source_id: SourceId
    nonce: Nonce
    proof: Proof | None     # with a shared secret: the context server knows it


class Released(Message):
    ok: bool


class HeldPrompt(Message):
    """What the held KV is of: `num_tokens` tokens of a prompt of `prompt_len` tokens
    (the generation side checks its own prompt has the same first `prompt_len` tokens)."""
    ok: Literal[True] = True
    num_tokens: Annotated[int, Field(ge=1, le=MAX_BLOCKS * MAX_DIM)]
    prompt_len: Annotated[int, Field(ge=1, le=MAX_BLOCKS * MAX_DIM)]
    prompt_sha256: Sha256


class TcpFetchReply(HeldPrompt):
    """Followed by `nbytes` of blocks [num_blocks, *block_shape] of `dtype`."""
    dtype: KVDtype
    block_shape: Annotated[list[Annotated[int, Field(ge=1, le=MAX_DIM)]],
                           Field(min_length=5, max_length=5)]
    num_blocks: Annotated[int, Field(ge=1, le=MAX_BLOCKS)]
    nbytes: Annotated[int, Field(ge=1, le=1 << 46)]


class IpcFetchReply(HeldPrompt):
    """The blocks' ids in the context server's pool (opened through IpcPool)."""
    block_ids: Annotated[list[Annotated[int, Field(ge=0, lt=MAX_BLOCKS)]],
                         Field(min_length=1, max_length=MAX_BLOCKS)]


class IpcTensor(Message):
    """One KV pool tensor as CUDA IPC shares it: the fields of
    torch.multiprocessing.reductions.reduce_tensor's answer that are data (the classes and
    the function that rebuilds it are chosen by the receiver, never sent)."""
    size: Annotated[list[Annotated[int, Field(ge=1, le=MAX_BLOCKS)]],
                    Field(min_length=1, max_length=8)]
    stride: Annotated[list[Count], Field(min_length=1, max_length=8)]
    offset: Count
    dtype: KVDtype
    device: Annotated[int, Field(ge=0, le=1023)]
    handle: HexBytes
    storage_size_bytes: Count
    storage_offset_bytes: Count
    ref_counter_handle: HexBytes
    ref_counter_offset: Count
    event_handle: HexBytes | None
    event_sync_required: bool


class IpcPool(Message):
    ok: Literal[True] = True
    layers: Annotated[list[tuple[IpcTensor, IpcTensor]], Field(min_length=1,
                                                               max_length=MAX_LAYERS)]


def prompt_sha256(token_ids: list[int]) -> str:
    """The digest both sides compare to know they hold the same prompt."""
    import numpy as np
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()
