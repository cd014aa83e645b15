"""What every rank builds from LlmArgs: its model shard with weights, its KV cache shard sized
to memory, and its CUDA graphs. Rank 0 (the LLM's process) and the worker ranks call the
same `build_rank`."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import psutil
import torch

from tllm import loader
from tllm.attention import get_attention_backend, has_attention_backend
from tllm.attention.interface import KVCacheSpec
from tllm.distributed import comm
from tllm.layers.batch_invariant import make_batch_invariant
from tllm.kv_cache.groups import KVCacheLayout, plan_layout
from tllm.kv_cache.manager import KVCacheManager
from tllm.kv_cache.state_cache import build_state_cache
from tllm.layers.moe_load import ExpertLoad
from tllm.config import CapacitySchedulerPolicy, KvCacheConfig, LlmArgs
from tllm.runner.cuda_graph import DEFAULT_BATCH_SIZES, CudaGraphRunner
from tllm.runner.piecewise import PiecewiseGraphRunner, token_buckets

logger = logging.getLogger(__name__)
_CPU_KV_CAP_BYTES = 4 << 30
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class RankParts:
    """What every rank builds: its model shard, its KV cache shard, its CUDA graphs."""
    config: object
    model: torch.nn.Module
    kv_cache: KVCacheManager
    graphs: CudaGraphRunner | None
    piecewise: PiecewiseGraphRunner | None
    device: torch.device
    dtype: torch.dtype
    max_seq_len: int
    source: loader.ModelSource
    lora: object | None = None   # this rank's LoRA layers (tllm.lora.layers.LoraModel)


def pick_dtype(name: str, config, device: torch.device, is_gguf: bool) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if is_gguf else loader.checkpoint_dtype(config)


def pick_backend(name: str, device: torch.device, config=None) -> str:
    """"auto": Triton on a GPU (its kernels mask windows and Llama 4's chunks), else torch."""
    if name == "auto":
        return ("triton" if device.type == "cuda" and has_attention_backend("triton")
                else "torch")
    return name


def build_rank(args: LlmArgs, device: torch.device) -> RankParts:
    """Model, weights, KV cache and graphs of this process's rank (all of them, alone)."""
    mapping = comm.mapping()
    if comm.state() is not None and mapping.tp_size > 1:   # before the KV cache takes memory
        off = comm.setup_all_reduce(args.allreduce_config)
        logger.info("tensor-parallel all-reduce: %s", f"NCCL/gloo ({off})" if off else
                    "custom one-/two-shot for small messages, NCCL for large")
    source = loader.resolve_model(args.model, args.revision, args.download_dir)
    model_config, checkpoint = loader.load_config(source)
    dtype = pick_dtype(args.dtype, model_config, device, source.kind == "gguf")
    config = loader.language_config(model_config)  # a vision-language model's decoder's
    if config is not model_config and mapping.world_size > 1:
        raise ValueError("a vision-language model runs on one rank for now (tp_size and "
                         "pp_size 1)")
    # a config without max_position_embeddings (T5's) reaches build_model, which says why
    # it cannot be served
    max_seq_len = args.max_seq_len or getattr(config, "max_position_embeddings", None)
    # deterministic: the batch-invariant attention (and so no CUDA graphs: they take the
    # triton backend only), linear inputs padded to fixed row counts
    backend = ("batch_invariant" if args.deterministic
               else pick_backend(args.attn_backend, device, config))
    quant = loader.quant_config(source, config, args.quantization)
    model = loader.build_model(model_config, get_attention_backend(backend), dtype, device,
                               max_seq_len, quant, args.model_impl)
    if max_seq_len is None:
        raise ValueError("max_seq_len: the model's config has no max_position_embeddings; "
                         "set max_seq_len")
    if args.deterministic and getattr(model, "bidirectional_images", False):
        raise ValueError("deterministic: this model's image tokens attend within their "
                         "whole image (Gemma 3), which the batch-invariant attention does "
                         "not cover yet; load it with deterministic=False")
    loader.load_weights(model, source, checkpoint, args.seed + mapping.rank,
                        show_progress=mapping.rank == 0)  # one bar, not one per rank
    if args.deterministic:
        make_batch_invariant(model, device)
    if args.moe_load_stats:  # before any graph is captured: the graphs count too
        model.expert_load = ExpertLoad.attach(model, device)
    lora = build_lora(model, args, dtype, device)  # before the KV cache takes the memory
    state_cache = build_state_cache(model, args, dtype, device)  # so does this
    has_state = state_cache is not None
    no_evict = (args.scheduler_config.capacity_scheduler_policy
                is CapacitySchedulerPolicy.GUARANTEED_NO_EVICT)
    kv_cache = build_kv_cache(config, args, dtype, device, max_seq_len,
                              reserve_full_generation=no_evict, model=model)
    if has_state and state_cache.checkpoints is not None:  # hits end where a state was saved
        state_cache.checkpoints.connect(kv_cache)
    if lora is not None:
        lora.token_slots.is_active = True  # graphs capture the LoRA ops (slots read at replay)
    graphs = piecewise = None
    # a pooling-only model's steps all pool (never a decode graph); piecewise graphs of
    # encoders are untried; a vision-language model's steps with image rows run eagerly
    # (model_runner.py's _plan)
    if mapping.pp_size == 1 and getattr(model, "pooling_task", None) is None:
        graphs = build_cuda_graphs(model, kv_cache, args, device, backend, max_seq_len,
                                   state_cache)
        piecewise = build_piecewise_graphs(model, kv_cache, args, device, backend,
                                           graphs.pool if graphs is not None else None,
                                           state_cache)
        if (graphs is None and lora is None and not has_state
                and not getattr(model, "is_multimodal", False)):
            graphs = build_cpu_compiled(model, kv_cache, args, device, backend, max_seq_len)
    return RankParts(config, model, kv_cache, graphs, piecewise, device, dtype, max_seq_len,
                     source, lora)


def build_lora(model, args: LlmArgs, dtype: torch.dtype, device: torch.device):
    """The stacked adapter buffers inside the model's linear layers (None: LoRA off)."""
    if not args.enable_lora:
        return None
    from tllm.lora.layers import LoraModel
    spec = args.speculative_config
    max_step_tokens = max(args.max_num_tokens,
                          args.max_batch_size * (1 + (spec.max_draft_len if spec else 0)))
    return LoraModel(model, args.max_loras, args.max_lora_rank,
                     args.max_cpu_loras or args.max_loras,
                     max_step_tokens, dtype, device)


def build_cuda_graphs(model, kv_cache: KVCacheManager, args: LlmArgs, device: torch.device,
                      backend: str, max_seq_len: int,
                      state_cache=None) -> CudaGraphRunner | None:
    config = args.cuda_graph_config
    if config is None or device.type != "cuda" or backend != "triton":
        return None
    sizes = captured_batch_sizes(args)
    eager_model = model
    if config.torch_compile:
        from tllm.runner.compiled import CompiledDecodeModel
        model = CompiledDecodeModel(model)
    graphs = CudaGraphRunner(model, kv_cache, sizes, max_seq_len, device,
                             verify_query_len(args), getattr(eager_model, "uses_mrope", False))
    graphs.hooks_run = not config.torch_compile  # (a drafter's hidden-state hooks)
    if state_cache is not None:
        graphs.bind_state_cache(state_cache)
    try:  # an optimisation only: without it the first prefills compile their kernels
        graphs.warm_up_eager(eager_model)
    except Exception as exc:
        logger.warning("eager warm-up skipped: %s", str(exc).splitlines()[0][:200])
    try:
        graphs.capture()
    except RuntimeError as exc:  # e.g. transformers' modeling code syncing with the host
        torch.cuda.synchronize(device)
        logger.warning("CUDA graphs off: the model's decode step could not be captured (%s); "
                       "decode runs eagerly", str(exc).splitlines()[0][:200])
        return None
    return graphs


def build_cpu_compiled(model, kv_cache: KVCacheManager, args: LlmArgs, device: torch.device,
                       backend: str, max_seq_len: int):
    """The torch.compile'd decode step on the CPU (runner/cpu_compiled.py), compiled now;
    None where it is off or compiling failed."""
    config = args.torch_compile_config
    if config is None or device.type != "cpu" or backend != "torch":
        return None
    from tllm.runner.cpu_compiled import CompiledCpuDecode
    compiled = CompiledCpuDecode(model, kv_cache, args.max_batch_size, max_seq_len)
    sizes = config.warm_up_batch_sizes or [1, 2]
    started = time.perf_counter()
    if not compiled.warm_up(sorted({min(s, args.max_batch_size) for s in sizes})):
        return None
    logger.info("torch_compile_config: CPU decode step compiled for batch sizes %s in %.1f s",
                sizes, time.perf_counter() - started)
    return compiled


def build_piecewise_graphs(model, kv_cache: KVCacheManager, args: LlmArgs,
                           device: torch.device, backend: str, pool,
                           state_cache=None) -> PiecewiseGraphRunner | None:
    """Graphs for steps with prompt tokens: everything but attention (runner/piecewise.py),
    in the decode graphs' memory pool (one step runs at a time)."""
    config = args.cuda_graph_config
    if (config is None or not config.piecewise or device.type != "cuda"
            or backend != "triton"):
        return None
    graphs = PiecewiseGraphRunner(model, kv_cache,
                                  token_buckets(args.max_num_tokens, config.token_buckets),
                                  device, pool,
                                  None if state_cache is None else state_cache.pad_slot,
                                  getattr(model, "uses_mrope", False))
    try:
        graphs.capture()
    except RuntimeError as exc:  # a model that syncs with the host mid-forward
        torch.cuda.synchronize(device)
        logger.warning("piecewise CUDA graphs off: the forward could not be captured (%s); "
                       "steps with prompt tokens run eagerly", str(exc).splitlines()[0][:200])
        return None
    finally:
        torch.cuda.empty_cache()  # the warm-ups' eager activations
    return graphs


def verify_query_len(args: LlmArgs) -> int | None:
    """The query length verify graphs are captured at (the last token and k drafts), when
    speculation runs and k drafts fit the decode kernel; a drafter reading hidden states
    (EAGLE-3, MTP) needs its hooks in the graphs, which a torch.compile'd forward may skip."""
    from tllm.kernels.triton.decode_attention import MAX_DECODE_QUERIES  # CUDA only
    spec = args.speculative_config
    if spec is None:
        return None
    compiled = args.cuda_graph_config is not None and args.cuda_graph_config.torch_compile
    if spec.decoding_type in ("Eagle", "MTP") and compiled:
        return None
    query_len = 1 + spec.max_draft_len
    return query_len if query_len <= MAX_DECODE_QUERIES else None


def build_kv_cache(config, args: LlmArgs, dtype: torch.dtype, device: torch.device,
                   max_seq_len: int, reserve_full_generation: bool, model) -> KVCacheManager:
    """This rank's KV cache: its stage's layers, its kv heads. Every rank holds the same
    number of blocks (the smallest any rank can fit), since rank 0 allocates for all."""
    kv_config = args.kv_cache_config
    block = kv_config.tokens_per_block
    spec = model.kv_cache_spec
    layout = kv_cache_layout(spec, kv_config.enable_sliding_window_savings)
    kv_dtype = kv_cache_dtype(kv_config, dtype, model)
    layer_bytes_per_token = spec.bytes_per_token(
        torch.empty((), dtype=kv_dtype).element_size())
    # a block id holds a block in every slot (with one group, every layer)
    block_bytes = block * layout.num_slots * layer_bytes_per_token
    if kv_config.max_tokens is not None:  # the memory of that many tokens of every layer
        num_blocks = kv_config.max_tokens * spec.num_layers * layer_bytes_per_token // block_bytes
    else:
        reserved = activation_bytes(config, args, dtype) + graph_bytes(config, args, dtype,
                                                                         device)
        budget = kv_cache_budget(kv_config, device, reserved)
        useful = args.max_batch_size * -(-max_seq_len // block) * layout.num_groups
        num_blocks = min(int(budget // block_bytes), useful + int(layout.num_groups > 1))
    num_blocks = max(1 + any(layout.windows), num_blocks)
    if comm.state() is not None:
        num_blocks = comm.all_reduce_min(num_blocks)
    logger.info("KV cache: %d blocks of %d tokens, %d group(s) of windows %s, %s (%.2f GiB)",
                num_blocks, block, layout.num_groups, layout.windows,
                str(kv_dtype).removeprefix("torch."), num_blocks * block_bytes / 2**30)
    return KVCacheManager(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                          head_dim=spec.head_dim, num_blocks=num_blocks,
                          tokens_per_block=block, dtype=kv_dtype, device=device,
                          enable_block_reuse=kv_config.enable_block_reuse,
                          reserve_full_generation=reserve_full_generation,
                          host_cache_blocks=kv_config.host_cache_size // block_bytes,
                          disk_cache_dir=kv_config.disk_cache_dir,
                          disk_cache_blocks=kv_config.disk_cache_size // block_bytes,
                          layout=layout, max_step_tokens=args.max_num_tokens,
                          keys_only=spec.keys_only)


def kv_cache_layout(spec: KVCacheSpec, window_savings: bool) -> KVCacheLayout:
    """The model's KV cache groups: with window savings, full and sliding-window layers in
    groups of their own; without, one group where every layer keeps every block."""
    windows = spec.layer_windows if window_savings else ()
    return plan_layout(spec.num_layers, windows, spec.first_layer)


def kv_cache_dtype(kv_config: KvCacheConfig, dtype: torch.dtype, model) -> torch.dtype:
    """The model's dtype, or fp8 e4m3 (scales from the checkpoint, else 1.0)."""
    if kv_config.dtype != "fp8":
        return dtype
    quant = getattr(model, "quant_config", None)
    if quant is None or not quant.kv_cache_scales_in_checkpoint():
        logger.warning("fp8 KV cache without k_scale/v_scale in the checkpoint: using 1.0; "
                       "values beyond +-448 are clipped")
    return torch.float8_e4m3fn


def activation_bytes(config, args: LlmArgs, dtype: torch.dtype) -> int:
    """A bound on the activations of the largest step (max_num_tokens tokens), kept out of
    the KV budget: the merged gate/up output dominates, then the float32 logits. A MoE
    layer's gate/up runs per (token, expert) pair: top_k of them per token."""
    size = torch.empty((), dtype=dtype).element_size()
    # GPT-2-style configs name no intermediate size: theirs is 4 x hidden
    dense = (getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
             or 4 * config.hidden_size)
    expert_size = getattr(config, "moe_intermediate_size", None) or dense
    experts_width = getattr(config, "num_experts_per_tok", 0) * expert_size
    per_token = (2 * max(dense, experts_width) + 6 * config.hidden_size) * size
    logits = args.max_batch_size * config.vocab_size * 4 * 3
    return args.max_num_tokens * per_token * 2 + logits


def graph_bytes(config, args: LlmArgs, dtype: torch.dtype, device: torch.device) -> int:
    """What CUDA graphs keep besides the eager step's activations: their own pool holds a
    step's working set (the piecewise graphs' largest bucket) and each decode graph's logits
    [batch, vocab], which stay allocated."""
    if args.cuda_graph_config is None or device.type != "cuda":
        return 0
    size = torch.empty((), dtype=dtype).element_size()
    return (sum(captured_batch_sizes(args)) * config.vocab_size * size
            + activation_bytes(config, args, dtype))


def captured_batch_sizes(args: LlmArgs) -> list[int]:
    """The decode batch sizes graphs are captured for, up to the engine's max batch."""
    config = args.cuda_graph_config
    limit = min(config.max_batch_size or args.max_batch_size, args.max_batch_size)
    return [s for s in (config.batch_sizes or DEFAULT_BATCH_SIZES) if s < limit] + [limit]


def kv_cache_budget(kv_config: KvCacheConfig, device: torch.device,
                    reserved_bytes: int) -> float:
    share = kv_config.gpu_memory_utilization
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = max(0, free - reserved_bytes)
        if share is None:
            return budget * kv_config.free_memory_fraction
        # vLLM's meaning: this engine holds at most `share` of the device, what it holds
        # already (weights, the allocator's cache) included, and never more than is free
        held = torch.cuda.memory_reserved(device)
        return max(0, min(budget, share * total - held - reserved_bytes))
    available = min(psutil.virtual_memory().available, _CPU_KV_CAP_BYTES)
    return available * (share or kv_config.free_memory_fraction)
