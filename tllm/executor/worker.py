"""A worker rank (every rank but 0): builds its model shard and KV cache shard, then runs
each step rank 0 plans until rank 0 sends STOP. It holds no requests and no scheduler;
everything it needs for a step is in the StepPlan (a diff of its own batch tables)."""
from __future__ import annotations

import logging
import os
import threading
import time
import traceback

import torch

from tllm.distributed import comm
from tllm.distributed.mapping import Mapping
from tllm.distributed.rendezvous import RENDEZVOUS_TIMEOUT, ready_key
from tllm.config import LlmArgs
from tllm.runner.batch_state import BatchTables
from tllm.runner.build import build_rank
from tllm.runner.model_runner import batch_tables
from tllm.runner.rank_rollout import RankCommand, RankRollout
from tllm.runner.step import STOP, RankModel
from tllm.sampling.last_stage import LastStageSampler

logger = logging.getLogger(__name__)


def worker_main(spec: dict) -> None:
    """Entry point of a spawned worker process (`python -m tllm.executor.worker SPEC`)."""
    _exit_with_parent(spec["parent_pid"])
    try:
        args = LlmArgs.model_validate(spec["args"])
        mapping = Mapping(spec["world_size"], spec["tp_size"], spec["pp_size"], spec["rank"],
                          args.enable_expert_parallel)
        device = torch.device(spec["device"])
        comm.init_distributed(mapping, device, None, store=_check_in(spec, mapping))
        run_worker(args, device)
        comm.destroy_distributed()
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)  # skip interpreter teardown: nothing is left to flush


def _check_in(spec: dict, mapping: Mapping):
    """Connect to rank 0's rendezvous store and say this rank is up (rank 0 joins the
    process group only once every worker has)."""
    import torch.distributed as dist
    host, port = spec["init_method"].removeprefix("tcp://").rsplit(":", 1)
    store = dist.TCPStore(host, int(port), mapping.world_size, is_master=False,
                          timeout=RENDEZVOUS_TIMEOUT)
    store.set(ready_key(mapping.rank), "1")
    return store


def run_worker(args: LlmArgs, device: torch.device) -> None:
    """What a worker rank runs, in whatever process its launcher gave it."""
    parts = build_rank(args, device)
    rollout = RankRollout(parts.model, parts.kv_cache, parts.graphs, parts.piecewise,
                          parts.device, parts.dtype, rank_offset=comm.mapping().rank)
    serve_steps(parts.model, parts.kv_cache, parts.graphs, parts.device, args.seed,
                batch_tables(args.max_batch_size, parts.max_seq_len, parts.kv_cache),
                parts.lora, parts.piecewise, rollout)


@torch.inference_mode()
def serve_steps(model, kv_cache, graphs, device: torch.device, seed: int,
                tables: BatchTables, lora=None, piecewise=None,
                rollout: RankRollout | None = None) -> None:
    mapping = comm.mapping()
    rank = RankModel(model, kv_cache.kv_caches, graphs, device, tables, lora, piecewise)
    # with pipeline parallelism the last stage samples and sends rank 0 the tokens
    sampler = (LastStageSampler(seed, device)
               if mapping.pp_size > 1 and mapping.is_last_stage and mapping.tp_rank == 0
               else None)
    pending: list = []  # the previous step's sends, kept alive until they complete
    while (plan := comm.broadcast_object()) != STOP:
        if isinstance(plan, RankCommand):   # sleep, wake, new weights: between steps
            _run_command(rollout, plan)
            continue
        logits = rank.run(plan)
        if sampler is not None:
            for _, work in pending:
                work.wait()
            pending = [(t, comm.send_to_driver(t)) for t in _results(sampler, plan, logits)]
    for _, work in pending:
        work.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_command(rollout: RankRollout | None, command: RankCommand) -> None:
    """Rank 0 ran it too and reports its error to the caller: here it is logged only."""
    try:
        with torch.inference_mode(False):
            rollout.apply(command)
    except Exception:
        logger.exception("rank %d: rollout command %r failed", comm.mapping().rank,
                         command.name)


def _results(sampler: LastStageSampler, plan, logits: torch.Tensor) -> list[torch.Tensor]:
    """The sampled rows' tokens (and logprobs), then the prompt-logprob rows' logits."""
    num_sampled = len(plan.sampling.row_request_ids)
    tensors = sampler.sample(plan.sampling, logits[:num_sampled])
    if logits.shape[0] > num_sampled:
        tensors.append(logits[num_sampled:])
    return tensors


def _exit_with_parent(parent_pid: int) -> None:
    """A worker must not outlive rank 0's process, even if that one was killed."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="tllm-parent-watch", daemon=True).start()


if __name__ == "__main__":
    import json
    import sys
    worker_main(json.loads(sys.argv[1]))
