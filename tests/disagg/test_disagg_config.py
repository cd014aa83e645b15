"""`tllm serve disaggregated -c`: TensorRT-LLM's disaggregated config files as they are (the
shape of its examples/disaggregated files: the servers' options at the top level and in each
section, front options this front lacks, `host:port` urls); wrong configs still fail with
the file and key named."""
from __future__ import annotations

import logging

import pytest

from tllm.cli import main
from tllm.serve.fronts.disagg_config import DisaggFrontConfig
from tllm.serve.fronts.disagg_front import DisaggFront

TRTLLM_CONFIG = """\
hostname: localhost
port: 8000
model: TinyLlama/TinyLlama-1.1B-Chat-v1.0
backend: pytorch
free_gpu_memory_fraction: 0.25
max_batch_size: 16
max_num_tokens: 8192
disable_overlap_scheduler: True
kv_cache_config:
  free_gpu_memory_fraction: 0.2
  enable_block_reuse: false
cache_transceiver_config:
  backend: UCX
  max_tokens_in_buffer: 2048
max_retries: 3
context_servers:
  num_instances: 2
  tensor_parallel_size: 1
  pipeline_parallel_size: 1
  kv_cache_config:
    free_gpu_memory_fraction: 0.2
  cache_transceiver_config:
    backend: DEFAULT
  urls:
      - "localhost:8001"
      - "localhost:8002"
generation_servers:
  num_instances: 1
  tensor_parallel_size: 1
  router:
    type: load_balancing
    use_tokens: false
  urls:
      - "localhost:8003"
"""


def write(tmp_path, text: str) -> str:
    path = tmp_path / "disagg.yaml"
    path.write_text(text)
    return str(path)


def test_a_trtllm_config_is_taken_as_it_is(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tllm.serve.fronts.disagg_config")
    config = DisaggFrontConfig.from_yaml(write(tmp_path, TRTLLM_CONFIG))
    assert (config.hostname, config.port) == ("localhost", 8000)
    assert config.context_servers.urls == ["localhost:8001", "localhost:8002"]
    assert config.generation_servers.num_instances == 1
    front = DisaggFront(config)
    assert [s.url for s in front.context] == ["http://localhost:8001", "http://localhost:8002"]
    assert [s.url for s in front.generation] == ["http://localhost:8003"]
    [note] = [r.getMessage() for r in caplog.records]
    for key in ("model", "backend", "free_gpu_memory_fraction", "kv_cache_config",
                "cache_transceiver_config", "context_servers.tensor_parallel_size"):
        assert key in note
    assert "front does not have: max_retries" in note
    assert "generation_servers.router" in note


def test_a_plain_config_logs_nothing(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tllm.serve.fronts.disagg_config")
    config = DisaggFrontConfig.from_yaml(write(tmp_path, (
        "context_servers: {urls: ['http://127.0.0.1:9001']}\n"
        "generation_servers: {urls: ['127.0.0.1:9002']}\n")))
    assert config.hostname == "127.0.0.1" and not caplog.records


@pytest.mark.parametrize("text,message", [
    ("- a\n- b\n", "expected a mapping"),
    ("port: [8000\n", "not YAML"),
    ("context_servers: {urls: [a:1]}\n", "generation_servers: Field required"),
    ("context_servers: {num_instances: 2}\ngeneration_servers: {urls: [b:2]}\n",
     "context_servers.urls: Field required"),
    ("context_servers: {num_instances: 2, urls: [a:1]}\ngeneration_servers: {urls: [b:2]}\n",
     "num_instances is 2 but 1 urls"),
    ("port: http\ncontext_servers: {urls: [a:1]}\ngeneration_servers: {urls: [b:2]}\n",
     "port: Input should be a valid integer"),
    ("context_servers: {urls: ['not a host']}\ngeneration_servers: {urls: [b:2]}\n",
     "'not a host' is not host:port"),
    ("hostnme: x\ncontext_servers: {urls: [a:1]}\ngeneration_servers: {urls: [b:2]}\n",
     "unknown key hostnme; did you mean hostname?"),
    ("context_servers: {urls: [a:1], num_instance: 1}\ngeneration_servers: {urls: [b:2]}\n",
     "did you mean context_servers.num_instances?"),
    ("disagg_cluster: {cluster_uri: 'etcd://x:2379'}\n", "disagg_cluster"),
])
def test_a_wrong_config_names_the_file_and_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match="-c .*disagg.yaml") as info:
        DisaggFrontConfig.from_yaml(path)
    assert message in str(info.value)


def test_the_command_prints_one_line(tmp_path, capsys):
    path = write(tmp_path, "context_servers: {urls: [a:1]}\n")
    assert main(["serve", "disaggregated", "-c", path]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: -c ") and "generation_servers" in err
    assert len(err.strip().splitlines()) == 1
