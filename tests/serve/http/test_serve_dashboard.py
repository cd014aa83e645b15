"""The live dashboard: its sliding windows, its JSON against /metrics, and the page itself in
a real headless Chromium (Debian's, driven by playwright): it loads without console errors,
its numbers move while a load runs, and they match /metrics once the load is over."""
from __future__ import annotations

import os
import random
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.browser import launch_browser
from tests.serve.helpers import wait_until_idle
from tllm.serve.context import ServerConfig
from tllm.serve.http.metrics import WindowedCounter, WindowedQuantiles
from tllm.serve.http.app import build_app
from tllm.serve.testing import FakeLLM, ServerThread

COMPLETION = {"model": "fake", "prompt": "hello", "max_tokens": 20}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_windowed_quantiles_are_close_and_forget_old_values():
    clock = Clock()
    window = WindowedQuantiles(window_s=60, clock=clock)
    assert window.quantiles((0.5,)) == [None]
    rng = random.Random(0)
    values = sorted(rng.lognormvariate(-4, 1.5) for _ in range(5000))
    for i, value in enumerate(values):
        clock.now = 1000 + i / 100     # 50 s of observations
        window.observe(value)
    for q in (0.5, 0.9, 0.99):
        exact = values[int(q * len(values)) - 1]
        assert window.quantiles((q,))[0] == pytest.approx(exact, rel=0.06)
    assert window.count() == 5000
    clock.now = 1089.5      # seconds 1000-1029 have left the (60 s) window
    assert window.count() == 5000 - 3000
    clock.now += 60
    assert window.count() == 0 and window.quantiles((0.5, 0.9)) == [None, None]


def test_windowed_counter_rate():
    clock = Clock()
    counter = WindowedCounter(window_s=10, clock=clock)
    for _ in range(20):
        clock.now += 1
        counter.add(50)
    assert counter.rate() == pytest.approx(50, rel=0.11)
    clock.now += 20
    assert counter.rate() == 0


def _metrics(client: httpx.Client) -> dict[str, float]:
    """/metrics as {name or name{label=...}: value}, without the model_name label."""
    values = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())
                              if k != "model_name")
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


class Load(threading.Thread):
    """Requests from num_clients threads for `seconds`; join() raises if one was refused."""

    def __init__(self, base_url: str, seconds: float, num_clients: int = 6,
                 headers: dict | None = None) -> None:
        super().__init__()
        self.base_url, self.seconds, self.headers = base_url, seconds, headers or {}
        self.num_clients = num_clients
        self.statuses: list[int] = []
        self.start()

    def run(self) -> None:
        threads = [threading.Thread(target=self._client) for _ in range(self.num_clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _client(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=30, headers=self.headers) as client:
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline:
                self.statuses.append(client.post("/v1/completions", json=COMPLETION).status_code)

    def join(self, timeout=None) -> None:
        super().join(timeout)
        assert self.statuses and set(self.statuses) == {200}, set(self.statuses)


def test_stats_json_matches_metrics():
    llm = FakeLLM(token_delay_s=0.002)
    with ServerThread(build_app(llm, ServerConfig(model="fake"))) as server:
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            Load(server.base_url, 1.0, num_clients=3).join()
            wait_until_idle(llm)
            stats = client.get("/dashboard/stats.json").json()
            metrics = _metrics(client)
    assert stats["healthy"] and stats["num_running"] == 0
    assert stats["generation_tokens_total"] == metrics["tllm:generation_tokens_total"] > 0
    assert stats["prompt_tokens_total"] == metrics["tllm:prompt_tokens_total"]
    assert stats["requests_finished"]["length"] == metrics[
        'tllm:request_success_total{finished_reason="length"}']
    assert stats["kv_cache_blocks_total"] == metrics["tllm:kv_cache_blocks_total"] == 1000
    assert stats["generation_tokens_per_s"] > 0
    assert stats["ttft"]["count"] == metrics["tllm:time_to_first_token_seconds_count"]
    assert stats["ttft"]["p50"] <= stats["ttft"]["p90"] <= stats["ttft"]["p99"]
    assert stats["itl"]["count"] == metrics["tllm:inter_token_latency_seconds_count"]


@pytest.fixture(scope="module")
def browser():
    yield from launch_browser()


def _number(page, stat: str) -> float:
    text = page.text_content(f'[data-stat="{stat}"]')
    return float(text.replace(",", ""))


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_dashboard_in_a_headless_browser(browser, tmp_path):
    llm = FakeLLM(token_delay_s=0.01)
    with ServerThread(build_app(llm, ServerConfig(model="fake", api_key="sesame"))) as server:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        problems = []
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(f"{server.base_url}/dashboard?api_key=sesame")
        # the key was traded for a session: gone from the address bar, not in the cookie
        assert page.url == f"{server.base_url}/dashboard"
        [cookie] = page.context.cookies()
        assert cookie["value"] != "sesame" and cookie["httpOnly"]
        assert cookie["sameSite"] == "Strict"
        page.wait_for_function("document.querySelector('[data-stat=num_running]')"
                               ".textContent !== '–'", timeout=10_000)
        assert page.text_content("#health") == "healthy"
        assert _number(page, "generation_tokens_total") == 0

        load = Load(server.base_url, 4.0, headers={"Authorization": "Bearer sesame"})
        _wait_for(lambda: _number(page, "num_running") > 0, 5, "running requests on the page")
        _wait_for(lambda: _number(page, "generation_tokens_per_s") > 0, 5, "a token rate")
        first = _number(page, "generation_tokens_total")
        _wait_for(lambda: _number(page, "generation_tokens_total") > first, 5,
                  "the generated tokens to grow")
        assert page.text_content('[data-stat="ttft.p50"]') != "–"
        page.screenshot(path=str(tmp_path / "dashboard.png"))
        if os.environ.get("TLLM_DASHBOARD_SHOT"):
            page.screenshot(path=os.environ["TLLM_DASHBOARD_SHOT"])
        load.join()
        wait_until_idle(llm)

        with httpx.Client(base_url=server.base_url, timeout=10,
                          headers={"Authorization": "Bearer sesame"}) as client:
            metrics = _metrics(client)
        total = metrics["tllm:generation_tokens_total"]
        _wait_for(lambda: _number(page, "generation_tokens_total") == total, 5,
                  f"the page to show {total} generated tokens")
        assert _number(page, "num_running") == metrics["tllm:num_requests_running"] == 0
        assert _number(page, "num_waiting") == metrics["tllm:num_requests_waiting"] == 0
        assert _number(page, "prompt_tokens_total") == metrics["tllm:prompt_tokens_total"]
        assert _number(page, "requests_finished.length") == metrics[
            'tllm:request_success_total{finished_reason="length"}']
        assert _number(page, "kv_cache_blocks_total") == metrics["tllm:kv_cache_blocks_total"]
        assert _number(page, "kv_cache_usage") == pytest.approx(
            100 * metrics["tllm:kv_cache_usage_perc"], abs=0.05)
        assert _number(page, "ttft.count") == metrics["tllm:time_to_first_token_seconds_count"]
        page.close()
    assert not problems, problems
