"""CUDA IPC transport (GPU only): a context and a generation server as processes on one GPU,
KV moved device to device; the front's answers equal the generation server's own."""
from __future__ import annotations

import httpx
import pytest
import torch

from tests.disagg.conftest import disagg_specs, start_servers, wait_all_free
from tllm.serve.fronts.disagg_front import DisaggFront, DisaggFrontConfig, build_front_app
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


_EXPORTER = """
import sys, torch
from tllm.disagg.cuda_ipc import describe_pool
k = torch.arange(6 * 4 * 2 * 8, dtype=torch.float32, device="cuda").reshape(6, 4, 2, 8)
print(describe_pool([(k, k + 0.5)]).model_dump_json(), flush=True)
sys.stdin.readline()    # the pool lives until the parent has read it
"""


def test_pool_handles_rebuilt_from_plain_data_in_another_process():
    """describe_pool in one process, open_pool (checks + rebuild_cuda_tensor) in this one:
    the values arrive; a pool of another layout is refused before anything is opened."""
    import subprocess
    import sys
    from pathlib import Path

    from tllm.disagg.cuda_ipc import open_pool
    from tllm.disagg.messages import IpcPool
    from tllm.disagg.wire import TransferError
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen([sys.executable, "-c", _EXPORTER], cwd=root, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        pool = IpcPool.model_validate_json(child.stdout.readline())
        local = torch.empty(3, 4, 2, 8, device="cuda")
        with pytest.raises(TransferError, match="blocks of"):
            open_pool(pool, [(torch.empty(3, 4, 2, 16, device="cuda"),) * 2])
        [(k, v)] = open_pool(pool, [(local, local)])
        expected = torch.arange(6 * 4 * 2 * 8, dtype=torch.float32, device="cuda")
        assert torch.equal(k.reshape(-1), expected) and torch.equal(v.reshape(-1), expected + 0.5)
        del k, v
    finally:
        child.communicate("done\n", timeout=30)
