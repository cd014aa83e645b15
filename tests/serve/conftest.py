"""One SmolLM2 LLM and one server over it for every test of tests/serve (loading the model
takes a while); servers with other settings share the same LLM."""
from __future__ import annotations

import httpx
import pytest

from tllm import LLM, KvCacheConfig
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread

MODEL = "smollm2"
MAX_SEQ_LEN = 512
# A small batch and token budget keep each engine step short on a CPU, so aborts (applied
# between steps) take effect quickly: on the 2-core AVX2 VMs CI runs on, a 64-token step of
# SmolLM2 takes ~0.8 s (a 256-token one ~3 s).
LLM_KWARGS = dict(max_seq_len=MAX_SEQ_LEN, max_batch_size=8, max_num_tokens=64,
                  kv_cache_config=KvCacheConfig(max_tokens=8192))


@pytest.fixture(scope="session")
def smollm2():
    llm = LLM(MODEL, **LLM_KWARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def server(smollm2):
    """The SmolLM2 server: yields its ServerThread (base_url)."""
    with ServerThread(build_app(smollm2, ServerConfig(model=MODEL, max_queue_size=512,
                                                   max_body_bytes=1 << 20))) as srv:
        yield srv


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client
