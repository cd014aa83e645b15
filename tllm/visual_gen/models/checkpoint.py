"""Reading a diffusers `transformer/` folder into one of our transformers: config.json and
(sharded) safetensors, read shard by shard straight onto the device (no full host copy). Each
model brings its config class and its weight loader (diffusers' names → our modules)."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from tllm.loader.hf import CheckpointError, iter_safetensors, safetensors_files


def load_named(loader, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Every tensor through the loader, then its check that every weight was there."""
    for name, tensor in named_tensors:
        loader.load(name, tensor)
    loader.finish()


def transformer_from_folder(model_cls, config_cls, loader_cls, path: str | Path,
                            dtype: torch.dtype, device: str | torch.device):
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json; expected a diffusers "
                              "transformer folder")
    config = config_cls.from_dict(json.loads(config_file.read_text()))
    with torch.device("meta"):
        model = model_cls(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    load_named(loader_cls(model),
               iter_safetensors(safetensors_files(path), str(torch.device(device))))
    return model.eval()
