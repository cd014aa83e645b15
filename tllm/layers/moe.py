"""Mixture-of-experts feed-forward: a router (`select_experts`) and `FusedMoE`, every local
expert's weights stacked so that one grouped kernel (tllm.kernels.moe.fused_experts) runs them
all: w13 [E_local, 2 I_local, H] (each expert's gate rows, then its up rows), w2
[E_local, H, I_local].

Parallelism (tllm.distributed.Mapping) over the tensor-parallel ranks:
- tensor parallelism (the default): each expert's intermediate features are sliced across the
  ranks (gate/up rows, down columns) and the partial outputs summed by one all-reduce after
  down, as a RowParallelLinear does;
- expert parallelism (`enable_expert_parallel`): whole experts on the ranks, E / tp each,
  none sliced; each rank adds the outputs of the (token, expert) pairs routed to its own
  experts, and the same all-reduce sums them.
The hidden states are replicated on the tp ranks after attention, so either way the layer
costs one [tokens, hidden] all-reduce. An all-to-all dispatch of tokens to their experts'
ranks only moves less data once attention is data-parallel (each rank its own tokens), which
tllm does not do.

How expert weights are stored and multiplied is the layer's MoE method (`moe_method`), as a
linear layer's is its QuantMethod: unquantized, or FP8 (tllm.layers.quant.fp8_moe); a
quantization scheme that has no MoE method is refused when the model is built. A method may
turn a checkpoint tensor into the layout `load_expert` slices (`checkpoint_tensor`)."""
from __future__ import annotations

import torch
from torch import nn

from tllm.distributed import comm
from tllm.kernels.moe import fused_experts
from tllm.kernels.moe_routing import MoeRouting, route_experts
from tllm.layers.linear import Linear, _copy_checked
from tllm.layers.quant.base import QuantConfig

W13, W2 = "w13_weight", "w2_weight"


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (in float32), the top_k of each token, renormalised to sum
    to 1 when `renormalize`: (weights [T, k] float32, expert ids [T, k]); one fused launch
    on CUDA (tllm.kernels.moe_routing)."""
    return route_experts(router_logits, MoeRouting(top_k, renormalize=renormalize))


class UnquantizedMoEMethod:
    """The experts' weights in the model's dtype. A quantized method keeps the same three
    hooks (and may register its own scales next to the weights)."""

    name = "none"

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_size: int) -> None:
        """Register this rank's stacked parameters; `intermediate_dims` records which dim
        of one expert's slice follows the (tp-sliced) intermediate features."""
        layer.add_expert_param(W13, torch.empty(num_experts, 2 * intermediate_size,
                                                hidden_size), intermediate_dim=0)
        layer.add_expert_param(W2, torch.empty(num_experts, hidden_size, intermediate_size),
                               intermediate_dim=1)

    def process_after_loading(self, layer: FusedMoE) -> None:
        """Every expert is loaded (a quantized method converts here)."""

    def apply(self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                             layer.expert_start)


UNQUANTIZED_MOE = UnquantizedMoEMethod()


def moe_method(quant_config: QuantConfig | None, prefix: str):
    """The MoE method of the experts at `prefix`: the scheme's own (`moe_method`) where it
    has one, unquantized without a scheme; a scheme without one is refused."""
    if quant_config is None:
        return UNQUANTIZED_MOE
    own = getattr(quant_config, "moe_method", None)
    if own is None:
        raise ValueError(f"{quant_config.name!r} quantization of mixture-of-experts layers "
                         f"({prefix}) is not supported yet; run the model from an unquantized "
                         "16/32-bit checkpoint without `quantization`")
    return own(prefix)


class FusedMoE(nn.Module):
    """This rank's experts of one MoE layer, stacked (module docstring). Takes the routing
    (`select_experts`) and returns the weighted sum of the experts' outputs, summed over the
    tp ranks."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 quant_config: QuantConfig | None = None, prefix: str = "experts",
                 method=None) -> None:
        super().__init__()
        mapping = comm.mapping()
        self.tp_rank, self.tp_size = mapping.moe_tp_rank, mapping.moe_tp_size
        ep_rank, ep_size = mapping.moe_ep_rank, mapping.moe_ep_size
        if num_experts % ep_size:
            raise ValueError(f"tensor_parallel_size ({ep_size}) must divide the model's "
                             f"{num_experts} experts with enable_expert_parallel")
        if intermediate_size % self.tp_size:
            raise ValueError(f"tensor_parallel_size ({self.tp_size}) must divide the experts' "
                             f"intermediate size ({intermediate_size})")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_start = ep_rank * self.num_local_experts  # first global id held here
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size // self.tp_size  # per rank
        self.intermediate_dims: dict[str, int | None] = {}
        self.intermediate_units: dict[str, int] = {}  # features per element (scale blocks)
        # a model whose experts differ from the SiLU-gated kind passes its own method
        self.quant = method if method is not None else moe_method(quant_config, prefix)
        self.quant.create_weights(self, self.num_local_experts, hidden_size,
                                  self.intermediate_size)
        self.expert_load_hook = None   # counts the routing when asked (moe_load.py)

    def add_expert_param(self, name: str, tensor: torch.Tensor,
                         intermediate_dim: int | None, units: int = 1) -> None:
        """`units`: intermediate features one element along intermediate_dim covers (a
        weight-scale block's side); it must divide the per-rank intermediate size."""
        self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        self.intermediate_dims[name] = intermediate_dim
        self.intermediate_units[name] = units

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if self.expert_load_hook is not None:
            self.expert_load_hook(topk_ids)
        return comm.tp_all_reduce(self.quant.apply(self, hidden, topk_weights, topk_ids))

    def process_after_loading(self) -> None:
        self.quant.process_after_loading(self)

    def is_local(self, expert_id: int) -> bool:
        return 0 <= expert_id - self.expert_start < self.num_local_experts

    def load_expert(self, param_name: str, expert_id: int, shard: int | None,
                    tensor: torch.Tensor) -> set[str]:
        """One expert's full (unsplit) checkpoint tensor: w13 shard 0 (gate [I, H]) or 1
        (up [I, H]), or w2 (down [H, I], shard None); this rank keeps its slice. An expert
        of another rank is skipped. Returns the keys loaded (see `expected_keys`)."""
        if param_name not in self.intermediate_dims:
            raise ValueError(f"{type(self).__name__} has no expert parameter {param_name!r}")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"checkpoint expert {expert_id} is outside the model's "
                             f"{self.num_experts} experts")
        if not self.is_local(expert_id):
            return set()
        what = f"{param_name} of expert {expert_id}"
        param = getattr(self, param_name).data[expert_id - self.expert_start]
        convert = getattr(self.quant, "checkpoint_tensor", None)  # a format's own layout
        if convert is not None:
            tensor = convert(self, param_name, expert_id, shard, tensor)
        dim = self.intermediate_dims[param_name]
        size = self.intermediate_size // self.intermediate_units[param_name]
        if dim is not None:
            if tensor.dim() != param.dim() or tensor.shape[dim] != size * self.tp_size:
                raise ValueError(f"checkpoint tensor for {what} has shape "
                                 f"{tuple(tensor.shape)}, expected {size * self.tp_size} "
                                 f"intermediate features along dim {dim}")
            tensor = tensor.narrow(dim, self.tp_rank * size, size)
            if shard is not None:
                param = param.narrow(dim, shard * size, size)
        _copy_checked(param, tensor, what)
        return {f"{param_name}#{expert_id}.{shard}"}

    def load_stacked(self, param_name: str, tensor: torch.Tensor) -> set[str]:
        """Every expert in one tensor (transformers 5's layout): gate_up [E, 2I, H] for w13
        (gate rows, then up rows), down [E, H, I] for w2."""
        if tensor.dim() < 1 or tensor.shape[0] != self.num_experts:
            raise ValueError(f"stacked checkpoint tensor for {param_name} has shape "
                             f"{tuple(tensor.shape)}; expected {self.num_experts} experts "
                             "along dim 0")
        keys: set[str] = set()
        for expert in range(self.expert_start, self.expert_start + self.num_local_experts):
            if param_name == W13:
                gate, up = tensor[expert].chunk(2, dim=self.intermediate_dims[W13])
                keys |= self.load_expert(W13, expert, 0, gate)
                keys |= self.load_expert(W13, expert, 1, up)
            else:
                keys |= self.load_expert(param_name, expert, None, tensor[expert])
        return keys

    def expected_keys(self) -> set[str]:
        """What a complete checkpoint loads into this rank: every local expert's gate, up
        and down (and whatever else the method registers: a w13* parameter has the gate
        and up shards, any other one is whole)."""
        experts = range(self.expert_start, self.expert_start + self.num_local_experts)
        keys = set()
        for name in self.intermediate_dims:
            shards = (0, 1) if name.startswith("w13") else (None,)
            keys |= {f"{name}#{e}.{s}" for e in experts for s in shards}
        return keys


class SparseMoeBlock(nn.Module):
    """The feed-forward of a MoE layer: a replicated router (`gate`, never quantized) that
    picks each token's top_k experts, and the experts."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, quant_config: QuantConfig | None = None,
                 prefix: str = "mlp") -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the "
                             f"model's {num_experts} experts")
        self.top_k, self.renormalize = top_k, renormalize
        self.routing = MoeRouting(top_k, renormalize=renormalize)
        self.gate = Linear(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, quant_config,
                                f"{prefix}.experts")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = route_experts(self.gate(hidden), self.routing)
        return self.experts(hidden, weights, ids)
