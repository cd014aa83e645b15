"""GGUF weights kept in llama.cpp's block formats until load, then in the form a torch kernel
multiplies (read with the `gguf` package; the loader hands over each tensor's blocks as they
lie in the file, [rows, blocks, bytes per block]).

What each GGML type becomes on the CPU (GgufConfig decides per layer):
- Q4_0, Q4_1, Q4_K, Q8_0 and Q5_0, Q5_1, Q5_K, Q6_K (the default): re-quantized per output
  channel to int8 (tllm.kernels.int8_cpu: `_weight_int8pack_mm` for few rows, the weight
  widened to bf16 a slice at a time for more). ~0.8% weight error against gguf's values for the 5/6-bit
  types, a fifth of what the formats themselves lose (tests/layers/test_gguf_method.py); at one
  row it runs as fast as the int4 kernel, and at 32 rows 3-5x faster (benchmarks/RESULTS.md).
  So is a merged layer whose projections come in different types (Q4_K q/k with a Q6_K v).
- with quantization="gguf_int4", Q4_0, Q4_1, Q4_K, Q8_0 are instead an exact repack onto
  torch's int4 kernel (`_weight_int4pack_mm_for_cpu`, groups of 32 along the input,
  w = (q - 8) * scale + zero): Q4_0 is d * (q - 8), zero 0; Q4_1 is d * q + m, zero m + 8d;
  Q4_K's 32-value sub-blocks are (d * sc) * q - dmin * m, zero 8 * d * sc - dmin * m; Q8_0 is
  two int4 planes (its low and high nibbles, two products summed). With float32 scales these
  reproduce gguf's dequantize bit for bit (Q4_1's zero m + 8d is rounded to float32: within
  2^-23 (16|d| + |m|) a weight; tests/layers/test_gguf_int4_exact.py). The weights then take
  the file's size, but that kernel's cost grows with every row (a 1000-token prefill is ~10x a
  dense bf16 one). Not the default: at one row it matches the int8 GEMV, at 32 rows it is
  1.0-3.5x slower than the int8 path, and decoding the 4-bit weight a slice at a time into a
  float32 or bf16 GEMM (eager or inductor) was slower still (benchmarks/cpu_int4mm.py,
  RESULTS.md 2026-12-06). Q5_0/Q5_1/Q5_K would map exactly as two planes (low nibble, and
  the fifth bit at scale 16d), at twice the int4 cost; Q6_K, Q3_K, Q2_K use 16-value
  sub-blocks, below the kernel's smallest group (32), so they do not map.
- any other type (Q2_K, Q3_K, IQ*, ...): dequantized at load, with one logged note.

The int4 and int8 W8A16 kernels are vectorised on x86 for bf16 only (fp32 runs a scalar loop,
~30x slower here), so activations, scales and zeros are bf16 at the kernel and the layer casts
x in and out: the int4 weights are then exact but for their scale and zero rounded to bf16
(~2^-9 relative). On CUDA the same types keep their own block formats, repacked once into
planes that Triton kernels decode in registers (tllm.layers.quant.gguf_cuda); on any other
device every layer is the dense weight in the model dtype. quantization="none" (GgufConfig's
`dequantize`) is the switch back to dense layers everywhere, as GGUF ran before its blocks
were kept. The token embedding keeps its blocks and decodes the rows it looks up (exact);
on the CPU the LM head (tied to it in SmolLM2) is int8 per vocabulary row: at
49152 x 576 its int8 product took 1.8 ms against 2.7 ms for Q8_0's two int4 planes and 5.7 ms
in float32 (batch 1, one thread); its re-quantization error is checked in SmolLM2's greedy
parity (tests/loader)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tllm.distributed import comm
from tllm.kernels.int8_cpu import int8_matmul
from tllm.layers.embedding import Embedding, LMHead
from tllm.layers.quant import gguf_cuda
from tllm.layers.quant.gguf_blocks import (COMPUTE_DTYPE, GROUP, _f16, block_shape,  # noqa: F401
                                           dequantize_blocks, int4_groups, int4_planes,
                                           quantize_rows_int8)
from tllm.layers.quant.base import (UNQUANTIZED, WEIGHT, ParamLayout, QuantConfig, QuantMethod,
                                    add_param)

INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q8_0"})
INT8_TYPES = frozenset({"Q5_0", "Q5_1", "Q5_K", "Q6_K"})
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
# llama-family layers that multiply several checkpoint projections at once (tllm.models.llama)
MERGED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight")
# a linear layer's run-time weight (class docstring); "planes": CUDA's kept blocks
Form = Literal["int4", "int8", "dense", "planes"]


def _replace(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    if hasattr(module, name):
        delattr(module, name)
    add_param(module, name, tensor, WEIGHT)


class GgufLinearMethod(QuantMethod):
    """A linear layer whose checkpoint weight is GGUF blocks of `qtype` (or, with qtype None,
    a float weight: the dequantized rows of projections stored in different types). `form`
    is what it becomes on the CPU: "int4" (exact repack), "int8" (per-channel re-quantization)
    or "dense" (the model dtype); on CUDA every kept form becomes "planes" (gguf_cuda: the
    file's blocks, or Q8_0 for float rows)."""

    name = "gguf"

    def __init__(self, qtype: str | None, form: Form,
                 compute_dtype: torch.dtype = COMPUTE_DTYPE) -> None:
        if form == "int4" and qtype not in INT4_TYPES:
            raise ValueError(f"GGUF {qtype} has no exact int4 form")
        self.qtype, self.form = qtype, form
        self.dtype = torch.get_default_dtype()   # the model's, as the layer is built
        # the kernels' activations, scales and zeros (float32: exact, a scalar loop; tests)
        self.compute_dtype = compute_dtype

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       num_shards: int) -> None:
        if self.qtype is None:
            add_param(layer, "weight", torch.empty(out_features, in_features), WEIGHT)
            return
        values, nbytes = block_shape(self.qtype)
        if in_features % values:
            raise ValueError(f"GGUF {self.qtype} stores blocks of {values} input features; "
                             f"this layer (or its tensor-parallel slice) has {in_features}")
        add_param(layer, "weight",
                  torch.empty(out_features, in_features // values, nbytes, dtype=torch.uint8),
                  ParamLayout(input_units=values))

    def process_after_loading(self, layer: nn.Module) -> None:
        raw = layer.weight.data
        if gguf_cuda.uses_planes(raw) and self.form != "dense" and \
                (self.qtype is None or gguf_cuda.has_kernel(self.qtype)):
            self.qtype = gguf_cuda.GpuLinear.convert(layer, self.qtype)
            self.form = "planes"
            return
        form = self.form if raw.device.type == "cpu" else "dense"
        if form == "int4" and raw.shape[0] % 16:  # the kernel packs 16 rows at a time
            form = "int8"
        if form == "int4":
            planes = int4_planes(raw, self.qtype)
            delattr(layer, "weight")
            for i, (q, scale, zero) in enumerate(planes):
                packed_name, sz_name = _plane_names(i)
                _replace(layer, packed_name,
                         torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
                _replace(layer, sz_name,
                         torch.stack((scale.t(), zero.t()), dim=-1).to(self.compute_dtype)
                         .contiguous())
            self.num_planes = len(planes)
        else:
            weight = raw if self.qtype is None else dequantize_blocks(raw, self.qtype)
            delattr(layer, "weight")
            if form == "int8":
                q, scale = quantize_rows_int8(weight, self.compute_dtype)
                _replace(layer, "qweight", q)
                _replace(layer, "scale", scale.to(self.compute_dtype))
            else:
                _replace(layer, "weight", weight.to(device=raw.device, dtype=self.dtype))
        self.form = form

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.form == "planes":
            return gguf_cuda.GpuLinear.apply(layer, self.qtype, x)
        if self.form == "int4":
            shape = x.shape
            x2 = x.reshape(-1, shape[-1]).to(self.compute_dtype).contiguous()
            parts = [torch.ops.aten._weight_int4pack_mm_for_cpu(x2, qweight, GROUP, sz)
                     for qweight, sz in self._planes(layer)]
            out = parts[0] if len(parts) == 1 else sum(p.float() for p in parts)
            return out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])
        if self.form == "int8":
            return int8_matmul(x, layer.qweight, layer.scale)
        return F.linear(x, layer.weight)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """float32 [out, in] as the kernel sees it (int4: unpacked by the kernel itself, from
        an identity in float32, so scales and zeros meet the values exactly as in a product)."""
        if self.form == "planes":
            return gguf_cuda.GpuLinear.dequantized_weight(layer, self.qtype)
        if self.form == "int4":
            k = layer.scales_zeros.shape[0] * GROUP
            eye = torch.eye(k, dtype=torch.float32)
            planes = [torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, qweight, GROUP, scales_zeros.float()).t().double()
                for qweight, scales_zeros in self._planes(layer)]
            return sum(planes).float()
        if self.form == "int8":
            return layer.qweight.float() * layer.scale.float()[:, None]
        return layer.weight.float()

    def _planes(self, layer: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [tuple(getattr(layer, name) for name in _plane_names(i))
                for i in range(self.num_planes)]


def _plane_names(index: int) -> tuple[str, str]:
    """Parameter names of int4 plane `index`: qweight / scales_zeros, then qweight1 / ..."""
    suffix = str(index) if index else ""
    return f"qweight{suffix}", f"scales_zeros{suffix}"


def _hold_blocks(layer: nn.Module, embedding_dim: int, qtype: str, dense: bool) -> None:
    """A vocabulary layer's weight as `qtype` blocks [its rows, blocks, bytes per block]."""
    layer.qtype, layer.dense, layer.dtype = qtype, dense, torch.get_default_dtype()
    layer.num_rows = layer.weight.shape[0]   # this rank's rows (the padded vocabulary slice)
    layer.embedding_dim = embedding_dim
    values, nbytes = block_shape(qtype)
    layer.weight = nn.Parameter(torch.empty(layer.weight.shape[0], embedding_dim // values,
                                            nbytes, dtype=torch.uint8), requires_grad=False)


def _keeps_planes(layer: nn.Module) -> bool:
    """Whether a vocabulary layer keeps its blocks as CUDA planes (or holds them already)."""
    return (not layer.dense and gguf_cuda.uses_planes(layer.weight)
            and layer.weight.dtype == torch.uint8 and gguf_cuda.has_kernel(layer.qtype))


def _planes(layer: nn.Module):
    return gguf_cuda.planes(layer.weight, layer.qtype, layer.num_rows, layer.embedding_dim)


class GgufEmbedding(Embedding):
    """The token embedding as GGUF blocks [vocab, blocks, bytes]: looked-up rows are decoded
    by gguf's own dequantize (exact, and the table stays the file's size; on CUDA the planes of
    gguf_cuda, decoded by a kernel). Dense in the model dtype on other devices, for types
    without a kernel, or when `dense`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: str,
                 dense: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim)
        _hold_blocks(self, embedding_dim, qtype, dense)

    def load_weight(self, param_name: str, tensor: torch.Tensor) -> None:
        if tensor.shape[0] != self.num_embeddings or tensor.shape[1:] != self.weight.shape[1:]:
            raise ValueError(f"checkpoint tensor {param_name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {self.num_embeddings} rows of "
                             f"{tuple(self.weight.shape[1:])} {self.qtype} blocks")
        part = tensor[self.vocab_start:self.vocab_start + self.weight.shape[0]]
        self.weight.data[:part.shape[0]].copy_(part)
        self.weight.data[part.shape[0]:].zero_()  # padding rows: never looked up

    def process_after_loading(self) -> None:
        if _keeps_planes(self):
            gguf_cuda.to_planes(self.weight, self.qtype)
        elif self.dense or self.weight.device.type != "cpu":
            make_dense(self.weight, self.qtype, self.dtype)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != torch.uint8:
            return super().forward(token_ids)
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_rows)
        if self.weight.dim() == 1:  # CUDA planes
            out = gguf_cuda.decode_rows(_planes(self), local.masked_fill(outside, 0), self.dtype)
        else:
            out = self._decode(self.weight[local.masked_fill(outside, 0)])
        if self.tp_size == 1:
            return out
        return comm.tp_all_reduce(out.masked_fill(outside[:, None], 0.0))

    def _decode(self, rows: torch.Tensor) -> torch.Tensor:
        if self.qtype == "Q8_0":  # d * q, exact in float32 as gguf computes it
            values = rows[..., 2:].contiguous().view(torch.int8).float() * _f16(rows, 0)[..., None]
            out = values.reshape(rows.shape[0], -1)
        else:
            out = dequantize_blocks(rows, self.qtype)
        return out.to(self.dtype)


class GgufLMHead(LMHead):
    """The vocabulary projection from GGUF blocks (its own, or the embedding's when tied: the
    same block parameter). On the CPU re-quantized to int8 per vocabulary row at load; on
    CUDA the planes (shared with a tied embedding) through the GGUF GEMV/GEMM; dense in the
    model dtype elsewhere or when `dense` (shared with a tied dense embedding)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: str,
                 dense: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim)
        _hold_blocks(self, embedding_dim, qtype, dense)

    load_weight = GgufEmbedding.load_weight

    def process_after_loading(self) -> None:
        if _keeps_planes(self):
            gguf_cuda.to_planes(self.weight, self.qtype)  # done already when tied
            return
        if self.dense or self.weight.device.type != "cpu":
            make_dense(self.weight, self.qtype, self.dtype)
            return
        q, scale = quantize_rows_int8(dequantize_blocks(self.weight.data, self.qtype))
        del self.weight  # a tied embedding keeps its own reference to the blocks
        self.weight = None
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.to(COMPUTE_DTYPE))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and self.weight.dim() == 1:  # CUDA planes
            logits = gguf_cuda.matmul(hidden, _planes(self))
        elif self.weight is not None:
            return super().forward(hidden)
        else:
            logits = int8_matmul(hidden, self.qweight, self.scale)
        if self.tp_size == 1:
            return logits
        return comm.tp_all_gather(logits, dim=-1)[..., :self.num_embeddings]


def make_dense(param: nn.Parameter, qtype: str, dtype: torch.dtype) -> None:
    """Blocks -> the dense weight in `dtype`, in place: a tied LM head holding the same
    parameter sees it too (and then finds nothing left to do)."""
    if param.dtype == torch.uint8:
        param.data = dequantize_blocks(param.data, qtype).to(device=param.device, dtype=dtype)


@dataclass(frozen=True)
class GgufConfig(QuantConfig):
    """The GGML type of every checkpoint tensor (HF names, e.g. "layers.0.mlp.up_proj.weight"
    -> "Q4_1") and what each linear layer becomes (module docstring). `dequantize`
    (quantization="none"): every weight dense in the model dtype, as gguf dequantizes it."""

    tensor_types: dict[str, str] = field(default_factory=dict, compare=False)
    dequantize: bool = False
    # Q4_0/Q4_1/Q4_K/Q8_0 as exact int4 planes (quantization="gguf_int4": the file's size in
    # memory, but the int4 kernel's cost grows with every row) instead of int8 per channel
    exact_int4: bool = False
    name = "gguf"

    def dequantized_types(self) -> set[str]:
        """The quantized types in the file whose linear layers are dense (no kept form)."""
        return set(self.tensor_types.values()) - INT4_TYPES - INT8_TYPES - FLOAT_TYPES

    def keeps_blocks(self, hf_name: str) -> bool:
        """Whether the loader hands this tensor over as its blocks (else dequantized to
        float32): quantized, and for a merged layer's projection, all of them in one type."""
        qtype = self.tensor_types.get(hf_name)
        if qtype is None or qtype in FLOAT_TYPES:
            return False
        return hf_name in VOCAB_TENSORS or len(set(self._group_types(hf_name))) == 1

    def linear_method(self, prefix: str, shard_names: tuple[str, ...] = ()) -> QuantMethod:
        parent, _, leaf = prefix.rpartition(".")
        names = [f"{parent}.{shard}.weight" for shard in shard_names or (leaf,)]
        types = {self.tensor_types.get(name) for name in names}
        if types & {None} or types <= FLOAT_TYPES:
            return UNQUANTIZED
        if len(types) > 1:  # merged projections in different types: float rows -> one form
            return UNQUANTIZED if self.dequantize else GgufLinearMethod(None, "int8")
        (qtype,) = types
        return GgufLinearMethod(qtype, self._form(qtype))

    def moe_method(self, prefix: str):
        """Experts come dequantized from the loader (tllm.loader.gguf): the unquantized MoE
        method, in the model dtype."""
        from tllm.layers.moe import UNQUANTIZED_MOE
        return UNQUANTIZED_MOE

    def embedding_layer(self, vocab_size: int, hidden_size: int) -> nn.Module | None:
        """The token embedding kept in its blocks, or None where the tensor is float."""
        if not self.keeps_blocks("embed_tokens.weight"):
            return None
        return GgufEmbedding(vocab_size, hidden_size, self.tensor_types["embed_tokens.weight"],
                             self.dequantize)

    def lm_head_layer(self, vocab_size: int, hidden_size: int, tied: bool) -> nn.Module | None:
        """The LM head from blocks (the embedding's when tied), or None where it is float."""
        name = "embed_tokens.weight" if tied else "lm_head.weight"
        if not self.keeps_blocks(name):
            return None
        return GgufLMHead(vocab_size, hidden_size, self.tensor_types[name], self.dequantize)

    def _form(self, qtype: str) -> Form:
        if self.dequantize:
            return "dense"
        if qtype in INT4_TYPES:
            return "int4" if self.exact_int4 else "int8"
        return "int8" if qtype in INT8_TYPES else "dense"

    def _group_types(self, hf_name: str) -> list[str | None]:
        for group in MERGED_PROJECTIONS:
            for leaf in group:
                if f".{leaf}." in hf_name:
                    return [self.tensor_types.get(hf_name.replace(f".{leaf}.", f".{other}."))
                            for other in group]
        return [self.tensor_types.get(hf_name)]
