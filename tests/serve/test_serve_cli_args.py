"""`tllm serve` arguments: the command line over the --config YAML over defaults; and one
end-to-end run of the command in a subprocess (random weights, so no model to load)."""
from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tllm.config import LlmArgs
from tllm.serve.cli_args import add_serve_parser, llm_arguments, server_config

# What `tllm serve ARGS` runs, until tllm/cli.py wires the subcommand in.
SERVE = ("import argparse, sys; from tllm.serve.cli_args import add_serve_parser; "
         "p = argparse.ArgumentParser(); add_serve_parser(p.add_subparsers()); "
         "a = p.parse_args(sys.argv[1:]); sys.exit(a.run(a))")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tllm")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_defaults():
    args = parse()
    model, kwargs = llm_arguments(args)
    assert model == "smollm2" and kwargs == {}
    config = server_config(args, model)
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert config.model_name == "smollm2" and config.api_key is None
    assert config.max_queue_size == 1024
    assert args.engine_process and not parse("--no-engine-process").engine_process



def test_image_url_ttl(capsys):
    assert server_config(parse(), "m").image_url_ttl_s == 3600
    assert server_config(parse("--image-url-ttl", "90"), "m").image_url_ttl_s == 90
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit):
            parse("--image-url-ttl", bad)
        assert "--image-url-ttl" in capsys.readouterr().err

def test_command_line_over_config_file(tmp_path):
    path = tmp_path / "extra.yml"
    path.write_text("max_batch_size: 8\nmax_seq_len: 256\n"
                    "kv_cache_config:\n  tokens_per_block: 16\n  max_tokens: 1024\n"
                    "scheduler_config:\n  capacity_scheduler_policy: MAX_UTILIZATION\n")
    model, kwargs = llm_arguments(parse("my-model", "--config", str(path), "--max-batch-size",
                                        "4", "--kv-cache-tokens", "2048"))
    assert model == "my-model"
    assert kwargs["max_batch_size"] == 4 and kwargs["max_seq_len"] == 256
    assert kwargs["kv_cache_config"] == {"tokens_per_block": 16, "max_tokens": 2048}
    args = LlmArgs(model=model, **kwargs)  # every key is an LLM argument
    assert args.kv_cache_config.tokens_per_block == 16


def test_model_from_option_or_file(tmp_path):
    path = tmp_path / "extra.yml"
    path.write_text("model: from-file\n")
    assert llm_arguments(parse("--config", str(path)))[0] == "from-file"
    assert llm_arguments(parse("--model", "opt", "--config", str(path)))[0] == "opt"


@pytest.mark.parametrize("text,message", [("- a list\n", "mapping"),
                                          ("key: [unclosed\n", "not valid YAML")])
def test_bad_config_file(tmp_path, text, message):
    path = tmp_path / "extra.yml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        llm_arguments(parse("--config", str(path)))


def test_server_options(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    args = parse("--served-model-name", "tiny", "--api-key", "k", "--max-queue-size", "0",
                 "--chat-template", str(template))
    config = server_config(args, "smollm2")
    assert config.model_name == "tiny" and config.api_key == "k"
    assert config.max_queue_size is None  # 0: no limit
    assert config.chat_template == template.read_text()
    with pytest.raises(FileNotFoundError):
        server_config(parse("--chat-template", str(tmp_path / "missing.jinja")), "smollm2")


def test_parallel_flags_become_llm_arguments():
    _, kwargs = llm_arguments(parse("--tp-size", "2", "--pp-size", "4"))
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["pipeline_parallel_size"] == 4
    LlmArgs(model="x", **kwargs)  # and they validate


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_serve_command_end_to_end(tmp_path):
    port = free_port()
    (tmp_path / "extra.yml").write_text("max_seq_len: 128\nkv_cache_config:\n  max_tokens: 2048\n")
    proc = subprocess.Popen([sys.executable, "-c", SERVE, "serve", "dummy:smollm2-135m",
                             "--port", str(port), "--config", str(tmp_path / "extra.yml"),
                             "--served-model-name", "tiny", "--api-key", "k",
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            _wait_healthy(client, proc)
            auth = {"Authorization": "Bearer k"}
            models = client.get("/v1/models", headers=auth).json()["data"]
            assert models[0]["id"] == "tiny" and models[0]["max_model_len"] == 128
            response = client.post("/v1/completions", headers=auth, json={
                "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
            assert response.json()["usage"]["completion_tokens"] == 3
            assert client.post("/v1/completions", json={"prompt": [1]}).status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 0, output
    assert "Traceback" not in output, output


def _wait_healthy(client: httpx.Client, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0].decode()
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not come up")
