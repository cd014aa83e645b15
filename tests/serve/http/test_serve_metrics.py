"""/metrics parses with prometheus_client's parser and its counters move as requests
complete."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import MODEL
from tests.serve.helpers import wait_until_idle

pytestmark = pytest.mark.slow
ENGINE_GAUGES = ("tllm:num_requests_running", "tllm:num_requests_waiting",
                 "tllm:kv_cache_usage_perc")
HISTOGRAMS = ("tllm:time_to_first_token_seconds", "tllm:inter_token_latency_seconds",
              "tllm:e2e_request_latency_seconds", "tllm:request_queue_time_seconds",
              "tllm:request_prompt_tokens", "tllm:request_generation_tokens")


def scrape(http) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of every sample."""
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text)
            for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    labels = {"model_name": MODEL, **labels}
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_name_everything(http):
    samples = scrape(http)
    names = {name for name, _ in samples}
    for name in ENGINE_GAUGES + ("tllm:num_preemptions_total", "tllm:prompt_tokens_total",
                                 "tllm:generation_tokens_total",
                                 "tllm:request_success_total"):
        assert name in names, name
    for name in HISTOGRAMS:
        assert f"{name}_bucket" in names and f"{name}_count" in names, name
    assert 0.0 <= value(samples, "tllm:kv_cache_usage_perc") <= 1.0


def test_counters_move_as_requests_complete(http, smollm2):
    wait_until_idle(smollm2)
    before = scrape(http)
    prompt = "The capital of France is"
    for _ in range(2):
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                      "max_tokens": 5, "ignore_eos": True})
        assert response.status_code == 200
    stream = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "ignore_eos": True, "stream": True})
    assert stream.text.endswith("data: [DONE]\n\n")
    after = scrape(http)

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    num_prompt = len(smollm2.tokenizer.encode(prompt))
    chat_prompt = len(smollm2.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]))
    assert delta("tllm:prompt_tokens_total") == 2 * num_prompt + chat_prompt
    assert delta("tllm:generation_tokens_total") == 2 * 5 + 3
    assert delta("tllm:request_success_total", finished_reason="length") == 3
    assert delta("tllm:time_to_first_token_seconds_count") == 3
    assert delta("tllm:e2e_request_latency_seconds_count") == 3
    assert delta("tllm:inter_token_latency_seconds_count") == 2 * 4 + 2
    assert delta("tllm:request_generation_tokens_sum") == 13
    http_key = ("tllm:http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    assert after[http_key] - before.get(http_key, 0.0) == 2
    assert value(after, "tllm:num_requests_running") == 0


def test_prefix_cache_metrics_move_on_a_repeated_prompt(http, smollm2):
    wait_until_idle(smollm2)
    prompt = "Repeat after me: " + "the quick brown fox jumps over the lazy dog. " * 8
    before = scrape(http)
    for _ in range(2):
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                      "max_tokens": 2})
        assert response.status_code == 200
    after = scrape(http)
    reused = "tllm:prefix_cache_blocks_reused_total"
    assert value(after, reused) > value(before, reused)
    assert 0.0 < value(after, "tllm:prefix_cache_hit_rate") <= 1.0
