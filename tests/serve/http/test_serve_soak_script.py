"""A smoke run of benchmarks/soak.py's load (every kind of request, the hostile catalogue, the
end-of-run checks) for a few seconds against the engine double; the soak itself (10 minutes
against `tllm serve smollm2`) stays out of CI (benchmarks/RESULTS.md has its figures)."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from pathlib import Path

import psutil

from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import FakeLLM, ServerThread

SOAK = Path(__file__).parents[3] / "benchmarks" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module        # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_soak_load_runs_clean_against_the_engine_double():
    soak = load_soak()
    fake = FakeLLM(token_delay_s=0.002)
    config = ServerConfig(model="fake", body_read_timeout_s=0.3)
    with ServerThread(build_app(fake, config)) as server:
        load = soak.Load(server.base_url, "fake", max_token_id=256, body_read_timeout_s=0.3)
        tally = soak.Tally()
        rss = soak.RssLog({"server": os.getpid()}, period_s=0.5)

        async def run() -> dict:
            sampler = asyncio.create_task(rss.run())
            await soak.run_load(load, seconds=4, num_clients=4, seed=0, tally=tally)
            sampler.cancel()
            return await soak.drain(server.base_url, timeout_s=10)

        end = asyncio.run(run())
    assert set(tally.by_kind()) == {k for _, k in soak.MIX}, tally.statuses
    assert not tally.server_errors and not tally.hostile_not_4xx, tally.statuses
    assert end["http_5xx"] == 0 and end["running"] == 0 and end["kv_use"] == 0
    assert len(soak.hostile_catalogue(load)) >= 15
    assert rss.max_of("warm-up")["server"] <= psutil.Process().memory_info().rss * 2


def test_verdict_shows_rss_at_start_and_after_the_kv_fill():
    """The table shows each process's RSS at start, after the KV fill (every block of the
    engine's CPU KV pool written once, so the pool is in there), and its growth after
    warm-up."""
    soak = load_soak()
    mib = 1 << 20
    rss = {"at_start": 1000 * mib, "after_kv_fill": 1010 * mib, "after_warmup": 1020 * mib,
           "end": 1030 * mib, "max": 1040 * mib, "growth": 10 / 1020, "max_growth": 20 / 1020}
    result = {"requests": 5, "by_kind": {}, "client_5xx": [], "hostile_not_4xx": [],
              "end": {"http_5xx": 0}, "leaked_blocks": 0, "rss": {"engine": rss}}
    rows = {figure: (value, met) for figure, value, _, met in soak.verdict(result)}
    assert rows["engine RSS at start, after the KV fill (MiB)"] == ("1000, 1010 (+1.00%)", True)
    assert rows["engine RSS after warm-up -> end (max)"][0].startswith("1020 -> 1030 MiB (+0.98%")
