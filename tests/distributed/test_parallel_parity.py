"""Tensor and pipeline parallelism on the CPU (gloo, one process per rank): greedy tokens
must equal the single-process run on the same weights (fp32)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[1] + list(range(5 + i, 30 + 7 * i)) for i in range(6)]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0)
KV = {"max_tokens": 4096}


def _save_tiny(arch: str, kv_heads: int, path) -> str:
    import transformers
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=387, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
        initializer_range=0.1, eos_token_id=2, bos_token_id=1, pad_token_id=0,
        architectures=[f"{arch}ForCausalLM"])
    torch.manual_seed(kv_heads)
    getattr(transformers, f"{arch}ForCausalLM")(config).save_pretrained(path)
    return str(path)


def _greedy(path: str, **kwargs) -> list[list[int]]:
    with LLM(path, kv_cache_config=KV, max_num_tokens=64, **kwargs) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


# (family, kv heads): 2 kv heads split across 2 ranks; 1 kv head replicated on both
MODELS = [("Llama", 2), ("Llama", 1), ("Qwen2", 2), ("Qwen2", 1)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for arch, kv in MODELS:
        path = _save_tiny(arch, kv, tmp_path_factory.mktemp(f"{arch}{kv}"))
        out[arch, kv] = (path, _greedy(path))
    return out


@pytest.mark.parametrize("arch,kv", MODELS)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_parallel_greedy_equals_single_process(models, arch, kv, tp, pp):
    path, expected = models[arch, kv]
    assert _greedy(path, tensor_parallel_size=tp, pipeline_parallel_size=pp) == expected


def test_tp2_pp2(models):
    path, expected = models["Llama", 2]
    assert _greedy(path, tensor_parallel_size=2, pipeline_parallel_size=2) == expected


def test_pipeline_keeps_two_micro_batches_in_flight(models):
    path, expected = models["Qwen2", 2]
    with LLM(path, kv_cache_config=KV, pipeline_parallel_size=2) as llm:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        # 6 requests x 10 tokens in micro-batches of 3: about 2 x 10 steps, not 10
        assert llm.get_stats()["num_steps"] >= 19
    assert [o.outputs[0].token_ids for o in outputs] == expected


def _worker_pids() -> set[int]:
    """Worker processes started by this (test) process."""
    import psutil
    return {p.pid for p in psutil.Process().children(recursive=True)
            if "tllm.executor.worker" in " ".join(p.cmdline())}


def test_dead_worker_fails_generate_and_shutdown_leaves_nothing(models):
    path, _ = models["Llama", 2]
    before = _worker_pids()
    llm = LLM(path, kv_cache_config=KV, tensor_parallel_size=2)
    (worker,) = llm._engine.workers.processes
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 60
    llm.shutdown()
    assert _worker_pids() <= before


def test_shutdown_leaves_no_process(models):
    path, _ = models["Llama", 1]
    before = _worker_pids()
    llm = LLM(path, kv_cache_config=KV, tensor_parallel_size=2)
    (worker,) = llm._engine.workers.processes
    llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    llm.shutdown()
    assert worker.poll() == 0
    assert _worker_pids() <= before


TORCHRUN_SCRIPT = """
import json, sys
from tllm import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache_config={"max_tokens": 4096})
out = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=10, temperature=0.0),
                   use_tqdm=False)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in out]))
llm.shutdown()
"""


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_launch(models, tmp_path):
    """Under torchrun every process runs the script; rank 0 gets the results, the other
    rank serves steps inside LLM() and exits when rank 0 shuts down."""
    path, expected = models["Llama", 2]
    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_SCRIPT)
    import json
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), str(script), path, json.dumps(PROMPTS)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("TOKENS")]
    assert len(lines) == 1  # only rank 0 returns from LLM()
    assert json.loads(lines[0].removeprefix("TOKENS ")) == expected


def test_bench_throughput_cli_with_tp(models, tmp_path, capsys):
    from tllm.cli import main
    path, _ = models["Llama", 2]
    out = tmp_path / "bench.json"
    assert main(["bench", "throughput", "--model", path, "--tp-size", "2", "--isl", "16",
                 "--osl", "8", "--num-requests", "4", "--warmup", "0",
                 "--kv-cache-tokens", "2048", "--json", str(out)]) == 0
    import json
    result = json.loads(out.read_text())
    assert result["engine"]["tensor_parallel_size"] == 2
    assert result["num_requests"] == 4 and "TP 2 x PP 1" in capsys.readouterr().out


def test_worker_that_never_starts_fails_fast(models, monkeypatch):
    """A worker that exits before the rendezvous: LLM() raises at once, naming it."""
    from tllm.distributed import launch
    monkeypatch.setattr(launch, "_spawn_worker", lambda *a: subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.exit(3)"]))
    path, _ = models["Llama", 2]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 exited unexpectedly.*exit code 3"):
        LLM(path, kv_cache_config=KV, tensor_parallel_size=2)
    assert time.monotonic() - start < 30
    assert _parallel_state_cleared()


def test_worker_that_fails_while_building_is_reported(monkeypatch):
    """A worker whose model build fails (here: a dummy preset that exists only in rank 0's
    process) makes LLM() raise that worker's death, not a broken-connection error."""
    from tllm.loader import dummy
    monkeypatch.setitem(dummy.PRESETS, "rank0-only", ("llama", dict(
        architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
        max_position_embeddings=256, rms_norm_eps=1e-5)))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 exited unexpectedly"):
        LLM("dummy:rank0-only", kv_cache_config=KV, tensor_parallel_size=2)
    assert time.monotonic() - start < 60
    assert _parallel_state_cleared()


def _parallel_state_cleared() -> bool:
    from tllm.distributed import comm
    return comm.state() is None


def test_last_stage_sampling_matches_single_process(models):
    """With PP the last stage samples from shadow requests: seeded sampling, penalties that
    read the token history, min_tokens, logprobs and prompt logprobs all match one process."""
    path, _ = models["Qwen2", 2]
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7 + i,
                             repetition_penalty=1.3, presence_penalty=0.5, min_tokens=4,
                             logprobs=2, prompt_logprobs=1 if i == 0 else None)
              for i in range(len(PROMPTS))]

    def run(**kwargs):
        with LLM(path, kv_cache_config=KV, max_num_tokens=64, **kwargs) as llm:
            return llm.generate(PROMPTS, params, use_tqdm=False)

    single, piped = run(), run(pipeline_parallel_size=2)
    for a, b in zip(single, piped):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)
    assert len(piped[0].prompt_logprobs) == len(PROMPTS[0])
    assert [p and set(p) for p in piped[0].prompt_logprobs] == \
        [p and set(p) for p in single[0].prompt_logprobs]
