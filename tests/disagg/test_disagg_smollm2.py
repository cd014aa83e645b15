"""Disaggregated serving with the default model: SmolLM2's context and generation servers as
real processes behind the front give the aggregated server's greedy text, whole and streamed
(the tiny random models of test_disagg_serving.py cover the rest)."""
from __future__ import annotations

import pytest

from tests.disagg.conftest import disagg_specs, start_servers, wait_all_free
from tests.disagg.test_disagg_serving import GREEDY, _post, _stream_text
from tllm.serve.fronts.disagg_front import DisaggFront, DisaggFrontConfig, build_front_app
from tllm.serve.testing import ServerThread

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_disagg():
    context, generation = start_servers(*disagg_specs("smollm2"))
    config = DisaggFrontConfig(context_servers={"num_instances": 1, "urls": [context.url]},
                               generation_servers={"urls": [generation.url]})
    try:
        with ServerThread(build_front_app(DisaggFront(config))) as front:
            yield context, generation, front
    finally:
        for server in (context, generation):
            server.stop()


def test_smollm2_disaggregated_equals_aggregated(smollm2_disagg):
    context, generation, front = smollm2_disagg
    chat = {"messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
            "max_tokens": 24, **GREEDY}
    reference = _post(generation.url, "/v1/chat/completions", chat).json()
    ours = _post(front.base_url, "/v1/chat/completions", chat).json()
    assert ours["choices"][0]["message"]["content"] == \
        reference["choices"][0]["message"]["content"]
    streamed, _ = _stream_text(front.base_url, "/v1/chat/completions", chat)
    assert streamed == reference["choices"][0]["message"]["content"]
    stats = generation.stats()
    assert stats["disagg_num_imported"] >= 1 and stats["disagg_num_failed"] == 0
    for server in (context, generation):
        wait_all_free(server)
