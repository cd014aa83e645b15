"""The KV cache's memory budget: kv_cache_config.free_memory_fraction of what is free after
the weights and a step's activations, or vLLM's gpu_memory_utilization, a share of the whole
device that what the engine holds already counts against (CUDA's figures faked: no GPU)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tllm.config import KvCacheConfig
from tllm.runner.build import kv_cache_budget

GIB = 1 << 30


@pytest.fixture()
def gpu(monkeypatch):
    """A 100 GiB device with 60 GiB free, 30 GiB of it held by this process's allocator."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GIB, 100 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * GIB)
    return torch.device("cuda", 0)


def test_free_memory_fraction_is_a_share_of_what_is_free(gpu):
    assert kv_cache_budget(KvCacheConfig(free_memory_fraction=0.5), gpu, 10 * GIB) == 25 * GIB


def test_gpu_memory_utilization_is_a_share_of_the_whole_device(gpu):
    # 0.5 x 100 GiB, less the 30 GiB held and the 10 GiB of activations
    assert kv_cache_budget(KvCacheConfig(gpu_memory_utilization=0.5), gpu, 10 * GIB) == 10 * GIB
    # never more than is free, never below nothing
    assert kv_cache_budget(KvCacheConfig(gpu_memory_utilization=1.0), gpu, 10 * GIB) == 50 * GIB
    assert kv_cache_budget(KvCacheConfig(gpu_memory_utilization=0.3), gpu, 10 * GIB) == 0


def test_on_a_cpu_both_are_a_share_of_the_available_memory(monkeypatch):
    import tllm.runner.build as build
    monkeypatch.setattr(build.psutil, "virtual_memory",
                        lambda: SimpleNamespace(available=2 * GIB))
    cpu = torch.device("cpu")
    assert kv_cache_budget(KvCacheConfig(gpu_memory_utilization=0.25), cpu, 0) == GIB / 2
    assert kv_cache_budget(KvCacheConfig(free_memory_fraction=0.25), cpu, 0) == GIB / 2
