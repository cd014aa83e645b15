"""Process groups and the few collectives the model and the executor need, over
torch.distributed: NCCL between GPUs, gloo on the CPU. Step plans (small Python objects)
always travel over a gloo group, so that the host never waits on a GPU stream for them.

One process holds one rank; `init_distributed` records its Mapping and groups here, and the
parallel layers read them while they are built and run. Without it every helper is the
single-rank identity."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tllm.distributed.mapping import Mapping


@dataclass
class ParallelState:
    mapping: Mapping
    device: torch.device
    tp_group: object | None = None     # device-side groups (NCCL on CUDA, gloo on CPU)
    pp_group: object | None = None
    cpu_group: object | None = None    # gloo, all ranks: step plans and small host values
    # the one-/two-shot all-reduce over peer memory (None: NCCL or gloo for every message)
    custom_all_reduce: object | None = None


_STATE: ParallelState | None = None
# renamed in torch 2.13; the GPU image has 2.11
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def state() -> ParallelState | None:
    return _STATE


def mapping() -> Mapping:
    return _STATE.mapping if _STATE is not None else Mapping.single()


def tp_rank_and_size() -> tuple[int, int]:
    m = mapping()
    return m.tp_rank, m.tp_size


def init_distributed(mapping_: Mapping, device: torch.device, init_method: str | None,
                     timeout_s: float = 600.0, store=None) -> ParallelState:
    """Join the process group as `mapping_.rank` (through `init_method`, or an existing
    rendezvous `store`) and build the tp, pp and plan groups."""
    global _STATE
    if _STATE is not None:
        raise RuntimeError("this process already holds a rank; shut the other LLM down first")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # A dead peer should fail the collective, not kill this process (the driver must
        # outlive its workers to report the error).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, store=store,
                            world_size=mapping_.world_size, rank=mapping_.rank, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    st = ParallelState(mapping_, device)
    # every rank must create every group, in the same order
    for ranks in Mapping.all_tp_groups(mapping_.tp_size, mapping_.pp_size):
        group = dist.new_group(ranks, backend=backend)
        if mapping_.rank in ranks:
            st.tp_group = group
    for ranks in Mapping.all_pp_groups(mapping_.tp_size, mapping_.pp_size):
        group = dist.new_group(ranks, backend=backend)
        if mapping_.rank in ranks:
            st.pp_group = group
    st.cpu_group = (dist.group.WORLD if backend == "gloo"
                    else dist.new_group(backend="gloo", timeout=timeout))
    _STATE = st
    return st


def destroy_distributed(timeout_s: float = 10.0) -> None:
    """Leave the process group. Bounded: NCCL's teardown can wait forever on a peer that
    has already exited, and shutting down must not hang."""
    global _STATE
    if _STATE is not None:
        _STATE.custom_all_reduce = None   # its peer buffer goes before the group does
    if _STATE is not None and dist.is_initialized():
        import threading
        thread = threading.Thread(target=dist.destroy_process_group, daemon=True)
        thread.start()
        thread.join(timeout_s)
    _STATE = None


# ---- collectives used by the layers (identity on one rank) ----

def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the tp group: the custom all-reduce for small messages where it
    runs, else NCCL (gloo on the CPU) in place. Use the returned tensor."""
    if _STATE is None or _STATE.mapping.tp_size == 1:
        return x
    custom = _STATE.custom_all_reduce
    if custom is not None:
        algorithm = custom.algorithm(x)
        if algorithm != "nccl":
            return custom.all_reduce(x, algorithm)
    dist.all_reduce(x, group=_STATE.tp_group)
    return x


def setup_all_reduce(config) -> str | None:
    """Build the custom all-reduce of this rank's tp group when it can run on every rank
    (`config`: an AllReduceConfig). Collective: every rank calls it at the same point.
    Returns why it is off (None: on)."""
    from tllm.distributed import custom_allreduce as car
    st = _STATE
    if st is None:
        return "one rank"
    # every rank learns every tp peer's host and GPU, then all must agree to switch on
    identities = [None] * st.mapping.world_size
    dist.all_gather_object(identities, car.peer_identity(st.device), group=st.cpu_group)
    peers = [identities[r] for r in st.mapping.tp_group]
    reason = car.unavailable_reason(config, st.device, st.mapping.tp_size, peers)
    if not all_reduce_min(int(reason is None)):
        return reason or "another rank cannot run it"
    try:
        custom = car.CustomAllReduce(st.tp_group, st.device, config)
    except RuntimeError as exc:   # e.g. no CUDA IPC in this container
        reason, custom = f"symmetric memory failed: {exc}", None
    if not all_reduce_min(int(custom is not None)):
        return reason or "another rank could not map the peer buffers"
    st.custom_all_reduce = custom
    return None


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every tp rank's `x` along `dim`, in rank order."""
    if _STATE is None or _STATE.mapping.tp_size == 1:
        return x
    size = _STATE.mapping.tp_size
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous(), group=_STATE.tp_group)
    return torch.cat(out.view(size, *x.shape).unbind(0), dim=dim)


def tp_broadcast_from_driver(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank of the first stage (its tp group)."""
    if _STATE is None or _STATE.mapping.tp_size == 1:
        return x
    dist.broadcast(x, src=0, group=_STATE.tp_group)
    return x


# ---- pipeline stage hand-offs ----

def send_to_next_stage(tensors: list[torch.Tensor]) -> list:
    """Start sending to the same tp rank of the next stage; returns the works."""
    dst = _STATE.mapping.next_stage_rank
    return [dist.isend(t.contiguous(), dst=dst, group=_STATE.pp_group) for t in tensors]


def recv_from_prev_stage(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    src = _STATE.mapping.prev_stage_rank
    out = [torch.empty(s, dtype=dtype, device=_STATE.device) for s in shapes]
    for work in [dist.irecv(t, src=src, group=_STATE.pp_group) for t in out]:
        work.wait()
    return out


def send_to_driver(x: torch.Tensor):
    """The last stage hands its logits to rank 0, which samples."""
    return dist.isend(x.contiguous(), dst=0)


def recv_from_last_stage(shape: tuple[int, ...], dtype: torch.dtype):
    src = (_STATE.mapping.pp_size - 1) * _STATE.mapping.tp_size
    out = torch.empty(shape, dtype=dtype, device=_STATE.device)
    return out, dist.irecv(out, src=src)


# ---- step plans (host objects) ----

def broadcast_object(obj=None):
    """Rank 0's `obj` on every rank, over the gloo group."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_STATE.cpu_group)
    return box[0]


def all_reduce_min(value: int) -> int:
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_STATE.cpu_group)
    return int(t.item())


def abandon_distributed() -> None:
    """After a rank died: collectives with it may hang, so give the teardown little time."""
    destroy_distributed(timeout_s=5.0)
