"""A pooling model's PoolerConfig: the sentence-transformers layout of its folder where it
has one (modules.json naming a Pooling module and, maybe, a Normalize module), else the
architecture's default pooling with normalised embeddings."""
from __future__ import annotations

import json
from pathlib import Path

from tllm.pooling_params import PoolerConfig

# sentence-transformers' pooling modes -> ours
_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
_LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max",
                "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens": "weightedmean"}
# modules that do not change what the transformer's pooled state becomes
_PASSIVE_MODULES = ("Transformer", "Normalize", "Pooling")


def pooler_config(model, folder: str | Path | None) -> PoolerConfig:
    """The model class's `default_pooling` ("last" for a decoder), overridden by the
    folder's sentence-transformers modules."""
    default = PoolerConfig(getattr(model, "default_pooling", "last"))
    modules_file = Path(folder) / "modules.json" if folder is not None else None
    if modules_file is None or not modules_file.is_file():
        return default
    modules = json.loads(modules_file.read_text())
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    unsupported = sorted(set(kinds) - set(_PASSIVE_MODULES))
    if unsupported:
        raise ValueError(f"model {folder}: sentence-transformers modules {unsupported} are "
                         "not supported (only Transformer, Pooling, Normalize)")
    pooling_type = default.pooling_type
    if "Pooling" in kinds:
        pooling_type = _pooling_type(Path(folder) / kinds["Pooling"].get("path", ""))
    return PoolerConfig(pooling_type, normalize="Normalize" in kinds)


def _pooling_type(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _LEGACY_KEYS.items() if config.get(key)]
        mode = modes[0] if len(modes) == 1 else modes
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode not in _MODES:
        raise ValueError(f"{folder}: pooling mode {mode!r} is not supported "
                         f"({', '.join(_MODES)} are)")
    if config.get("include_prompt", True) is False:
        raise ValueError(f"{folder}: pooling without the prompt's tokens is not supported")
    return _MODES[mode]
