"""One step as every rank sees it: a host-only `StepPlan` (what rank 0 decided), the device
tensors built from it, and the forward pass of this rank's part of the model.

Rank 0 builds the plan from its ScheduledBatch and, with several ranks, broadcasts it to the
others; every rank then runs `RankModel.run` on its own shard and KV cache, which holds the
one order of collectives all ranks follow. Keeping the plan free of Request objects is what
lets it cross process boundaries."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from tllm.attention.interface import AttentionMetadata
from tllm.distributed import comm
from tllm.sampling.last_stage import SamplingPlan


@dataclass
class StepPlan:
    input_ids: list[int]          # placeholders (tokens still on rank 0's device) are 0 here
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]  # padded to one width
    logit_rows: list[int] = field(default_factory=list)  # rows whose logits are needed
    use_graph: bool = False       # decode step replayed from a captured CUDA graph
    ids_from_driver: bool = False  # rank 0 broadcasts its (placeholder-filled) input ids
    # pipeline parallelism: what the last stage samples (the first len(row_request_ids)
    # logit rows; the rest are prompt-logprob rows, sent to rank 0 as logits)
    sampling: SamplingPlan | None = None
    # several KV cache groups (sliding-window layers): groups 1..'s slots and padded block
    # tables (slots and block_tables above are group 0's), and each model layer's group
    group_slots: list[list[int]] = field(default_factory=list)
    group_block_tables: list[list[list[int]]] = field(default_factory=list)
    layer_groups: tuple[int, ...] = ()
    # LoRA: each request's adapter slot (-1: none), and the adapters to load into their
    # slots before this step (every rank loads its own shard); None without LoRA
    lora_slots: list[int] | None = None
    lora_loads: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode_only(self) -> bool:
        return max(self.query_lens) == 1


STOP = "stop"  # the plan rank 0 sends when it shuts down


def plan_tensors(plan: StepPlan, device: torch.device,
                 tokens_per_block: int) -> tuple[torch.Tensor, AttentionMetadata]:
    def to_device(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    query_start = [0, *itertools.accumulate(plan.query_lens)]
    metadata = AttentionMetadata(
        positions=to_device(plan.positions, torch.long),
        slot_mapping=to_device(plan.slots, torch.long),
        query_start_loc=to_device(query_start, torch.int32),
        seq_lens=to_device(plan.seq_lens, torch.int32),
        block_tables=to_device(plan.block_tables, torch.int32),
        max_query_len=max(plan.query_lens), max_seq_len=max(plan.seq_lens),
        tokens_per_block=tokens_per_block,
        query_lens_cpu=plan.query_lens, seq_lens_cpu=plan.seq_lens)
    if plan.group_slots:
        metadata.add_group_views(plan.layer_groups, [
            (to_device(slots, torch.long), to_device(tables, torch.int32))
            for slots, tables in zip(plan.group_slots, plan.group_block_tables)])
    return to_device(plan.input_ids, torch.long), metadata


def run_plan(model: nn.Module, kv_caches, graphs, plan: StepPlan, input_ids: torch.Tensor,
             metadata: AttentionMetadata) -> torch.Tensor | None:
    """This rank's part of the step: the logits of `plan.logit_rows` on the last pipeline
    stage (all rows when replaying a graph), None on the others, which hand their hidden
    states to the next stage instead."""
    if plan.use_graph:
        return graphs.run(input_ids, metadata)
    intermediate = None
    if not model.is_first_stage:
        shape = (plan.num_tokens, model.config.hidden_size)
        intermediate = tuple(comm.recv_from_prev_stage([shape, shape], model.activation_dtype))
    out = model(input_ids, kv_caches, metadata, intermediate)
    if not model.is_last_stage:
        for work in comm.send_to_next_stage(list(out)):
            work.wait()  # on CUDA this orders the streams; the host does not block
        return None
    rows = torch.tensor(plan.logit_rows, dtype=torch.long).to(out.device, non_blocking=True)
    return model.compute_logits(out[rows])


@dataclass
class RankModel:
    """This rank's model shard with its KV cache tensors and graphs: what runs a step."""

    model: nn.Module
    kv_caches: list
    graphs: object | None      # a CudaGraphRunner, or None
    device: torch.device
    tokens_per_block: int
    lora: object | None = None  # this rank's tllm.lora.layers.LoraModel, with LoRA on

    def run(self, plan: StepPlan,
            fill_placeholders: Callable[[torch.Tensor], None] | None = None
            ) -> torch.Tensor | None:
        """This rank's part of a step whose plan every rank has (rank 0 broadcast it): the
        input tensors; rank 0 fills the ids still on its device and, when asked, sends them
        to its tensor-parallel peers; then the forward (pipeline sends/receives inside)."""
        if self.lora is not None and plan.lora_slots is not None:
            self.lora.begin_step(plan.lora_loads, plan.lora_slots, plan.query_lens)
        input_ids, metadata = plan_tensors(plan, self.device, self.tokens_per_block)
        if fill_placeholders is not None:
            fill_placeholders(input_ids)
        if plan.ids_from_driver and comm.mapping().is_first_stage:
            comm.tp_broadcast_from_driver(input_ids)
        return run_plan(self.model, self.kv_caches, self.graphs, plan, input_ids, metadata)

