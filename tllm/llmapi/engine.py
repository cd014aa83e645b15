"""Builds the engine from LlmArgs: this rank's parts (`tllm.runner.build`), the tokenizer,
the scheduler, model runner, sampler and the loop thread; with tensor/pipeline parallelism,
the worker ranks too (each builds its own parts with the same `build_rank`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tllm import loader
from tllm.cpu_threads import release_caller_openmp_threads
from tllm.device import pick_device
from tllm.disagg.agent import DisaggAgent
from tllm.distributed.launch import WorkerEntry, WorkerGroup, launch_workers, torchrun_env
from tllm.distributed.mapping import Mapping
from tllm.executor import worker
from tllm.executor.py_executor import OVERLAP, SYNC, PyExecutor, pipelined
from tllm.guided.manager import GuidedDecoding
from tllm.kv_cache.manager import KVCacheManager
from tllm.loader.generation_config import sampling_defaults
from tllm.config import LlmArgs
from tllm.lora.manager import LoraManager
from tllm.llmapi.pooling import setup_pooling
from tllm.multimodal.processing import MultimodalProcessor
from tllm.runner.build import RankParts, build_rank
from tllm.runner.model_runner import ModelRunner
from tllm.sampling.sampler import Sampler
from tllm.scheduler.policy import SchedulingPolicy
from tllm.scheduler.scheduler import Scheduler
from tllm.tokenizer import Tokenizer

WORKER = WorkerEntry("tllm.executor.worker", worker.run_worker)
logger = logging.getLogger(__name__)


@dataclass
class Engine:
    config: object
    tokenizer: Tokenizer | None
    executor: PyExecutor
    kv_cache: KVCacheManager
    device: torch.device
    dtype: torch.dtype
    max_seq_len: int
    workers: WorkerGroup | None = None  # the other ranks, with several
    disagg: DisaggAgent | None = None   # a context or generation server's part
    # generation_config.json's sampling defaults (args.generation_config)
    sampling_defaults: dict = field(default_factory=dict)
    # a vision-language model's processor (prompts with images); None for others
    multimodal: MultimodalProcessor | None = None
    # what it serves ("generate" or a pooling task) and its pooling outputs' shape
    task: str = "generate"
    pooling_info: dict = field(default_factory=dict)

    @property
    def lora(self) -> LoraManager | None:
        """The adapter slots (None: LoRA off)."""
        return self.executor.runner.lora

    def close(self) -> None:
        fatal = self.executor.fatal_error is not None
        if self.disagg is not None:
            self.disagg.close()
        self.executor.shutdown(timeout=5.0 if fatal else None)
        if self.workers is not None:
            self.workers.shutdown(clean=not fatal)
        self.kv_cache.close()


def build_engine(args: LlmArgs) -> Engine:
    workers = None
    device = pick_device(args.device)
    if args.world_size > 1:  # start the other ranks; this process becomes rank 0
        mapping = Mapping(args.world_size, args.tensor_parallel_size,
                          args.pipeline_parallel_size, 0, args.enable_expert_parallel)
        workers = start_workers(args, mapping, device)
        device = workers.device
    try:
        parts = build_rank(args, device)
        tokenizer = loader.load_tokenizer(parts.source)
        defaults = sampling_defaults(args.generation_config,
                                     parts.source.path if parts.source.kind == "hf" else None)
        multimodal = multimodal_processor(args, parts, tokenizer)
        executor = build_executor(args, parts)
        task, pooling = setup_pooling(args, parts, executor, tokenizer)
        if tokenizer is not None:  # xgrammar loads on the first guided request only
            executor.enable_guided_decoding(GuidedDecoding(
                tokenizer, getattr(parts.config, "vocab_size", None)))
    except BaseException as exc:
        if workers is None:
            raise
        # a worker that failed while building makes rank 0's next collective fail: report
        # the worker's death, not the broken connection (rank 0's own argument errors win)
        dead = None if isinstance(exc, ValueError) else workers.dead_worker_error(grace_s=2.0)
        workers.shutdown(clean=False)
        if dead is not None and dead is not exc:
            raise dead from exc
        raise
    if workers is not None:
        workers.watch(executor.fail_fatal)
        executor.health_check = lambda: workers.dead_worker_error(grace_s=2.0)
    if parts.device.type == "cpu":  # the loop thread's matmuls must not wait on ours
        release_caller_openmp_threads()
    disagg = None
    if args.disaggregation is not None:
        try:
            disagg = DisaggAgent(args.disaggregation, executor, parts.kv_cache)
        except BaseException:
            executor.shutdown()
            raise
    line, fields = engine_summary(args, parts)
    logger.info("%s", line, extra={"fields": fields})
    return Engine(parts.config, tokenizer, executor, parts.kv_cache, parts.device, parts.dtype,
                  parts.max_seq_len, workers, disagg, defaults, multimodal, task, pooling)


def multimodal_processor(args: LlmArgs, parts: RankParts,
                         tokenizer: Tokenizer | None) -> MultimodalProcessor | None:
    """The image processing of a vision-language model's folder (None: a text-only
    model)."""
    if not getattr(parts.model, "is_multimodal", False):
        return None
    if parts.source.kind != "hf" or tokenizer is None:
        raise ValueError(f"model {args.model!r}: a vision-language model needs its HF folder "
                         "with its tokenizer and image processor")
    return MultimodalProcessor.from_pretrained(parts.source.path, tokenizer,
                                               parts.model.hf_config,
                                               args.limit_mm_per_prompt.get("image", 0))


def engine_summary(args: LlmArgs, parts: RankParts) -> tuple[str, dict]:
    """The start-up line (what was built, for the log's reader) and its numbers."""
    kv = parts.kv_cache
    fields = {"model": args.model, "dtype": str(parts.dtype).removeprefix("torch."),
              "device": str(parts.device), "world_size": args.world_size,
              "kv_capacity_tokens": kv.capacity_tokens, "kv_blocks": kv.num_blocks,
              "kv_tokens_per_block": kv.tokens_per_block,
              "kv_dtype": str(kv.dtype).removeprefix("torch."),
              "max_batch_size": args.max_batch_size, "max_num_tokens": args.max_num_tokens,
              "max_seq_len": parts.max_seq_len, "cuda_graphs": cuda_graphs(parts)}
    line = ("engine ready: {model}, {dtype} on {device} (x{world_size}); KV cache "
            "{kv_capacity_tokens} tokens ({kv_blocks} blocks of {kv_tokens_per_block}, "
            "{kv_dtype}); max batch size {max_batch_size}, max_num_tokens {max_num_tokens}, "
            "max_seq_len {max_seq_len}; CUDA graphs: {cuda_graphs}").format(**fields)
    return line, fields


def cuda_graphs(parts: RankParts) -> str:
    """Which CUDA graphs were captured ("none": eager)."""
    captured = []
    if getattr(parts.graphs, "is_active", False):  # runner/cpu_compiled.py
        captured.append("none (decode steps torch.compile'd on the CPU)")
    if parts.graphs is not None and parts.graphs.graphs:
        captured.append(f"decode batch sizes {sorted(parts.graphs.graphs)}")
    if parts.piecewise is not None and parts.piecewise.graphs:
        captured.append(f"piecewise, {len(parts.piecewise.graphs)} token buckets up to "
                        f"{max(parts.piecewise.graphs)}")
    return " and ".join(captured) or "none"


def start_workers(args: LlmArgs, mapping: Mapping, device: torch.device) -> WorkerGroup:
    """The other ranks, by the orchestrator asked for (a torchrun environment wins)."""
    if args.orchestrator == "ray" and torchrun_env(mapping.world_size) is None:
        from tllm.distributed.ray_launcher import launch_ray_workers
        return launch_ray_workers(args, mapping, device, WORKER.run)
    return launch_workers(args, mapping, device, WORKER)


def scheduling_policy(args: LlmArgs) -> SchedulingPolicy:
    config = args.scheduler_config
    return SchedulingPolicy(config.scheduling_policy, config.step_token_budget,
                            config.prefill_token_budget, config.admit_whole_chunks)


def build_executor(args: LlmArgs, parts: RankParts) -> PyExecutor:
    pp_size = args.pipeline_parallel_size
    scheduler = Scheduler(parts.kv_cache, max_batch_size=args.max_batch_size,
                          max_num_tokens=args.max_num_tokens,
                          # a bidirectional encoder computes a prompt in one step
                          enable_chunked_prefill=(args.enable_chunked_prefill
                                                  and getattr(parts.model, "is_causal", True)),
                          preemption_mode=args.scheduler_config.preemption_mode,
                          num_micro_batches=pp_size, policy=scheduling_policy(args))
    lora = LoraManager(parts.lora) if parts.lora is not None else None
    if lora is not None:
        scheduler.admission_gates.append(lora)  # a request waits for its adapter's slot
    runner = ModelRunner(parts.model, parts.kv_cache, parts.device, parts.graphs, lora,
                         max_batch_size=args.max_batch_size, max_seq_len=parts.max_seq_len,
                         piecewise=parts.piecewise)
    sampler = Sampler(args.seed, parts.device, args.max_batch_size,
                      int(parts.config.vocab_size), batch_invariant=args.deterministic)
    runner.slots.listeners.append(sampler)
    if pp_size > 1:
        overlap = pipelined(pp_size)
    else:
        overlap = SYNC if args.disable_overlap_scheduler else OVERLAP
    executor = PyExecutor(scheduler, parts.kv_cache, runner, sampler, overlap,
                          build_drafter(args, parts))
    state_cache = getattr(parts.model, "state_cache", None)
    if state_cache is not None:
        add_state_listeners(state_cache, runner, executor, args)
    return executor


def add_state_listeners(state_cache, runner, executor, args: LlmArgs) -> None:
    """A hybrid's saved states (restored as a prefix hit takes its slot) and, with swap
    preemption, its swapped-out states (restored as the request comes back)."""
    checkpoints = state_cache.checkpoints
    if checkpoints is not None:
        checkpoints.slots = runner.slots
        runner.slots.listeners.append(checkpoints)  # (it skips a request `swap` holds)
        executor.add_resource_manager(checkpoints)   # after the KV cache: its hashes first
    if args.scheduler_config.preemption_mode == "swap":
        from tllm.kv_cache.state_swap import StateSwap
        swap = state_cache.swap = StateSwap(state_cache, executor.kv_cache)
        runner.slots.listeners.append(swap)
        executor.add_resource_manager(swap)
        if checkpoints is not None:
            checkpoints.swap = swap


def build_drafter(args: LlmArgs, parts: RankParts):
    """The drafter `args.speculative_config` asks for (None: no speculation)."""
    config = args.speculative_config
    if config is None:
        return None
    if config.decoding_type == "NGram":
        from tllm.speculative.ngram import NGramDrafter
        return NGramDrafter(config)
    if config.decoding_type == "DraftTarget":
        from tllm.speculative import draft_model
        return draft_model.build_drafter(config, parts)
    if config.decoding_type == "MTP":
        from tllm.speculative import mtp
        return mtp.build_drafter(config, parts)
    from tllm.speculative import eagle3
    return eagle3.build_drafter(config, parts)
