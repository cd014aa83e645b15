"""The KV cache's storage dtype and capacity in tokens reach get_stats() and /metrics."""
from __future__ import annotations

from prometheus_client import generate_latest

from tllm import LLM, KvCacheConfig
from tllm.serve.http.metrics import ServerMetrics


def test_stats_and_metrics_report_the_kv_dtype_and_capacity(tiny_llama):
    path, _ = tiny_llama
    for dtype, name in (("auto", "float32"), ("fp8", "float8_e4m3fn")):
        config = KvCacheConfig(dtype=dtype, max_tokens=256, tokens_per_block=16)
        with LLM(str(path), kv_cache_config=config) as llm:
            stats = llm.get_stats()
            assert stats["kv_cache_dtype"] == name and stats["kv_capacity_tokens"] == 256
            text = generate_latest(ServerMetrics("m", llm.get_stats).registry).decode()
    assert ('tllm:kv_cache_capacity_tokens{kv_cache_dtype="float8_e4m3fn",model_name="m"} '
            '256.0') in text
