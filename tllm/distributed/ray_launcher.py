"""Starting the other ranks as Ray actors (`LlmArgs.orchestrator="ray"`), one per rank,
placed by Ray; this process stays rank 0, as with the local launcher.

Placement: one placement-group bundle per rank, {"GPU": 1} on CUDA ({"CPU": 1} on the CPU),
strategy PACK by default, so Ray fills a node's GPUs before it spills to the next node of the
cluster. Bundle 0 is pinned to this (the driver's) node for rank 0; on CUDA an idle actor holds
that bundle's GPU, and rank 0 uses the same GPU, so that Ray never hands it to another rank.
Ranks 1..world_size-1 each run in an actor that sees only its own GPU (Ray sets
CUDA_VISIBLE_DEVICES), i.e. cuda:0, and runs the same code as a spawned worker (the
caller's `run_worker`, `tllm.executor.worker.run_worker` for the LLM).

Rendezvous: torch.distributed over `tcp://<rank 0's node IP>:<free port>`, so every node must
reach that address; NCCL (gloo on the CPU) then talks over the network between nodes and over
NVLink/PCIe within one. tllm must be importable on every node (installed, or shipped with the
cluster's runtime_env).

Environment: the actors get the driver's NCCL_*, TORCH_NCCL_*, GLOO_*, HF_* and TRITON_*
variables and the multicast switches (NCCL_NVLS_ENABLE, TORCH_SYMM_MEM_DISABLE_MULTICAST,
NVSHMEM_DISABLE_NVLS) through the actors' runtime_env env_vars; set them in the driver's
environment, not on the nodes.

Ray itself: an already initialised Ray is used as is; otherwise `ray.init(address="auto")`
joins a running cluster (RAY_ADDRESS, or one started on this node with `ray start`), and
without one a local Ray is started, which shutdown stops again."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tllm.distributed import comm
from tllm.distributed.launch import WorkerGroup
from tllm.distributed.mapping import Mapping

logger = logging.getLogger(__name__)

_FORWARDED_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "HF_", "TRITON_")
_FORWARDED_ENV_NAMES = ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
_PLACEMENT_TIMEOUT_S = 300.0  # waiting for the cluster to have a free slot per rank
_ACTOR_START_TIMEOUT_S = 300.0


@ray.remote
class RankActor:
    """One rank in a Ray actor: idle until `run`, which serves steps until rank 0 stops."""

    def gpu_id(self) -> str | None:
        ids = ray.get_gpu_ids()
        return str(ids[0]) if ids else None

    def run(self, spec: dict, run_worker: Callable[..., None]) -> None:
        from tllm.config import LlmArgs
        args = LlmArgs.model_validate(spec["args"])
        mapping = Mapping(spec["world_size"], spec["tp_size"], spec["pp_size"], spec["rank"],
                          args.enable_expert_parallel)
        device = torch.device("cuda", 0) if spec["device_type"] == "cuda" else torch.device("cpu")
        comm.init_distributed(mapping, device, spec["init_method"])
        try:
            run_worker(args, device)
        except BaseException:
            comm.abandon_distributed()
            raise
        comm.destroy_distributed()


def launch_ray_workers(args, mapping: Mapping, device: torch.device,
                       run_worker: Callable[..., None],
                       strategy: str = "PACK") -> RayWorkerGroup:
    """Start ranks 1.. as Ray actors and join them as rank 0 (this process)."""
    owns_ray = _connect()
    host = ray.util.get_node_ip_address()
    pg = _reserve(mapping.world_size, device.type, host, strategy)
    group = RayWorkerGroup(pg, device, owns_ray)
    try:
        if device.type == "cuda":
            group.device = _driver_gpu(group.start_actor(0))
        actors = [group.start_actor(rank) for rank in range(1, mapping.world_size)]
        ray.get([a.gpu_id.remote() for a in actors], timeout=_ACTOR_START_TIMEOUT_S)
        init_method = f"tcp://{host}:{_free_port()}"
        for rank, actor in enumerate(actors, start=1):
            group.run(rank, actor, _spec(args, mapping.with_rank(rank), init_method, device),
                      run_worker)
        comm.init_distributed(mapping, group.device, init_method)
    except BaseException:
        group.shutdown(clean=False)
        raise
    return group


def _connect() -> bool:
    """Join (or start) Ray; True when this call started a local instance."""
    if ray.is_initialized():
        return False
    try:
        ray.init(address="auto")
        return False
    except ConnectionError:
        if os.environ.get("RAY_ADDRESS"):  # a cluster was asked for: don't start another
            raise
        ray.init()
        return True


def _reserve(world_size: int, device_type: str, host: str, strategy: str):
    slot = {"GPU": 1} if device_type == "cuda" else {"CPU": 1}
    # bundle 0 on this node: rank 0 is this process
    bundles = [{**slot, f"node:{host}": 0.001}] + [dict(slot) for _ in range(world_size - 1)]
    pg = placement_group(bundles, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=_PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(f"Ray could not place {world_size} ranks ({slot} each, one on this "
                           f"node) within {_PLACEMENT_TIMEOUT_S:.0f} s; cluster resources: "
                           f"{ray.cluster_resources()}") from None
    return pg


def _driver_gpu(slot_holder) -> torch.device:
    """The GPU Ray reserved for rank 0, as this process numbers it."""
    gpu = ray.get(slot_holder.gpu_id.remote(), timeout=_ACTOR_START_TIMEOUT_S)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = visible.split(",").index(gpu) if visible else int(gpu)
    return torch.device("cuda", index)


def _spec(args, mapping: Mapping, init_method: str, device: torch.device) -> dict:
    return {"args": args.model_dump(mode="json"), "world_size": mapping.world_size,
            "tp_size": mapping.tp_size, "pp_size": mapping.pp_size, "rank": mapping.rank,
            "init_method": init_method, "device_type": device.type}


def _forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k.startswith(_FORWARDED_ENV_PREFIXES) or k in _FORWARDED_ENV_NAMES}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RayWorkerGroup(WorkerGroup):
    """The other ranks as Ray actors: watched through their `run` refs, killed at shutdown.
    The stop protocol is WorkerGroup's; there are no child processes to wait for."""

    def __init__(self, pg, device: torch.device, owns_ray: bool) -> None:
        super().__init__([], device)
        self.actors: list = []           # every actor started, rank 0's GPU holder included
        self._runs: dict = {}            # ObjectRef of a rank's `run` -> rank
        self._pg = pg
        self._owns_ray = owns_ray
        self._watchers: list[threading.Thread] = []

    def start_actor(self, rank: int):
        is_cuda = self.device.type == "cuda"
        actor = RankActor.options(
            num_cpus=0 if is_cuda else 1, num_gpus=1 if is_cuda else 0,
            runtime_env={"env_vars": _forwarded_env()},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank),
        ).remote()
        self.actors.append(actor)
        return actor

    def run(self, rank: int, actor, spec: dict, run_worker: Callable[..., None]) -> None:
        self._runs[actor.run.remote(spec, run_worker)] = rank

    def dead_worker_error(self, grace_s: float = 0.0) -> Exception | None:
        """The error to report if a rank's actor died or its run failed; waits up to
        `grace_s` for that to show."""
        deadline = time.monotonic() + grace_s
        while True:
            if self._dead is None and not self._stopping and self._runs:
                refs = list(self._runs)
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                if done:
                    self._dead = _run_error(self._runs[done[0]], done[0])
            if self._dead is not None or time.monotonic() >= deadline:
                return self._dead
            time.sleep(0.05)

    def watch(self, on_death) -> None:
        """Call `on_death(error)` from a watcher thread when a rank's run ends early."""
        def watcher() -> None:
            refs = list(self._runs)
            while not self._stopping:
                done, _ = ray.wait(refs, num_returns=1, timeout=0.5)
                if done and not self._stopping:
                    error = self.dead_worker_error()
                    if error is not None:
                        logger.error("%s", error)
                        on_death(error)
                    return

        thread = threading.Thread(target=watcher, name="tllm-ray-watch", daemon=True)
        thread.start()
        self._watchers.append(thread)

    def shutdown(self, clean: bool = True) -> None:
        """Stop the ranks (when they can still hear it), then kill every actor, free the
        placement group, and stop Ray if this group started it."""
        super().shutdown(clean)
        for thread in self._watchers:
            thread.join()
        if self._runs:
            refs = list(self._runs)
            ray.wait(refs, num_returns=len(refs), timeout=30 if clean else 2)
        for actor in self.actors:  # an actor outlives its run: it is a Ray worker process
            ray.kill(actor, no_restart=True)
        remove_placement_group(self._pg)
        if self._owns_ray:
            ray.shutdown()


def _run_error(rank: int, ref) -> RuntimeError:
    try:
        ray.get(ref, timeout=0)
        detail = "its run returned before rank 0 stopped it"
    except ray.exceptions.RayError as exc:  # RayActorError if killed, RayTaskError if raised
        detail = str(exc)
    return RuntimeError(f"tllm worker rank {rank} (Ray actor) failed: {detail}")
