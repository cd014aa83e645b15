"""A custom all-reduce for the small messages of tensor parallelism inside one host.

NCCL's all-reduce of a few KB (one decode step's hidden states) costs more than the math it
splits. Here every rank of a tp group holds one buffer of `custom_max_bytes` in symmetric
memory (torch.distributed._symmetric_memory: mapped into every peer's address space through
CUDA IPC), and a message is reduced by torch's own kernels over those peer buffers:

- one-shot (`symm_mem::one_shot_all_reduce_copy_out`): each rank copies its input into its
  buffer, and after a barrier reads all peers' buffers and sums them; one kernel.
- two-shot (`symm_mem::two_shot_all_reduce_out`): each rank sums its 1/world slice of every
  peer's buffer (reduce-scatter), and after a barrier gathers the summed slices
  (all-gather); half the reads of one-shot per rank, one more barrier.

Both run on the current stream with no host synchronisation and keep no per-call state
besides the persistent buffer, so they are captured into CUDA graphs. Multicast (multimem)
ops are never used. Messages above `custom_max_bytes`, dtypes torch's kernels do not take
(they dispatch bfloat16 and float32) and sizes they cannot align go to NCCL; so does
everything where the custom path is unavailable (CPU, gloo, one GPU, no peer access).

`reference_all_reduce`, `one_shot_reference` and `two_shot_reference` are the pure-torch
math the GPU path is tested against."""
from __future__ import annotations

import logging
import socket

import torch

from tllm.config import AllReduceConfig

logger = logging.getLogger(__name__)

ONE_SHOT, TWO_SHOT, NCCL = "oneshot", "twoshot", "nccl"
# the dtypes torch's symm_mem all-reduce kernels dispatch
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
# two_shot_all_reduce_out is instantiated for these world sizes only
TWO_SHOT_OUT_WORLD_SIZES = (2, 4, 8)
_ALIGN_BYTES = 16   # the kernels' widest vector; slices of two-shot start on it


def pick_algorithm(nbytes: int, dtype: torch.dtype, config: AllReduceConfig,
                   is_available: bool) -> str:
    """ONE_SHOT, TWO_SHOT or NCCL for a message of `nbytes` of `dtype`. Every rank of a tp
    group reduces tensors of the same shape and dtype, so every rank picks the same."""
    itemsize = dtype.itemsize
    if (not is_available or config.strategy == NCCL or dtype not in SUPPORTED_DTYPES
            or nbytes == 0 or nbytes > config.custom_max_bytes
            or nbytes % max(4, itemsize)):   # the kernels' minimum alignment
        return NCCL
    if config.strategy in (ONE_SHOT, TWO_SHOT):
        return config.strategy
    return ONE_SHOT if nbytes <= config.one_shot_max_bytes else TWO_SHOT


# ---- the pure-torch reference (the math of the kernels) ----

def reference_all_reduce(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the ranks' tensors, accumulated in float64, in the inputs' dtype."""
    total = torch.stack([t.double() for t in tensors]).sum(0)
    return total.to(tensors[0].dtype)


def one_shot_reference(buffers: list[torch.Tensor]) -> torch.Tensor:
    """What one-shot gives every rank: all peers' buffers read and summed in rank order."""
    out = buffers[0].clone()
    for peer in range(1, len(buffers)):
        out += buffers[peer]
    return out


def two_shot_slices(numel: int, itemsize: int, world_size: int) -> list[slice]:
    """The slice of the flattened message each rank reduces in two-shot: equal parts,
    rounded up to the vector width so that every part starts aligned; the last may be
    short (or empty)."""
    per_vector = _ALIGN_BYTES // itemsize
    per_rank = -(-numel // (per_vector * world_size)) * per_vector
    return [slice(min(r * per_rank, numel), min((r + 1) * per_rank, numel))
            for r in range(world_size)]


def two_shot_reference(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's output of two-shot: reduce-scatter over the peers' buffers (rank r sums
    slice r of all of them), then all-gather of the summed slices."""
    flat = [b.reshape(-1) for b in buffers]
    slices = two_shot_slices(flat[0].numel(), flat[0].element_size(), len(buffers))
    reduced = [one_shot_reference([f[s] for f in flat]) for s in slices]
    gathered = torch.cat(reduced).view(buffers[0].shape)
    return [gathered.clone() for _ in buffers]


# ---- the CUDA path ----

class CustomAllReduce:
    """One-shot / two-shot all-reduce of a tp group over a symmetric-memory buffer. Build it
    on every rank of the group at the same point (the buffer's rendezvous is collective)."""

    def __init__(self, group, device: torch.device, config: AllReduceConfig) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        self.config = config
        self.group_name = group.group_name
        self.world_size = group.size()
        if _torch_version() < (2, 11):   # older torch must be told the group's store
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(config.custom_max_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        ops = torch.ops.symm_mem
        self._one_shot_copy = getattr(ops, "one_shot_all_reduce_copy_out", None)
        self._two_shot_out = (getattr(ops, "two_shot_all_reduce_out", None)
                              if self.world_size in TWO_SHOT_OUT_WORLD_SIZES else None)

    def algorithm(self, x: torch.Tensor) -> str:
        return pick_algorithm(x.numel() * x.element_size(), x.dtype, self.config, True)

    def all_reduce(self, x: torch.Tensor, algorithm: str | None = None) -> torch.Tensor:
        """The sum over the group of `x` (a new tensor; `x` is left as it was)."""
        algorithm = algorithm or self.algorithm(x)
        if algorithm == NCCL:
            raise ValueError(f"a {x.dtype} message of {x.numel() * x.element_size()} bytes "
                             "does not go through the custom all-reduce")
        flat = x.reshape(-1)
        staged = self.buffer[:flat.numel() * flat.element_size()].view(x.dtype)
        out = torch.empty_like(flat)
        if algorithm == ONE_SHOT:
            self._one_shot(flat, staged, out)
        else:
            self._two_shot(flat, staged, out)
        return out.view(x.shape)

    def _one_shot(self, flat: torch.Tensor, staged: torch.Tensor, out: torch.Tensor) -> None:
        # the fused copy needs the input aligned as the buffer is (offset 0)
        if self._one_shot_copy is not None and flat.storage_offset() == 0:
            self._one_shot_copy(staged, flat, "sum", self.group_name, out)
            return
        staged.copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out)

    def _two_shot(self, flat: torch.Tensor, staged: torch.Tensor, out: torch.Tensor) -> None:
        staged.copy_(flat)
        if self._two_shot_out is not None:
            self._two_shot_out(staged, "sum", self.group_name, out)
            return
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
        out.copy_(staged)


def unavailable_reason(config: AllReduceConfig, device: torch.device, group_size: int,
                       peers: list[tuple[str, int]]) -> str | None:
    """Why the custom path cannot run for this rank's tp group (None: it can). `peers` is
    (hostname, CUDA device index) of every rank of the group."""
    if config.strategy == NCCL:
        return "allreduce_config.strategy is 'nccl'"
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    if group_size < 2:
        return "the tp group has one rank"
    if config.custom_max_bytes == 0:
        return "allreduce_config.custom_max_bytes is 0"
    if len({host for host, _ in peers}) > 1:
        return "the tp group spans hosts"
    if not _has_symm_mem_ops():
        return f"torch {torch.__version__} has no symmetric-memory all-reduce ops"
    mine = device.index if device.index is not None else torch.cuda.current_device()
    for _, other in peers:
        if other != mine and not torch.cuda.can_device_access_peer(mine, other):
            return f"GPU {mine} has no peer access to GPU {other}"
    return None


def peer_identity(device: torch.device) -> tuple[str, int]:
    index = device.index if device.index is not None else -1
    return socket.gethostname(), index


def _has_symm_mem_ops() -> bool:
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401
    except ImportError:
        return False
    ops = torch.ops.symm_mem
    return all(hasattr(ops, name) for name in ("one_shot_all_reduce_out",
                                               "two_shot_all_reduce_"))


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)
