"""One step as every rank sees it: a host-only `StepPlan` (what rank 0 decided, as a diff of
the persistent batch), the device tensors built from it, and the forward pass of this
rank's part of the model.

Rank 0 builds the plan from its ScheduledBatch and, with several ranks, broadcasts it to the
others; every rank applies the plan's diff to its own batch tables, builds the same inputs,
then runs `RankModel.run` on its own shard and KV cache, which holds the one order of
collectives all ranks follow. Keeping the plan free of Request objects and of whole tables
is what lets it cross process boundaries cheaply."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from tllm.attention.interface import AttentionMetadata
from tllm.distributed import comm
from tllm.runner.batch_state import BatchTables, StepArrays, StepDiff
from tllm.upload import Uploader
from tllm.sampling.last_stage import SamplingPlan


@dataclass
class StepPlan:
    diff: StepDiff
    logit_rows: np.ndarray        # rows whose logits are needed (int64)
    use_graph: bool = False       # decode step replayed from a captured CUDA graph
    use_piecewise: bool = False   # a step with prompt tokens: piecewise graphs
    ids_from_driver: bool = False  # rank 0 broadcasts its input ids (tensor parallelism)
    # pipeline parallelism: what the last stage samples (the first len(row_request_ids)
    # logit rows; the rest are prompt-logprob rows, sent to rank 0 as logits)
    sampling: SamplingPlan | None = None
    layer_groups: tuple[int, ...] = ()  # each model layer's KV cache group (several)
    # LoRA: each request's adapter slot (-1: none), and the adapters to load into their
    # slots before this step (every rank loads its own shard); None without LoRA
    lora_slots: list[int] | None = None
    lora_loads: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.diff.num_tokens

    @property
    def query_lens(self) -> list[int]:
        return self.diff.query_lens.tolist()


STOP = "stop"  # the plan rank 0 sends when it shuts down


@dataclass
class StepTensors:
    input_ids: torch.Tensor
    metadata: AttentionMetadata
    logit_rows: torch.Tensor
    # a vision-language model's (rows, image embeddings) replacing those rows' embeddings
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # a BERT-style model's segment ids of a pair (rank 0, pooling steps only)
    token_type_ids: torch.Tensor | None = None


def step_tensors(arrays: StepArrays, input_ids: np.ndarray, logit_rows: np.ndarray,
                 layer_groups: tuple[int, ...], tokens_per_block: int,
                 longs: Uploader, ints: Uploader) -> StepTensors:
    """The step's inputs on the device, in two transfers (64-bit and 32-bit values)."""
    groups = len(arrays.group_slot_mappings)
    request_slots = (arrays.request_slots if arrays.request_slots is not None
                     else np.zeros(0, dtype=np.int64))
    ids, positions, slots, rows, device_request_slots, *group_slots = longs.upload(
        [input_ids, arrays.positions, arrays.slot_mapping, logit_rows, request_slots,
         *arrays.group_slot_mappings])
    query_start_loc, seq_lens, tables, *group_tables = ints.upload(
        [arrays.query_start_loc, arrays.seq_lens, arrays.block_tables,
         *arrays.group_block_tables])
    query_lens = np.diff(arrays.query_start_loc)
    metadata = AttentionMetadata(
        positions=positions, slot_mapping=slots, query_start_loc=query_start_loc,
        seq_lens=seq_lens, block_tables=tables,
        max_query_len=int(query_lens.max()), max_seq_len=int(arrays.seq_lens.max()),
        tokens_per_block=tokens_per_block,
        query_lens_cpu=query_lens.tolist(), seq_lens_cpu=arrays.seq_lens.tolist(),
        request_slots_cpu=request_slots.tolist(),
        request_slots=None if arrays.request_slots is None else device_request_slots)
    if groups:
        metadata.add_group_views(layer_groups, list(zip(group_slots, group_tables)))
    return StepTensors(ids, metadata, rows)


def run_plan(model: nn.Module, kv_caches, graphs, piecewise, plan: StepPlan,
             tensors: StepTensors, on_hidden=None) -> torch.Tensor | None:
    """This rank's part of the step: the logits of `plan.logit_rows` on the last pipeline
    stage (all rows when replaying a decode graph), None on the others, which hand their
    hidden states to the next stage instead. `on_hidden`: given the final hidden states
    (every row) first, where the step has pooling requests."""
    if plan.use_graph:
        return graphs.run(tensors.input_ids, tensors.metadata)
    if plan.use_piecewise:
        hidden = piecewise.run(tensors.input_ids, tensors.metadata)
        if on_hidden is not None:
            on_hidden(hidden)
        return model.compute_logits(hidden[tensors.logit_rows])
    intermediate = None
    if not model.is_first_stage:
        shape = (plan.num_tokens, model.config.hidden_size)
        intermediate = tuple(comm.recv_from_prev_stage([shape, shape], model.activation_dtype))
    extra = {} if tensors.mm_embeds is None else {"mm_embeds": tensors.mm_embeds}
    if tensors.token_type_ids is not None:
        extra["token_type_ids"] = tensors.token_type_ids
    out = model(tensors.input_ids, kv_caches, tensors.metadata, intermediate, **extra)
    if not model.is_last_stage:
        for work in comm.send_to_next_stage(list(out)):
            work.wait()  # on CUDA this orders the streams; the host does not block
        return None
    if on_hidden is not None:
        on_hidden(out)
    return model.compute_logits(out[tensors.logit_rows])


class RankModel:
    """This rank's model shard with its KV cache tensors, graphs and batch tables: what
    runs a step."""

    def __init__(self, model: nn.Module, kv_caches: list, graphs, device: torch.device,
                 tables: BatchTables, lora=None, piecewise=None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.graphs = graphs            # a CudaGraphRunner, or None
        self.piecewise = piecewise      # a PiecewiseGraphRunner, or None
        self.device = device
        self.tables = tables
        self.lora = lora                # this rank's tllm.lora.layers.LoraModel, or None
        self._longs = Uploader(device, torch.int64)
        self._ints = Uploader(device, torch.int32)
        self.expert_load = getattr(model, "expert_load", None)  # moe_load_stats

    def run(self, plan: StepPlan, arrays: StepArrays | None = None,
            input_ids: np.ndarray | None = None,
            patch_ids=None, multimodal=None, pooling=None) -> torch.Tensor | None:
        """This rank's part of a step whose plan every rank has. Rank 0 passes the arrays
        it built already and the host's input ids, and `patch_ids` writes the ids only its
        device has; other ranks apply the plan's diff themselves and, when asked, receive
        the ids from rank 0. `multimodal`: rank 0's StepMultimodal (a vision-language
        model runs on one rank). `pooling`: rank 0's (segment ids or None, on_hidden) of a
        step with pooling requests. Then the forward (pipeline sends/receives inside)."""
        if arrays is None:
            self.tables.apply(plan.diff.table_writes)
            arrays = self.tables.build(plan.diff)
        if input_ids is None:
            input_ids = np.zeros(plan.num_tokens, dtype=np.int64)
        if self.lora is not None and plan.lora_slots is not None:
            self.lora.begin_step(plan.lora_loads, plan.lora_slots, plan.query_lens)
        tensors = step_tensors(arrays, input_ids, plan.logit_rows, plan.layer_groups,
                               self.tables.tokens_per_block, self._longs, self._ints)
        if patch_ids is not None:
            patch_ids(tensors.input_ids)
        if multimodal is not None:
            self._add_multimodal(tensors, multimodal)
        if plan.ids_from_driver and comm.mapping().is_first_stage:
            comm.tp_broadcast_from_driver(tensors.input_ids)
        on_hidden = None
        if pooling is not None:
            token_types, on_hidden = pooling
            if token_types is not None:
                tensors.token_type_ids = torch.from_numpy(token_types).to(self.device)
        if self.expert_load is not None:
            self.expert_load.begin_step(plan.num_tokens)
        return run_plan(self.model, self.kv_caches, self.graphs, self.piecewise, plan,
                        tensors, on_hidden)

    def _add_multimodal(self, tensors: StepTensors, multimodal) -> None:
        if multimodal.mrope_positions is not None:
            positions = torch.from_numpy(multimodal.mrope_positions).to(self.device,
                                                                        non_blocking=True)
            for view in [tensors.metadata, *tensors.metadata.group_views]:
                view.mrope_positions = positions
        if multimodal.causal_limits is not None:
            limits = torch.from_numpy(multimodal.causal_limits).to(self.device,
                                                                   non_blocking=True)
            for view in [tensors.metadata, *tensors.metadata.group_views]:
                view.causal_limits = limits
        if multimodal.embeds is not None:
            rows = torch.from_numpy(multimodal.embed_rows).to(self.device, non_blocking=True)
            tensors.mm_embeds = (rows, multimodal.embeds)
