"""User-written configuration of the LLM API (pydantic: bad values raise ValueError naming
the field)."""
from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator,
                      model_validator)


class KvCacheConfig(BaseModel):
    """Size and layout of the paged KV cache.

    Capacity is `max_tokens` when given; otherwise `free_memory_fraction` of the memory left
    after the weights (on a CPU: of the available RAM, at most 4 GiB of it).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens_per_block: int = Field(32, ge=1, le=1024)
    # "fp8": e4m3 keys and values with a per-layer scale (the checkpoint's k_scale/v_scale,
    # else 1.0): half the bytes of a 16-bit cache, so twice the tokens fit.
    dtype: Literal["auto", "fp8"] = "auto"
    max_tokens: int | None = Field(None, ge=1)
    free_memory_fraction: float = Field(0.9, gt=0.0, le=1.0)
    enable_block_reuse: bool = True
    # Models with state-space layers (hybrids): how many block-boundary states (every such
    # layer's, one request's worth each) prefix reuse keeps, LRU; None: one per batch slot.
    max_state_checkpoints: int | None = Field(None, ge=1)
    # Hybrids: the dtype of each request's recurrent state (Mamba-2's SSM state, gated
    # DeltaNet's); "auto": the checkpoint's `mamba_ssm_cache_dtype`, else float32. A 16-bit
    # state halves what a decode step reads and writes of it (TensorRT-LLM's option; the
    # update still computes in float32).
    mamba_ssm_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Secondary tiers for evicted reusable blocks (and swapped-out requests): bytes of host
    # memory, then a directory on disk.
    host_cache_size: int = Field(0, ge=0)
    disk_cache_dir: str | None = None
    disk_cache_size: int = Field(0, ge=0)
    # Sliding-window layers give back the blocks their window has passed (their own block
    # tables, beside the full-attention layers'); off, every layer keeps every block.
    enable_sliding_window_savings: bool = True
    # vLLM's gpu_memory_utilization: the share of the device's whole memory this engine may
    # hold, weights and activations included; the KV cache gets the rest (on a CPU: this
    # share of the available RAM). Replaces free_memory_fraction, so not with it.
    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _check_memory_share(self) -> KvCacheConfig:
        if (self.gpu_memory_utilization is not None
                and "free_memory_fraction" in self.model_fields_set):
            raise ValueError("kv_cache_config: set free_memory_fraction or "
                             "gpu_memory_utilization, not both")
        return self


class CapacitySchedulerPolicy(str, Enum):
    """How the scheduler admits requests against KV-cache capacity (TensorRT-LLM's names)."""

    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"  # admit only what can run to completion
    MAX_UTILIZATION = "MAX_UTILIZATION"          # admit greedily; preempt when blocks run out


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    capacity_scheduler_policy: CapacitySchedulerPolicy = \
        CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    # What happens to a preempted request's KV blocks under MAX_UTILIZATION: dropped and
    # recomputed later, or swapped to host memory (needs kv_cache_config.host_cache_size).
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    # Which waiting request runs first: "fcfs" (arrival order) or "priority" (the lowest
    # request priority first, FCFS within a level; under KV pressure the lowest-priority
    # running request is preempted first). vLLM's names.
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # None: each step spends up to max_num_tokens, on running requests in admission order
    # (a long prefill chunk can make decodes wait: the best throughput). A number: every
    # running decode is scheduled first, each step, and prefill chunks fill the rest of
    # this many tokens, so a step costs about a decode step (Sarathi-Serve's stall-free
    # batching; lower inter-token latency tails). Needs chunked prefill.
    step_token_budget: int | None = Field(None, ge=1)
    # A number: every running decode is scheduled first and not counted, then at most this
    # many prefill tokens a step (a step without decodes spends max_num_tokens). The batch
    # fills as under the default when this is at least max_batch_size * ISL / OSL (twice
    # that absorbs bursts); the step costs a decode step plus this many prompt tokens.
    # With admit_whole_chunks, new prompts wait for enough free slots to fill the chunk
    # (at most an eighth of the batch), leaving pure decode steps between mixed ones.
    prefill_token_budget: int | None = Field(None, ge=1)
    admit_whole_chunks: bool = True


class CudaGraphConfig(BaseModel):
    """Steps replayed as CUDA graphs (CUDA with the Triton backend only). Decode steps: the
    whole forward, one graph per batch size (a batch pads up to the next captured size);
    steps with prompt tokens: everything but attention, one graph chain per token-count
    bucket (`piecewise`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # default: 1, 2, 4, 8, 16, 24, 32, 48, ... 256, then steps of 64 to 512, of 128 to
    # 1024, of 256 to 2048, up to max_batch_size
    batch_sizes: list[int] | None = None
    max_batch_size: int | None = Field(None, ge=1)  # None: the engine's max_batch_size
    piecewise: bool = True
    # default: 16, 32, 64, 128, 192, ... up to max_num_tokens (always captured)
    token_buckets: list[int] | None = None
    # Capture the graphs from a torch.compile'd model (our kernels as torch custom ops, the
    # code between them fused by Inductor): slower to start (a trace per batch size, cached
    # on disk by Inductor), off by default.
    torch_compile: bool = False


class TorchCompileConfig(BaseModel):
    """Decode steps on the CPU through torch.compile (Inductor's C++ backend; TensorRT-LLM's
    name): the step's thousands of small ops become a few fused kernels, attention and the
    quantized matmuls staying torch's own. Compiles at start (seconds to minutes; cached on
    disk by Inductor for the next start); steps with prompt tokens run eagerly; without a
    working C++ compiler decode runs eagerly, with one log line. On CUDA the decode graphs
    are compiled by `cuda_graph_config.torch_compile` instead."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # compiled at start (default: 1 and 2, batch 1's trace and the dynamic batch's, which
    # serves every larger batch); a batch size that needs another trace compiles when it
    # first runs
    warm_up_batch_sizes: list[int] | None = None


class _SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_draft_len: int = Field(4, ge=1, le=32)  # draft tokens proposed per request and step


class NGramDecodingConfig(_SpeculativeConfig):
    """Prompt lookup (TensorRT-LLM's name): drafts are what followed the latest earlier
    occurrence of the request's last n tokens in its own prompt and output, trying
    n = max_matching_ngram_size down to 1; no extra model."""

    decoding_type: Literal["NGram"] = "NGram"
    max_matching_ngram_size: int = Field(3, ge=1, le=64)
    # Match the earliest occurrence instead of the latest.
    is_use_oldest: bool = False


class DraftTargetDecodingConfig(_SpeculativeConfig):
    """A second, smaller model that shares the target's tokenizer proposes the drafts.
    `speculative_model`: a checkpoint directory, a .gguf file, `dummy:<preset>`, or the
    target's own checkpoint cut to its first layers (`self:layers=N`)."""

    decoding_type: Literal["DraftTarget"] = "DraftTarget"
    speculative_model: str


class EagleDecodingConfig(_SpeculativeConfig):
    """An EAGLE-3 head (`speculative_model`: its checkpoint directory) drafts from the
    target's hidden states of three layers (low, mid, high; default: the head's config, else
    layers 2, L/2 - 1 and L - 4 as EAGLE-3 picks them)."""

    decoding_type: Literal["Eagle"] = "Eagle"
    speculative_model: str
    eagle3_layers_to_capture: tuple[int, ...] | None = None


class MTPDecodingConfig(_SpeculativeConfig):
    """DeepSeek-V3's multi-token-prediction module (the target checkpoint's layer
    `num_hidden_layers`) drafts from the target's final hidden states, then from its own."""

    decoding_type: Literal["MTP"] = "MTP"


class DisaggConfig(BaseModel):
    """Disaggregated serving (tllm.disagg): this engine is a context server (prefills
    requests and keeps their KV blocks for a generation server to fetch) or a generation
    server (decodes requests from KV fetched from a context server). `transport`: how KV
    blocks travel: over TCP (any two processes; the blocks pass through host memory) or
    CUDA IPC (two processes on one GPU host: device-to-device copies).

    A generation server fetches only from `kv_sources`, the KV endpoints of the context
    servers it was configured with; a request names one of them by its source id, never by
    address. With `secret`, both sides prove they know it before any KV moves."""

    # (its checks are per field: an error's text shows that field's input, never the secret)
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    role: Literal["context", "generation"]
    transport: Literal["tcp", "cuda_ipc"] = "tcp"
    # The context server's KV endpoint (0: a free port); generation servers connect to it.
    kv_host: str = "127.0.0.1"
    kv_port: int = Field(0, ge=0, le=65535)
    # A generation server's context servers: their KV endpoints, "host:port".
    kv_sources: tuple[str, ...] = Field((), validate_default=True)
    # Shared by a deployment's context and generation servers (None: no authentication).
    secret: SecretStr | None = None
    # A context server frees a request's blocks when the generation side has taken them, or
    # after this many seconds (a front that gave up, a generation server that died).
    hold_timeout_s: float = Field(30.0, gt=0)
    # A generation server stages fetched KV in host memory until admission: at most this
    # many bytes at once (further fetches wait), so transfers stay bounded in memory.
    max_staging_bytes: int = Field(1 << 30, ge=1)

    @field_validator("kv_sources")
    @classmethod
    def _check_sources(cls, kv_sources: tuple[str, ...], info: ValidationInfo):
        role = info.data.get("role")
        if role == "context" and kv_sources:
            raise ValueError("disaggregation.kv_sources: only a generation server fetches KV")
        if role == "generation" and not kv_sources:
            raise ValueError("disaggregation.kv_sources: a generation server needs the KV "
                             "endpoints ('host:port') of the context servers it may fetch "
                             "from (tllm serve --kv-sources)")
        for endpoint in kv_sources:
            parse_endpoint(endpoint)
        return kv_sources

    @field_validator("secret")
    @classmethod
    def _check_secret(cls, secret: SecretStr | None):
        if secret is not None and not secret.get_secret_value():
            raise ValueError("disaggregation.secret: empty")
        return secret


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of a KV endpoint, 'host:port' or 'tcp://host:port'."""
    host, _, port = str(endpoint).removeprefix("tcp://").rpartition(":")
    host = host.removeprefix("[").removesuffix("]")    # [::1]:8100
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"disaggregation.kv_sources: not a KV endpoint ('host:port'): "
                         f"{endpoint!r}")
    return host, int(port)


class AllReduceConfig(BaseModel):
    """The tensor-parallel all-reduce (tllm.distributed.custom_allreduce). "auto": on CUDA
    with peer access between the tp GPUs of one host, a one-shot all-reduce over symmetric
    memory for messages up to `one_shot_max_bytes`, a two-shot one up to `custom_max_bytes`
    (the size of the peer buffer each rank holds), NCCL above; NCCL (gloo on the CPU)
    wherever the custom path cannot run. "nccl": never the custom path. "oneshot" /
    "twoshot": that algorithm for every message up to `custom_max_bytes`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: Literal["auto", "nccl", "oneshot", "twoshot"] = "auto"
    one_shot_max_bytes: int = Field(256 << 10, ge=0)
    custom_max_bytes: int = Field(8 << 20, ge=0)

    @model_validator(mode="after")
    def _check_sizes(self) -> AllReduceConfig:
        if self.one_shot_max_bytes > self.custom_max_bytes:
            raise ValueError(f"allreduce_config.one_shot_max_bytes ({self.one_shot_max_bytes}) "
                             f"must not exceed custom_max_bytes ({self.custom_max_bytes})")
        return self


SpeculativeConfig = Union[NGramDecodingConfig, DraftTargetDecodingConfig, EagleDecodingConfig,
                          MTPDecodingConfig]


def parse_speculative_config(data: dict) -> SpeculativeConfig:
    """A speculative config from a plain dict (a YAML file): `decoding_type` picks the class
    (NGram, DraftTarget, Eagle, MTP)."""
    if not isinstance(data, dict):
        raise ValueError(f"speculative_config: expected a mapping, got {type(data).__name__}")
    kinds = {"NGram": NGramDecodingConfig, "DraftTarget": DraftTargetDecodingConfig,
             "Eagle": EagleDecodingConfig, "MTP": MTPDecodingConfig}
    kind = data.get("decoding_type")
    if kind not in kinds:
        raise ValueError(f"speculative_config.decoding_type: one of {sorted(kinds)}, "
                         f"got {kind!r}")
    return kinds[kind](**data)


class LlmArgs(BaseModel):
    """Arguments of LLM(...), in TensorRT-LLM's style."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    model: str
    # What the model serves: "generate" (text), or a pooling task: "embed" (embeddings),
    # "score" (a cross-encoder's pair scores), "classify" (label probabilities); "auto":
    # the model's own (its architecture: a *ForSequenceClassification scores or classifies,
    # BertModel / Qwen3Model embed, a *ForCausalLM generates).
    task: Literal["auto", "generate", "embed", "score", "classify"] = "auto"
    # For a hub id ("org/name"): the branch, tag or commit of its repository (default:
    # main), and the HF cache folder it is looked for and downloaded into (default:
    # HF_HUB_CACHE, else $HF_HOME/hub). Local paths and built-in names ignore both.
    revision: str | None = None
    download_dir: str | None = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # "fp8": quantize a 16/32-bit checkpoint's linear layers to FP8 at load (per-channel
    # weights, per-token activations). A quantized checkpoint is detected from its own config.
    # "none": no quantized weights: a GGUF file is dequantized to the model dtype at load
    # (by default its blocks stay quantized: int8 kernels on the CPU). "gguf_int4": a GGUF
    # file's 4-bit types as exact int4 (less memory, slower once requests batch).
    # "int4_awq" / "int8_wo": weight-only int4 (AWQ-style zero points) / int8 at load,
    # round-to-nearest in groups of 128 (for benchmarks; AWQ/GPTQ checkpoints need no flag).
    # "int4_awq_int8_head": int4_awq with the LM head weight-only int8 too.
    quantization: Literal["fp8", "none", "gguf_int4", "int4_awq", "int8_wo",
                          "int4_awq_int8_head"] | None = None
    device: str | None = None
    max_batch_size: int = Field(256, ge=1)
    max_num_tokens: int = Field(8192, ge=1)
    max_seq_len: int | None = Field(None, ge=2)
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    scheduler_config: SchedulerConfig = Field(default_factory=lambda: SchedulerConfig())
    # None turns CUDA graphs off.
    cuda_graph_config: CudaGraphConfig | None = Field(default_factory=lambda: CudaGraphConfig())
    # torch.compile'd decode steps on the CPU (None: eager; see TorchCompileConfig)
    torch_compile_config: TorchCompileConfig | None = None
    enable_chunked_prefill: bool = True
    # The overlap scheduler prepares step N+1 while step N runs; off, each step ends on the
    # host before the next is scheduled. Outputs are the same either way.
    disable_overlap_scheduler: bool = False
    attn_backend: Literal["auto", "torch", "triton"] = "auto"
    # Batch-invariant deterministic mode: a request's tokens and logprobs are the same bits
    # alone or in any batch, chunking and prefix reuse (tllm.layers.batch_invariant,
    # tllm.attention.invariant); slower. Turns CUDA graphs off.
    deterministic: bool = False
    # Count the tokens each MoE layer routes to each expert (get_stats' moe_expert_load and
    # moe_load_balancedness; tllm.layers.moe_load): a small cost per MoE layer and step.
    moe_load_stats: bool = False
    # Whose modeling code runs: "tllm" (our own model files), "transformers" (transformers'
    # modules with our paged KV cache and attention plugged in), "auto" (ours where we have
    # the architecture, else transformers').
    model_impl: Literal["auto", "tllm", "transformers"] = "auto"
    seed: int = 0
    # One process per rank: tensor parallelism splits every layer across tp ranks, pipeline
    # parallelism splits the layers into pp stages (see tllm.distributed.Mapping).
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    # Mixture-of-experts layers: whole experts placed on the tensor-parallel ranks (expert
    # parallelism) instead of every expert sliced across them.
    enable_expert_parallel: bool = False
    # Who starts the other ranks: local subprocesses ("mp") or Ray actors, across nodes ("ray").
    orchestrator: Literal["mp", "ray"] = "mp"
    # The tensor-parallel all-reduce: custom one-/two-shot over peer memory for small
    # messages on CUDA, NCCL for the rest (see AllReduceConfig).
    allreduce_config: AllReduceConfig = Field(default_factory=AllReduceConfig)
    # Speculative decoding (off by default): who drafts, and how many tokens per step.
    speculative_config: SpeculativeConfig | None = Field(None, discriminator="decoding_type")
    # Disaggregated prefill/decode serving: this engine's role (None: it does both).
    disaggregation: DisaggConfig | None = None

    # Multi-LoRA serving: requests name a PEFT adapter (lora_request); up to max_loras
    # adapters of rank <= max_lora_rank sit in device slots at once (LRU), the max_cpu_loras
    # most recently used stay read in host memory (default: max_loras).
    enable_lora: bool = False
    max_loras: int = Field(4, ge=1)
    max_lora_rank: int = Field(16, ge=1, le=512)
    max_cpu_loras: int | None = Field(None, ge=1)
    # Default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty) of
    # requests that do not set them, as vLLM's --generation-config: "auto", the model
    # folder's generation_config.json; "vllm", none (tllm's own defaults); or a folder
    # holding such a file (or the file).
    generation_config: str = "auto"
    # Vision-language models: the most items of each modality one prompt may carry
    # ({"image": 8}; vLLM's --limit-mm-per-prompt), and the folder under which
    # file:// image URLs may be read (None: never).
    limit_mm_per_prompt: dict[str, int] = Field(default_factory=lambda: {"image": 8})
    allowed_local_media_path: str | None = None
    # http(s) image URLs: fetched only from these hosts (vLLM's --allowed-media-domains;
    # None: never), each fetch within a deadline and a byte limit (tllm.multimodal.fetch).
    allowed_media_domains: list[str] | None = None
    media_fetch_timeout_s: float = Field(5.0, gt=0)
    max_media_fetch_bytes: int = Field(16 << 20, ge=1)
    # RL rollouts: a request submitted while the engine sleeps waits for wake_up ("wait")
    # or fails at once ("fail"; tllm.executor.loop_gate.EngineAsleepError).
    sleep_mode_policy: Literal["wait", "fail"] = "wait"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _check_mm_limits(cls, limits: dict[str, int]) -> dict[str, int]:
        for modality, limit in limits.items():
            if modality != "image" or limit < 0:
                raise ValueError("limit_mm_per_prompt takes {'image': count >= 0}, got "
                                 f"{limits!r}")
        return limits

    @field_validator("allowed_media_domains")
    @classmethod
    def _check_media_domains(cls, entries: list[str] | None) -> list[str] | None:
        from tllm.multimodal.fetch import parse_allowed_host
        for entry in entries or ():
            parse_allowed_host(entry)
        return entries

    @field_validator("generation_config")
    @classmethod
    def _check_generation_config(cls, setting: str) -> str:
        if setting not in ("auto", "vllm") and not (setting
                                                    and Path(setting).expanduser().exists()):
            raise ValueError("generation_config must be 'auto', 'vllm' or a folder holding "
                             f"generation_config.json (or that file), got {setting!r}")
        return setting

    @model_validator(mode="after")
    def _check_scheduler(self) -> LlmArgs:
        config = self.scheduler_config
        for name in ("step_token_budget", "prefill_token_budget"):
            budget = getattr(config, name)
            if budget is None:
                continue
            if not self.enable_chunked_prefill:
                raise ValueError(f"scheduler_config.{name} needs enable_chunked_prefill=True")
            if budget > self.max_num_tokens:
                raise ValueError(f"scheduler_config.{name} ({budget}) must not exceed "
                                 f"max_num_tokens ({self.max_num_tokens})")
        if config.step_token_budget is not None and config.prefill_token_budget is not None:
            raise ValueError("scheduler_config: set step_token_budget or "
                             "prefill_token_budget, not both")
        return self

    @model_validator(mode="after")
    def _check_deterministic(self) -> LlmArgs:
        if self.deterministic and self.attn_backend == "triton":
            raise ValueError("attn_backend: deterministic mode attends with its own "
                             "batch-invariant backend; leave attn_backend at 'auto'")
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> LlmArgs:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least "
                             f"max_loras ({self.max_loras})")
        return self

    @model_validator(mode="after")
    def _check_parallel_features(self) -> LlmArgs:
        if self.world_size == 1:
            return self
        if self.speculative_config is not None:
            raise ValueError("speculative_config is not supported with tensor/pipeline "
                             "parallelism yet")
        kv = self.kv_cache_config
        if kv.host_cache_size or kv.disk_cache_dir:
            raise ValueError("kv_cache_config: host and disk KV tiers are not supported with "
                             "tensor/pipeline parallelism yet")
        if self.disaggregation is not None:
            raise ValueError("disaggregation is not supported with tensor/pipeline "
                             "parallelism yet")
        if self.scheduler_config.preemption_mode == "swap":
            raise ValueError("scheduler_config.preemption_mode='swap' is not supported with "
                             "tensor/pipeline parallelism yet; use 'recompute'")
        return self
