"""The engine flags of the command line, declared once: `tllm generate | chat | serve | bench
throughput | latency` add them with `add_engine_args` and turn them, with the --config YAML
file, into LLM(...) keyword arguments with `llm_kwargs` (flags over file over the command's
defaults over LlmArgs' defaults)."""
from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tllm.cli_types import fraction, positive_int
from tllm.llmapi.flag_aliases import (PEER_KV_CACHE_FLAGS, add_peer_engine_flags,
                                      apply_peer_flags, register_aliases)
from tllm.loader import DEFAULT_MODEL

DTYPES = ("auto", "float32", "float16", "bfloat16")
CONFIG_FLAGS = ("--config", "--extra-llm-api-options")  # ours, TensorRT-LLM's

# Flags that set an LLM argument of the same name (their argparse dest).
_LLM_FLAGS = ("dtype", "device", "max_batch_size", "max_num_tokens", "max_seq_len",
              "tensor_parallel_size", "pipeline_parallel_size", "quantization",
              "model_impl", "enable_expert_parallel", "enable_lora", "max_loras",
              "max_lora_rank", "max_cpu_loras", "revision", "download_dir",
              "generation_config", "limit_mm_per_prompt", "allowed_local_media_path",
              "allowed_media_domains",
              "deterministic", "moe_load_stats")
# Flags that set a field of kv_cache_config: dest -> field.
_KV_CACHE_FLAGS = {"kv_cache_tokens": "max_tokens",
                   "kv_cache_free_memory_fraction": "free_memory_fraction",
                   "kv_cache_dtype": "dtype", **PEER_KV_CACHE_FLAGS}
# Flags that set a field of scheduler_config: dest -> field.
_SCHEDULER_FLAGS = {"scheduling_policy": "scheduling_policy",
                    "step_token_budget": "step_token_budget",
                    "prefill_token_budget": "prefill_token_budget"}


class _ConfigFile(argparse.Action):
    """Stores the path and the spelling of the flag, so that errors name the flag typed."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, "config_flag", option_string)


def add_engine_args(group, help_text: Mapping[str, str] | None = None) -> None:
    """Add the engine flags to an argparse parser or argument group. None of them has a
    default (None: not given); `help_text` replaces the help of some, by dest, where a
    command's defaults differ."""
    text = {"dtype": "default: auto (the checkpoint's on a GPU, float32 on a CPU)",
            "device": "e.g. cpu, cuda, cuda:1 (default: cuda if available)",
            "max_batch_size": "most sequences in flight (default 256)",
            "max_num_tokens": "most tokens in one engine step (default 8192)",
            "max_seq_len": "prompt + answer length limit (default: the model's)",
            "kv_cache_tokens": "KV cache capacity in tokens, kv_cache_config.max_tokens "
                               "(default: sized to memory)",
            **(help_text or {})}
    group.add_argument(*CONFIG_FLAGS, dest="config", metavar="YAML", action=_ConfigFile,
                       help="a YAML mapping of LLM(...) arguments (model, kv_cache_config, "
                            "scheduler_config, cuda_graph_config, ...); the flags win over it")
    _add_hub_args(group)
    group.add_argument("--dtype", choices=DTYPES, help=text["dtype"])
    group.add_argument("--device", help=text["device"])
    group.add_argument("--max-batch-size", type=positive_int, help=text["max_batch_size"])
    group.add_argument("--max-num-tokens", type=positive_int, help=text["max_num_tokens"])
    group.add_argument("--max-seq-len", type=positive_int, help=text["max_seq_len"])
    group.add_argument("--tp-size", type=positive_int, dest="tensor_parallel_size",
                       metavar="N", help="tensor-parallel ranks (one GPU each)")
    group.add_argument("--pp-size", type=positive_int, dest="pipeline_parallel_size",
                       metavar="N", help="pipeline-parallel stages")
    group.add_argument("--enable-expert-parallel", action="store_true", default=None,
                       help="MoE models: whole experts on each tensor-parallel rank "
                            "instead of every expert split across them")
    group.add_argument("--deterministic", action="store_true", default=None,
                       help="batch-invariant mode: a request's tokens and logprobs are the "
                            "same bits alone or in any batch (slower; no CUDA graphs)")
    group.add_argument("--moe-load-stats", action="store_true", default=None,
                       help="MoE models: count the tokens each layer routes to each expert "
                            "(get_stats, /metrics' tllm:moe_load_balancedness)")
    group.add_argument("--model-impl", choices=["auto", "tllm", "transformers"],
                       help="whose modeling code runs (default auto: tllm's where it has the "
                            "architecture, else transformers' with tllm's KV cache)")
    group.add_argument("--generation-config", metavar="auto|vllm|PATH",
                       help="default sampling parameters (temperature, top_p, top_k, min_p, "
                            "repetition_penalty) of requests that do not set them: auto "
                            "(default), the model folder's generation_config.json, as vLLM; "
                            "vllm, tllm's own; PATH, that folder's file")
    group.add_argument("--limit-mm-per-prompt", type=_mm_limits, metavar="JSON",
                       help='vision-language models: the most images one prompt may carry, '
                            'as JSON (default {"image": 8}); more are a 400')
    group.add_argument("--allowed-local-media-path", metavar="DIR",
                       help="vision-language models: read file:// image URLs under DIR "
                            "(default: file:// URLs are refused)")
    group.add_argument("--allowed-media-domains", nargs="+", metavar="HOST",
                       help="vision-language models: fetch http(s) image URLs from these "
                            "hosts only (exact match; HOST is https, http://HOST plain http, "
                            "HOST:PORT one port; private addresses only as listed IP "
                            "literals). Default: http(s) URLs are never fetched")
    _add_lora_args(group)
    group.add_argument("--kv-cache-tokens", type=positive_int, help=text["kv_cache_tokens"])
    group.add_argument("--kv-cache-free-memory-fraction", type=fraction,
                       help="share of the free memory the KV cache takes, "
                            "kv_cache_config.free_memory_fraction (default 0.9)")
    group.add_argument("--quantization",
                       choices=["fp8", "none", "gguf_int4", "int4_awq", "int8_wo",
                                "int4_awq_int8_head"],
                       help="fp8: quantize the linear layers at load (per-channel weights, "
                            "per-token activations); a quantized checkpoint needs no flag. "
                            "GGUF files: gguf_int4 keeps 4-bit blocks exact (int4 kernel, "
                            "less memory), none dequantizes them. int4_awq / int8_wo: "
                            "weight-only int4 / int8 at load (groups of 128); "
                            "int4_awq_int8_head: and an int8 LM head")
    group.add_argument("--speculative-config", metavar="YAML",
                       help="speculative decoding: a YAML mapping with decoding_type "
                            "(NGram, DraftTarget, Eagle), max_draft_len and the kind's "
                            "fields (e.g. max_matching_ngram_size, speculative_model)")
    group.add_argument("--kv-cache-dtype", choices=["auto", "fp8"],
                       help="KV cache storage, kv_cache_config.dtype (default auto: the "
                            "model's dtype; fp8 halves its bytes)")
    _add_scheduling_args(group)
    add_peer_engine_flags(group)   # vLLM's and trtllm-serve's names, last: see flag_aliases
    register_aliases(group)


def _add_hub_args(group) -> None:
    group.add_argument("--revision", metavar="REV",
                       help="a hub model's branch, tag or commit (default: main)")
    group.add_argument("--download-dir", metavar="DIR",
                       help="the Hugging Face cache a hub model is looked for and downloaded "
                            "into (default: HF_HUB_CACHE, else $HF_HOME/hub)")


def _add_lora_args(group) -> None:
    group.add_argument("--enable-lora", action="store_true", default=None,
                       help="serve LoRA adapters (requests name one: lora_request, or the "
                            "server's --lora-modules names)")
    group.add_argument("--max-loras", type=positive_int,
                       help="adapters on the device at once (default 4)")
    group.add_argument("--max-lora-rank", type=positive_int,
                       help="largest adapter rank served (default 16)")
    group.add_argument("--max-cpu-loras", type=positive_int,
                       help="adapters kept read in host memory (default: --max-loras)")


def _add_scheduling_args(group) -> None:
    group.add_argument("--scheduling-policy", choices=["fcfs", "priority"],
                       help="scheduler_config.scheduling_policy: admission by arrival (fcfs, "
                            "the default) or by each request's priority (lower first)")
    group.add_argument("--step-token-budget", type=positive_int, metavar="N",
                       help="scheduler_config.step_token_budget: schedule running decodes "
                            "first every step and fill up to N tokens with prefill chunks "
                            "(lower inter-token latency tails; default: max_num_tokens, "
                            "admission order)")
    group.add_argument("--prefill-token-budget", type=positive_int, metavar="N",
                       help="scheduler_config.prefill_token_budget: schedule every running "
                            "decode first, uncounted, and at most N prefill tokens a step "
                            "(keeps the batch full when N >= max_batch_size * ISL / OSL)")


def _mm_limits(text: str) -> dict[str, int]:
    try:
        limits = json.loads(text)
    except json.JSONDecodeError:
        limits = None
    if not (isinstance(limits, dict) and all(isinstance(v, int) for v in limits.values())):
        raise argparse.ArgumentTypeError(f'expected JSON such as {{"image": 4}}, got {text!r}')
    return limits


def llm_kwargs(args: argparse.Namespace, model: str | None = None,
               defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """LLM(...) keyword arguments, `model` included, from arguments parsed with the engine
    flags: the flags given, over the --config file, over `defaults` (the command's own; a
    callable default gets the arguments gathered so far). `model` is the command line's
    (None: not given): it wins over the file's, and DEFAULT_MODEL is the last resort."""
    flag = getattr(args, "config_flag", None) or CONFIG_FLAGS[0]
    kwargs = read_llm_options(args.config, flag) if args.config else {}
    kwargs["model"] = model or kwargs.get("model") or DEFAULT_MODEL
    kwargs.update({name: getattr(args, name) for name in _LLM_FLAGS
                   if getattr(args, name) is not None})
    if getattr(args, "speculative_config", None) is not None:
        kwargs["speculative_config"] = read_llm_options(args.speculative_config,
                                                        "--speculative-config")
    for name, flags in (("kv_cache_config", _KV_CACHE_FLAGS),
                        ("scheduler_config", _SCHEDULER_FLAGS)):
        merged = _merged_config(name, kwargs.pop(name, None), flags, args, flag)
        if merged:
            kwargs[name] = merged
    apply_peer_flags(args, kwargs)
    for name, value in (defaults or {}).items():
        if name not in kwargs:
            kwargs[name] = value(kwargs) if callable(value) else value
    return kwargs


def read_llm_options(path: str | Path, flag: str = CONFIG_FLAGS[0]) -> dict[str, Any]:
    """The mapping of LLM arguments in a YAML file; ValueError naming `flag` if it is not
    one."""
    import yaml
    try:
        options = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{flag} {path}: not valid YAML: {exc}") from exc
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError(f"{flag} {path}: expected a mapping of LLM arguments, got "
                         f"{type(options).__name__}")
    return dict(options)


def _merged_config(name: str, from_file: Any, flag_fields: Mapping[str, str],
                   args: argparse.Namespace, flag: str) -> dict[str, Any]:
    """The file's `name` mapping (kv_cache_config, scheduler_config) with the flags given
    for its fields merged over it."""
    if from_file is None:
        from_file = {}
    if not isinstance(from_file, dict):
        raise ValueError(f"{flag} {args.config}: {name} must be a mapping, got "
                         f"{type(from_file).__name__}")
    flags = {field: getattr(args, dest, None) for dest, field in flag_fields.items()
             if getattr(args, dest, None) is not None}
    return {**from_file, **flags}
