"""What the state-space hybrids (NemotronH, Granite 4.0-H, Qwen3-Next) share: their limits
for now, and weight loading where each checkpoint tensor, once its prefix is stripped, names
one parameter of ours."""
from __future__ import annotations

import torch
from torch import nn

from tllm.distributed import comm
from tllm.layers.linear import _copy_checked


def check_single_rank_unquantized(name: str, quant_config) -> None:
    """The hybrids run on one rank, unquantized, for now: a ValueError saying which."""
    if comm.state() is not None and comm.mapping().world_size > 1:
        raise ValueError(f"{name} runs on one rank for now (tp_size and pp_size 1)")
    if quant_config is not None:
        raise ValueError(f"quantization: {name} runs unquantized for now")


def load_by_name(model: nn.Module, params: dict[str, nn.Parameter], name: str,
                 tensor: torch.Tensor) -> str:
    """Copy `tensor` into the parameter `name` (through its module's load_weight where it has
    one); the loaded-weights key."""
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
    module_name, param_name = name.rsplit(".", 1)
    module = model.get_submodule(module_name)
    if hasattr(module, "load_weight"):
        module.load_weight(param_name, tensor)
    else:
        _copy_checked(params[name], tensor, name)
    return f"{name}#None"


def expected_by_name(model: nn.Module, tied: bool) -> set[str]:
    """Every parameter's key, less a tied LM head's (it is the embedding)."""
    expected = {f"{name}#None" for name, _ in model.named_parameters()}
    if tied:
        expected.discard("lm_head.weight#None")
    return expected
