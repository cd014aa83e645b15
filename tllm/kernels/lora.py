"""The batched LoRA op (many adapters in one batch, the SGMV/BGMV idea), the step's token
grouping it reads, and its torch references. Every token of the batch has an adapter slot
(-1: none); a linear layer's output gets, per token, x @ A[slot].T @ B[slot].T added, in two
steps:

  shrink  h[t, s*R:(s+1)*R] = x[t] @ A[slot_t, s*R:(s+1)*R].T   (float32, per output slice s)
  expand  out[t, n] += h[t, s(n)*R:(s(n)+1)*R] @ B[slot_t, n].T  (n in slice s(n))

`a_stack` [slots, num_slices * R, in] and `b_stack` [slots, out, R] are static stacked buffers
(an adapter's scale is folded into its B; a lower rank is zero-padded to R). A merged layer
(q/k/v, gate/up) has one slice per projection: `bounds` are the slices' output offsets,
[0, q, q + k, q + k + v].

The step's tokens are grouped by slot once per step (tllm.kernels.lora_batch.LoraBatch) into
tiles of one slot; every layer's kernels read that one table, a program per (tile, column
block), so each program reads one adapter's weights. On CUDA the Triton kernels of
tllm.kernels.triton.lora run; elsewhere the grouped torch reference below (a matmul per
adapter present)."""
from __future__ import annotations

import torch

from tllm.kernels.lora_batch import LoraBatch, LoraKernelConfig


def lora_shrink_ref(x: torch.Tensor, a_stack: torch.Tensor,
                    indices: torch.Tensor) -> torch.Tensor:
    """h [T, num_slices * R] float32: each token's x times its adapter's A (0 for -1)."""
    h = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    for slot in _slots_present(indices):
        rows = (indices == slot).nonzero().squeeze(1)
        h[rows] = (x[rows].float() @ a_stack[slot].float().T)
    return h


def lora_expand_ref(out: torch.Tensor, h: torch.Tensor, b_stack: torch.Tensor,
                    indices: torch.Tensor, bounds: tuple[int, ...]) -> torch.Tensor:
    """out [T, N] += per slice, h's slice times the token's adapter's B rows (in place)."""
    rank = b_stack.shape[2]
    for slot in _slots_present(indices):
        rows = (indices == slot).nonzero().squeeze(1)
        for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            delta = h[rows, s * rank:(s + 1) * rank] @ b_stack[slot, start:end].float().T
            out[rows, start:end] += delta.to(out.dtype)
    return out


def lora_bmm_ref(out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor,
                 b_stack: torch.Tensor, indices: torch.Tensor,
                 bounds: tuple[int, ...]) -> torch.Tensor:
    """The same as shrink + expand, by gathering each token's A and B and two batched
    matmuls (the plain-torch way on a GPU; no host sync). Returns a new tensor."""
    slots = indices.clamp(min=0).long()
    has = (indices >= 0).to(x.dtype)[:, None]
    h = torch.bmm(a_stack[slots], (x * has)[:, :, None])[:, :, 0]  # [T, S * R]
    rank = b_stack.shape[2]
    deltas = []
    for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        b = b_stack[slots, start:end]                                # [T, n_s, R]
        deltas.append(torch.bmm(b, h[:, s * rank:(s + 1) * rank, None])[:, :, 0])
    return out + torch.cat(deltas, dim=1)


def add_lora(out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
             batch: LoraBatch, bounds: tuple[int, ...],
             config: LoraKernelConfig | None = None) -> torch.Tensor:
    """out += the LoRA deltas of every token (in place; returns out)."""
    if out.is_cuda:
        from tllm.kernels.triton import lora as triton_lora
        h = triton_lora.lora_shrink(x, a_stack, batch, config=config)
        return triton_lora.lora_expand(out, h, b_stack, batch, bounds, config=config)
    indices = batch.indices[:x.shape[0]]
    return lora_expand_ref(out, lora_shrink_ref(x, a_stack, indices), b_stack, indices, bounds)


def _slots_present(indices: torch.Tensor) -> list[int]:
    return [s for s in indices.unique().tolist() if s >= 0]
