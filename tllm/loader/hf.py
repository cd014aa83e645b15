"""HF model directories: config.json, safetensors weights (sharded or not; PyTorch .bin
files in older ones), tokenizer files."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch


class CheckpointError(ValueError):
    """A model path that cannot be loaded: missing, incomplete or corrupt."""


def load_hf_config(model_dir: Path):
    from transformers import AutoConfig
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{model_dir} has no config.json; expected an HF model directory")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file} is not valid JSON: {exc}") from None
    if not raw.get("architectures"):
        raise CheckpointError(f"{config_file} names no architectures")
    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"cannot read {config_file}: {exc}") from None


def safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} has no *.safetensors weight files")
    return files


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files, else (an older checkpoint) its PyTorch .bin files."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        files = sorted(model_dir.glob("pytorch_model*.bin"))
    if not files:
        raise CheckpointError(f"{model_dir} has no *.safetensors (or pytorch_model*.bin) "
                              "weight files")
    return files


def iter_weights(files: list[Path], device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    if files and files[0].suffix == ".bin":
        return iter_torch_bins(files, device)
    return iter_safetensors(files, device)


def count_tensors(files: list[Path]) -> int | None:
    """How many tensors the safetensors files hold (their headers only); None for .bin
    files, which tell only once loaded."""
    if not files or files[0].suffix == ".bin":
        return None
    from safetensors import SafetensorError, safe_open
    count = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                count += len(f.keys())
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"corrupt or unreadable weight file {file}: {exc}") from None
    return count


def iter_torch_bins(files: list[Path], device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Plain state dicts of tensors only: weights_only refuses anything that would run code."""
    for file in files:
        try:
            state = torch.load(file, map_location=device, weights_only=True)
        except (OSError, RuntimeError, EOFError) as exc:
            raise CheckpointError(f"corrupt or unreadable weight file {file}: {exc}") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{file} is not a state dict of tensors")
        yield from state.items()
        del state


def iter_safetensors(files: list[Path], device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device=device) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"corrupt or unreadable weight file {file}: {exc}") from None


def generation_eos_ids(model_dir: Path) -> set[int]:
    """EOS ids from generation_config.json (Llama 3 lists several)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return set()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except json.JSONDecodeError:
        return set()
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}


def has_tokenizer(model_dir: Path) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any((model_dir / n).is_file() for n in names)
