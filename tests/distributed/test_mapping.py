"""Rank arithmetic of the Mapping, and validation of parallel arguments."""
import pytest

from tllm import LLM
from tllm.distributed.mapping import Mapping
from tllm.config import LlmArgs


def test_tp_pp_layout():
    m = Mapping(world_size=8, tp_size=2, pp_size=4, rank=5)
    assert (m.tp_rank, m.pp_rank) == (1, 2)
    assert m.tp_group == [4, 5]
    assert m.pp_group == [1, 3, 5, 7]
    assert not m.is_first_stage and not m.is_last_stage
    assert (m.prev_stage_rank, m.next_stage_rank) == (3, 7)
    assert Mapping.all_tp_groups(2, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert Mapping.all_pp_groups(2, 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert Mapping(8, 2, 4, 0).is_driver and Mapping(8, 2, 4, 7).is_last_stage


@pytest.mark.parametrize("num_layers,pp", [(7, 3), (32, 2), (80, 4), (3, 3)])
def test_stage_layers_cover_the_model_once(num_layers, pp):
    stages = [Mapping(pp, 1, pp, r).stage_layers(num_layers) for r in range(pp)]
    assert [i for s in stages for i in s] == list(range(num_layers))
    assert max(map(len, stages)) - min(map(len, stages)) <= 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(world_size=4, tp_size=2, pp_size=1), "world_size"),
    (dict(world_size=2, tp_size=2, pp_size=1, rank=2), "rank"),
    (dict(world_size=0, tp_size=0, pp_size=1), "world_size"),
])
def test_bad_mapping(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Mapping(**kwargs)


def test_too_many_stages():
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        Mapping(4, 1, 4, 0).stage_layers(2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(pipeline_parallel_size=-1), "pipeline_parallel_size"),
    (dict(tensor_parallel_size=2, kv_cache_config={"host_cache_size": 1 << 20}), "host"),
    (dict(tensor_parallel_size=2, scheduler_config={"preemption_mode": "swap"}), "swap"),
])
def test_bad_parallel_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LlmArgs(model="x", **kwargs)


def test_tp_size_must_divide_heads(tiny_llama):
    path, _ = tiny_llama  # 4 heads, 2 kv heads
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(path), tensor_parallel_size=3)
