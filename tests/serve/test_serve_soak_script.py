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
from tllm.serve.openai_server import build_app
from tllm.serve.testing import FakeLLM, ServerThread

SOAK = Path(__file__).parents[2] / "benchmarks" / "soak.py"


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
