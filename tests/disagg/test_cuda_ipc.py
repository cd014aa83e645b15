"""CUDA IPC transport (GPU only): a context and a generation server as processes on one GPU,
KV moved device to device; the front's answers equal the generation server's own."""
from __future__ import annotations

import httpx
import pytest
import torch

from tests.disagg.conftest import disagg_specs, start_servers, wait_all_free
from tllm.serve.disagg_front import DisaggFront, DisaggFrontConfig, build_front_app
from tllm.serve.testing import ServerThread

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_ipc_disaggregated_equals_aggregated(tiny_model_dir, tmp_path):
    """The pool's IPC handles travel as plain data (no pickle) and are rebuilt by
    tllm.disagg.cuda_ipc after its checks; the servers share a secret."""
    gpu = ("--device", "cuda", "--kv-transport", "cuda_ipc")
    (tmp_path / "secret").write_text("cuda-ipc-test-secret\n")
    context, generation = start_servers(*disagg_specs(tiny_model_dir, *gpu,
                                                      secret_file=str(tmp_path / "secret")))
    try:
        config = DisaggFrontConfig(context_servers={"urls": [context.url]},
                                   generation_servers={"urls": [generation.url]})
        with ServerThread(build_front_app(DisaggFront(config))) as front:
            for prompt in ("the quick brown fox", "hello world, " * 10):
                body = {"prompt": prompt, "max_tokens": 16, "temperature": 0,
                        "ignore_eos": True}
                ours = httpx.post(front.base_url + "/v1/completions", json=body, timeout=120)
                reference = httpx.post(generation.url + "/v1/completions", json=body,
                                       timeout=120)
                assert ours.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
        stats = generation.stats()
        assert stats["disagg_num_imported"] == 2 and stats["disagg_num_failed"] == 0
        for server in (context, generation):
            wait_all_free(server)
    finally:
        context.kill()
        generation.kill()
