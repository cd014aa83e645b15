"""`tllm bench serve`'s tests: our server over an engine double that counts its requests."""
from __future__ import annotations

import pytest

from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import FakeLLM, ServerThread


class CountingLLM(FakeLLM):
    """Remembers the most requests it ever had in flight."""

    max_active = 0

    def generate_async(self, inputs, params, streaming=False):
        result = super().generate_async(inputs, params, streaming)
        self.max_active = max(self.max_active, len(self.active))
        return result


@pytest.fixture()
def fake():
    return CountingLLM(token_delay_s=0.002)


@pytest.fixture()
def server(fake):
    with ServerThread(build_app(fake, ServerConfig(model="fake"))) as srv:
        yield srv

