"""A trainer's weights to the engine's ranks over a process group of their own (RL
rollouts; SGLang's and vLLM's `init_weight_update_group` / `update_weights_from_distributed`):
the trainer is rank 0 and hosts the rendezvous store, the engine's ranks follow
(`rank_offset` + their tensor-parallel rank); each tensor is one broadcast from rank 0.

The group stands apart from torch.distributed's default group (the engine's own ranks may
have one): its store and its gloo (CPU) or NCCL (GPU) process group are made here and
used directly, never registered as the default. Only tensors cross it, never pickles."""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
JOIN_TIMEOUT = datetime.timedelta(seconds=120)


@dataclass
class WeightGroup:
    """A process group, the store it met through (which must outlive it), and the device
    its tensors travel on."""

    process_group: object
    store: object
    device: torch.device

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.process_group.broadcast(tensor, 0).wait()


def join_group(master_address: str, master_port: int, rank: int, world_size: int,
               group_name: str, backend: str, device: torch.device,
               timeout: datetime.timedelta = JOIN_TIMEOUT) -> WeightGroup:
    """This process's member of the group (rank 0 hosts the store); blocks until every
    rank has joined."""
    check_group_args(master_address, master_port, rank, world_size, group_name, backend)
    store = dist.TCPStore(master_address, int(master_port), world_size,
                          is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore(f"tllm-weights/{group_name}/", store)
    if backend == "nccl":
        if device.type != "cuda":
            raise ValueError("backend: nccl needs the engine on a CUDA device; use gloo")
        return WeightGroup(dist.ProcessGroupNCCL(store, rank, world_size), store, device)
    return WeightGroup(dist.ProcessGroupGloo(store, rank, world_size, timeout), store,
                       torch.device("cpu"))


def trainer_group(master_address: str, master_port: int, world_size: int,
                  group_name: str = "weights", backend: str = "gloo") -> WeightGroup:
    """The trainer's side (rank 0) of the group an engine joins with
    `LLM.init_weight_update_group(master_address, master_port, 1, world_size, ...)`."""
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
    return join_group(master_address, master_port, 0, world_size, group_name, backend,
                      device)


def send(group: WeightGroup, tensors: Iterable[torch.Tensor]) -> None:
    """The trainer's tensors to every engine rank, in the order of the engine's names."""
    for tensor in tensors:
        group.broadcast(tensor.detach().to(group.device).contiguous())


def receive(group: WeightGroup, names: list[str], dtypes: list, shapes: list,
            device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) as each broadcast arrives (one tensor in memory at a time)."""
    return _receive_each(group, check_specs(names, dtypes, shapes), device)


def check_specs(names: list[str], dtypes: list, shapes: list
                ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of each tensor to receive; ValueError naming a bad one."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes must have the same length, got "
                         f"{len(names)}, {len(dtypes)} and {len(shapes)}")
    if not all(isinstance(name, str) and name for name in names):
        raise ValueError("names must be non-empty strings (HF checkpoint names)")
    return [(name, parse_dtype(dtype), _shape(shape))
            for name, dtype, shape in zip(names, dtypes, shapes)]


def _receive_each(group: WeightGroup, specs: list, device: torch.device
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, dtype, shape in specs:
        tensor = torch.empty(shape, dtype=dtype, device=group.device)
        group.broadcast(tensor)
        yield name, tensor.to(device)


def leave_group(group: WeightGroup) -> None:
    shutdown = getattr(group.process_group, "shutdown", None)
    if shutdown is not None:
        shutdown()


def parse_dtype(dtype) -> torch.dtype:
    """A torch.dtype, or its name ("bfloat16", "torch.float32")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtypes: {dtype!r} is not a torch dtype")
    return value


def _shape(shape) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or not all(
            isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"shapes: {shape!r} is not a list of non-negative ints")
    return tuple(shape)


def check_group_args(master_address: str, master_port: int, rank: int, world_size: int,
           group_name: str, backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not isinstance(master_address, str) or not master_address:
        raise ValueError(f"master_address must be a host name, got {master_address!r}")
    if not isinstance(master_port, int) or not 0 < master_port < 65536:
        raise ValueError(f"master_port must be a port number, got {master_port!r}")
    if not isinstance(world_size, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank_offset and world_size: rank {rank} is outside a world of "
                         f"{world_size}")
    if not isinstance(group_name, str) or not group_name:
        raise ValueError(f"group_name must be a non-empty string, got {group_name!r}")
