"""A tiny random Llama with a byte-level tokenizer, and tllm servers over it started as
real processes (`tllm serve MODEL ...`): context, generation and aggregated replicas."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

CORPUS = "the quick brown fox jumps over the lazy dog 0123456789 hello world, stop here."
# a plain template for the tiny model's chat (it has none of its own)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
ENGINE_FLAGS = ["--max-seq-len", "256", "--kv-cache-tokens", "2048", "--max-batch-size", "16",
                "--dtype", "float32", "--device", "cpu"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tllm.visual_gen.models.qwen_image.components import byte_level_tokenizer

    path = tmp_path_factory.mktemp("tiny_disagg")
    tokenizer = byte_level_tokenizer(CORPUS, vocab_size=300)
    tokenizer.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(tokenizer) + 8, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.1,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`tllm serve MODEL ...` in a process of its own (and its engine process)."""

    def __init__(self, model: str, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tllm.cli", "serve", model, "--port", str(self.port),
             "--log-level", "warning", "--chat-template", CHAT_TEMPLATE, *ENGINE_FLAGS, *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 180) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(self.proc.communicate()[0].decode()[-3000:])
                try:
                    if client.get("/health").status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.25)
        raise AssertionError(f"{self.url} did not come up")

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/disagg/stats", timeout=10).json()

    def kill(self) -> None:
        """SIGKILL the server and its engine process (their process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def disagg_specs(model: str, *flags: str, secret_file: str | None = None) -> tuple:
    """(context, generation) server specs for start_servers: the context server's KV port
    fixed, so the generation server can be configured with it (--kv-sources)."""
    kv_port = free_port()
    shared = [*flags, *(("--kv-secret-file", secret_file) if secret_file else ())]
    return ((model, "--role", "context", "--kv-port", str(kv_port), *shared),
            (model, "--role", "generation", "--kv-sources", f"127.0.0.1:{kv_port}", *shared))


def start_servers(*specs) -> list[ServerProcess]:
    """Start them all at once, then wait for each."""
    servers = [ServerProcess(*spec) for spec in specs]
    try:
        return [server.wait_healthy() for server in servers]
    except BaseException:
        for server in servers:
            server.kill()
        raise


def wait_all_free(server: ServerProcess, timeout_s: float = 10.0) -> dict:
    """Its stats once every KV block is free and nothing runs (fails after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.stats()
        if (stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_running"] == 0
                and stats["num_waiting"] == 0 and not stats.get("disagg_requests_held")):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.url} still holds blocks: {stats}")
        time.sleep(0.1)
