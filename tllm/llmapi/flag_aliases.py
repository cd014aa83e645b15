"""Other servers' names for our engine flags and LLM(...) arguments, in one place, so that a
vLLM or trtllm-serve command line (or script) runs as typed: vLLM's `--max-model-len`,
`-tp`, `LLM(max_num_seqs=...)`; trtllm-serve's `--kv_cache_free_gpu_memory_fraction` (its
underscore spellings of our own names, `--max_batch_size`, are tllm.cli_parser's rule).

`register_aliases` adds the spellings to our flags' option strings, so `--help` shows them
beside ours; `add_peer_engine_flags` / `add_peer_server_flags` add the flags we have no name
of our own for (a field of a config, or nothing to do: said in their help)."""
from __future__ import annotations

import argparse
import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tllm.cli_types import fraction
from tllm.config import LlmArgs

# Their flag -> ours: the same meaning and values.
FLAG_ALIASES: dict[str, str] = {
    "--max-model-len": "--max-seq-len",                # vLLM
    "--max-num-seqs": "--max-batch-size",              # vLLM
    "--max-num-batched-tokens": "--max-num-tokens",    # vLLM
    "--tensor-parallel-size": "--tp-size",             # vLLM
    "-tp": "--tp-size",                                # vLLM
    "--pipeline-parallel-size": "--pp-size",           # vLLM
    "-pp": "--pp-size",                                # vLLM
    "-q": "--quantization",                            # vLLM
    "--kv-cache-free-gpu-memory-fraction": "--kv-cache-free-memory-fraction",  # trtllm-serve
}
# Their names for values of our flags' choices (vLLM's).
DTYPE_NAMES = {"half": "float16", "float": "float32"}
KV_CACHE_DTYPE_NAMES = {"fp8_e4m3": "fp8"}
VALUE_ALIASES = {"--dtype": DTYPE_NAMES, "--kv-cache-dtype": KV_CACHE_DTYPE_NAMES}

# Flags of add_peer_engine_flags that set a kv_cache_config field: dest -> field.
PEER_KV_CACHE_FLAGS = {"gpu_memory_utilization": "gpu_memory_utilization",
                       "enable_block_reuse": "enable_block_reuse"}

# Their LLM(...) keyword -> ours ("kv_cache_config.x": that field of kv_cache_config).
KWARG_ALIASES: dict[str, str] = {
    "max_model_len": "max_seq_len",                                       # vLLM
    "max_num_seqs": "max_batch_size",                                     # vLLM
    "max_num_batched_tokens": "max_num_tokens",                           # vLLM
    "gpu_memory_utilization": "kv_cache_config.gpu_memory_utilization",   # vLLM
    "enable_prefix_caching": "kv_cache_config.enable_block_reuse",        # vLLM
    "kv_cache_dtype": "kv_cache_config.dtype",                            # vLLM
}
# Their keywords with no argument of ours behind them (see _peer_only_kwargs).
PEER_ONLY_KWARGS = ("enforce_eager", "tokenizer", "trust_remote_code")


def register_aliases(container) -> None:
    """Add the peers' spellings to the flags `container` (a parser or an argument group)
    has, as further option strings of the same action, and their value names to --dtype and
    --kv-cache-dtype. A spelling the command uses already is left to it."""
    known = container._option_string_actions   # argparse's table; a group shares its parser's
    for alias, flag in FLAG_ALIASES.items():
        action = known.get(flag)
        if action is not None and alias not in known:
            action.option_strings.append(alias)
            known[alias] = action
    for flag, names in VALUE_ALIASES.items():
        action = known.get(flag)
        if action is not None and action.type is None:
            action.type = lambda text, names=names: names.get(text, text)
            listed = ", ".join(f"{theirs} = {ours}" for theirs, ours in names.items())
            action.help = f"{action.help or ''}; vLLM's {listed}".lstrip("; ")


def add_peer_engine_flags(group) -> None:
    """vLLM's and trtllm-serve's engine flags that no flag of ours spells; all default None
    (not given)."""
    group.add_argument("--gpu-memory-utilization", type=fraction, metavar="F",
                       help="vLLM's: the share of the device's whole memory this engine may "
                            "hold, weights and activations included; the KV cache gets the "
                            "rest (kv_cache_config.gpu_memory_utilization; instead of "
                            "--kv-cache-free-memory-fraction, a share of what is free after "
                            "the weights)")
    group.add_argument("--enable-prefix-caching", dest="enable_block_reuse", default=None,
                       action=argparse.BooleanOptionalAction,
                       help="vLLM's: reuse the KV blocks of cached prompt prefixes, "
                            "kv_cache_config.enable_block_reuse (default: on)")
    group.add_argument("--enforce-eager", action="store_true", default=None,
                       help="vLLM's: no CUDA graphs (cuda_graph_config: null)")
    group.add_argument("--tokenizer", metavar="PATH",
                       help="vLLM's, trtllm-serve's: taken when it names the model itself; "
                            "tllm reads the tokenizer from the model's folder")
    group.add_argument("--trust-remote-code", action="store_true", default=None,
                       help="vLLM's, trtllm-serve's: accepted and ignored; tllm never runs "
                            "code that comes with a checkpoint")


def add_peer_server_flags(group) -> None:
    """vLLM's `serve` flags that no flag of ours spells."""
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="vLLM's: accepted and ignored; tool_choice auto is always on "
                            "(--tool-call-parser says how calls are read from the output)")
    group.add_argument("--seed", type=int,
                       help="the engine's seed: dummy weights, and sampling of requests "
                            "without a seed of their own (default 0)")


def apply_peer_flags(args: argparse.Namespace, kwargs: dict[str, Any]) -> None:
    """Put the flags of add_peer_engine_flags that are no kv_cache_config field into LLM
    keyword arguments (`kwargs`, its model set)."""
    if getattr(args, "enforce_eager", None):
        kwargs["cuda_graph_config"] = None
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer is not None:
        _check_tokenizer(tokenizer, kwargs["model"], "--tokenizer")


def llm_args(model: str, kwargs: Mapping[str, Any]) -> LlmArgs:
    """LLM(model, **kwargs)'s arguments, vLLM's keyword names taken for ours."""
    return LlmArgs(model=model, **resolve_llm_kwargs(model, kwargs))


def resolve_llm_kwargs(model: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """LLM(...) keyword arguments with vLLM's names turned into ours. ValueError for a
    keyword given under both names, or one nobody knows (naming the closest known one)."""
    fields = LlmArgs.model_fields
    resolved = {name: value for name, value in kwargs.items() if name in fields}
    for name, value in kwargs.items():
        if name in fields:
            continue
        if name in KWARG_ALIASES:
            _put_alias(resolved, name, value)
        elif name in PEER_ONLY_KWARGS:
            _peer_only_kwargs(resolved, name, value, model)
        else:
            raise ValueError(unknown_argument(name, fields))
    if isinstance(resolved.get("dtype"), str):
        resolved["dtype"] = DTYPE_NAMES.get(resolved["dtype"], resolved["dtype"])
    return resolved


def unknown_argument(name: str, fields) -> str:
    known = [*fields, *KWARG_ALIASES, *PEER_ONLY_KWARGS]
    matches = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"; did you mean {matches[0]!r}?" if matches else ""
    return f"LLM(): unknown argument {name!r}{hint}"


def _put_alias(resolved: dict[str, Any], name: str, value: Any) -> None:
    target, _, field = KWARG_ALIASES[name].partition(".")
    if not field:
        if target in resolved:
            raise ValueError(f"LLM(): {name} is vLLM's name for {target}; give one of them")
        resolved[target] = value
        return
    config = _as_dict(resolved.get(target))
    if field in config:
        raise ValueError(f"LLM(): {name} is vLLM's name for {target}.{field}; give one of "
                         "them")
    if field == "dtype" and isinstance(value, str):
        value = KV_CACHE_DTYPE_NAMES.get(value, value)
    resolved[target] = {**config, field: value}


def _as_dict(config: Any) -> dict[str, Any]:
    """A config given as None, a mapping or a pydantic model: the fields it sets."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    return config.model_dump(exclude_unset=True)


def _peer_only_kwargs(resolved: dict[str, Any], name: str, value: Any, model: str) -> None:
    if name == "enforce_eager" and value:
        if resolved.get("cuda_graph_config") is not None:
            raise ValueError("LLM(): enforce_eager=True turns CUDA graphs off; "
                             "cuda_graph_config asks for them")
        resolved["cuda_graph_config"] = None
    elif name == "tokenizer" and value is not None:
        _check_tokenizer(value, model, "LLM(): tokenizer")
    # trust_remote_code: nothing to do, no checkpoint code ever runs


def _check_tokenizer(tokenizer: str, model: str, where: str) -> None:
    if str(tokenizer) == str(model) or _same_path(tokenizer, model):
        return
    raise ValueError(f"{where} {tokenizer!r}: tllm reads the tokenizer from the model's own "
                     f"folder ({model!r}); a separate tokenizer is not supported")


def _same_path(a: str, b: str) -> bool:
    first, second = Path(a).expanduser(), Path(b).expanduser()
    return first.exists() and second.exists() and first.resolve() == second.resolve()
