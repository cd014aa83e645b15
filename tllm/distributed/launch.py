"""Starting the ranks. This process is always rank 0 (the driver: scheduler, sampler, its own
shard); the others run `tllm.executor.worker`.

- Single host (default): spawn one process per other rank, rendezvous over a local TCP port.
- torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK): every
  process runs the user's script; torch's env:// rendezvous joins them, across hosts too.
  `LLM(...)` returns on rank 0 only; on the others it serves steps until rank 0 shuts down
  and then exits the process.
- Ray: see `tllm.distributed.ray_launcher` (one actor per GPU, placed by Ray).

What a worker runs is the caller's `WorkerEntry`: the launchers start ranks, they do not
know what a rank does (that lives in the executor, a layer above)."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from tllm.distributed import comm
from tllm.distributed.mapping import Mapping
from tllm.distributed.rendezvous import RENDEZVOUS_TIMEOUT, ready_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerEntry:
    """What a worker rank runs: `run(args, device)` in this interpreter (torchrun ranks, Ray
    actors), or `python -m <module> SPEC` in a spawned one (the local launcher)."""
    module: str
    run: Callable[..., None]


def torchrun_env(world_size: int) -> tuple[int, int] | None:
    """(rank, local_rank) when launched by torchrun (or an equivalent) for this world."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {world_size}, but "
                         f"the launcher started WORLD_SIZE={os.environ['WORLD_SIZE']} processes")
    return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"rank {local_rank} needs GPU {local_rank}, but only "
                         f"{torch.cuda.device_count()} are visible")
    return torch.device("cuda", local_rank)


def launch_workers(args, mapping: Mapping, device: torch.device,
                   entry: WorkerEntry) -> WorkerGroup:
    """Start ranks 1.. as local processes (or join a torchrun world) and become rank 0."""
    env = torchrun_env(mapping.world_size)
    if env is not None:
        rank, local_rank = env
        device = rank_device(device, local_rank)
        comm.init_distributed(mapping.with_rank(rank), device, "env://")
        if rank != 0:
            entry.run(args, device)
            comm.destroy_distributed()
            raise SystemExit(0)
        return WorkerGroup([], device)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    processes = [_spawn_worker(entry.module, args, mapping.with_rank(rank), init_method,
                               rank_device(device, rank))
                 for rank in range(1, mapping.world_size)]
    group = WorkerGroup(processes, rank_device(device, 0))
    try:
        _rendezvous_watching(group, mapping, init_method)
    except BaseException:
        group.shutdown(clean=False)
        raise
    return group


def _rendezvous_watching(group: WorkerGroup, mapping: Mapping, init_method: str) -> None:
    """Join the process group once every worker has checked in at rank 0's store, and give
    up as soon as one exits instead: it would never arrive, and the rendezvous would wait
    out its whole timeout (and could not be cancelled)."""
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    store = dist.TCPStore(host, int(port), mapping.world_size, is_master=True,
                          wait_for_workers=False, timeout=RENDEZVOUS_TIMEOUT)
    keys = [ready_key(rank) for rank in range(1, mapping.world_size)]
    while not store.check(keys):
        error = group.dead_worker_error()
        if error is not None:
            raise error
        time.sleep(0.05)
    comm.init_distributed(mapping, group.device, None, store=store)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_worker(module: str, args, mapping: Mapping, init_method: str,
                  device: torch.device) -> subprocess.Popen:
    """A fresh interpreter running the worker module (not multiprocessing: the user's
    __main__ is never re-imported, so scripts need no `if __name__ == "__main__"` guard)."""
    spec = {"args": args.model_dump(mode="json"), "world_size": mapping.world_size,
            "tp_size": mapping.tp_size, "pp_size": mapping.pp_size, "rank": mapping.rank,
            "init_method": init_method, "device": str(device), "parent_pid": os.getpid()}
    return subprocess.Popen([sys.executable, "-m", module, json.dumps(spec)],
                            stdin=subprocess.DEVNULL)


class WorkerGroup:
    """The spawned worker processes of rank 0: watched for deaths, stopped at shutdown."""

    def __init__(self, processes: list, device: torch.device) -> None:
        self.processes = processes
        self.device = device
        self._stopping = False
        self._dead: Exception | None = None

    def dead_worker_error(self, grace_s: float = 0.0) -> Exception | None:
        """The error to report if a worker died; waits up to `grace_s` for a death to show
        (a failed collective can be noticed before the dead process is)."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, process in enumerate(self.processes, start=1):
                code = process.poll()
                if code is not None and not self._stopping:
                    self._dead = self._dead or RuntimeError(
                        f"tllm worker rank {rank} exited unexpectedly (exit code {code}); "
                        f"its error, if any, is in the log above")
            if self._dead is not None or time.monotonic() >= deadline:
                return self._dead
            time.sleep(0.05)

    def watch(self, on_death) -> None:
        """Call `on_death(error)` from a watcher thread when a worker process dies."""
        def watcher(process: subprocess.Popen) -> None:
            process.wait()
            error = self.dead_worker_error()
            if error is not None:
                logger.error("%s", error)
                on_death(error)

        for process in self.processes:
            threading.Thread(target=watcher, args=(process,), name="tllm-worker-watch",
                             daemon=True).start()

    def shutdown(self, clean: bool = True) -> None:
        """Tell the workers to stop (when they can still hear it), then make sure they are
        gone: join, terminate, kill."""
        from tllm.runner.step import STOP
        self._stopping = True
        if clean and comm.state() is not None:
            try:
                comm.broadcast_object(STOP)
            except Exception:  # a worker already died: fall through to terminate
                logger.warning("could not send stop to the workers", exc_info=True)
                clean = False
        # Leave the group together with the workers (they do so on STOP): NCCL's teardown
        # waits for its peers, so rank 0 must not wait for them to exit first.
        if clean:
            comm.destroy_distributed()
        else:
            comm.abandon_distributed()
        for process in self.processes:
            try:
                process.wait(timeout=30 if clean else 2)
            except subprocess.TimeoutExpired:
                process.terminate()
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
