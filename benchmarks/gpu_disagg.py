"""Disaggregated serving on one GPU: a context and a generation server of
dummy:llama-3.1-8b (bf16, random weights) share the device, each its own process.

1. Correctness: the front's answers (prefill on the context server, KV over CUDA IPC, decode
   on the generation server) against the generation server's own aggregated answers, greedy.
2. KV transfer time per 1k tokens: this process prefills prompts on the context server
   (context_only), then fetches their KV as a generation server does, over both transports:
   cuda_ipc (the pool opened through IPC handles, gathered into a local pool with the same
   copy code as IpcImportedKV) and tcp (the blocks' bytes into pinned host memory); against
   the device-to-device copy bandwidth measured here, in the same run, on the same bytes.

    python benchmarks/gpu_disagg.py [--model dummy:llama-3.1-8b] [--out DIR]

Prints a table last; full numbers go to $OUT/gpu_disagg.json (or --out)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tllm.disagg.cuda_ipc import IpcImportedKV, open_pool  # noqa: E402
from tllm.disagg.handshake import client_handshake  # noqa: E402
from tllm.disagg.messages import (Fetch, IpcFetchReply, IpcPool, PoolRequest,  # noqa: E402
                                  Release, Released, TcpFetchReply)
from tllm.disagg.wire import (connect, recv_into, recv_reply, send_message,  # noqa: E402
                              tensor_bytes)
from tllm.config import parse_endpoint  # noqa: E402

PROMPT_TOKENS = (1024, 4096)
REPEATS = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tllm.cli", "serve", model, "--port",
                             str(port), "--log-level", "warning", "--no-engine-process",
                             "--max-seq-len", "8192", "--kv-cache-tokens", "65536",
                             "--kv-cache-free-memory-fraction", "0.3", *flags],
                            cwd=ROOT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc, url: str, timeout_s: float = 200) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


def prefill(ctx_url: str, prompt: list[int]) -> str:
    export_id = f"bench-{uuid.uuid4().hex}"
    body = {"prompt": prompt, "max_tokens": 1, "disaggregated_params": {
        "request_type": "context_only", "ctx_request_id": export_id}}
    response = httpx.post(ctx_url + "/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return export_id


def open_source(endpoint: str):
    """(connection, source id) to a context server's KV endpoint, its handshake done."""
    sock = connect(*parse_endpoint(endpoint), 5.0)
    return sock, client_handshake(sock, None)


def release(sock, export_id: str) -> None:
    send_message(sock, Release(id=export_id))
    recv_reply(sock, Released)


def fetch_tcp(endpoint: str, export_id: str) -> tuple[float, int]:
    sock, _ = open_source(endpoint)
    with sock:
        started = time.perf_counter()
        send_message(sock, Fetch(id=export_id, transport="tcp"))
        reply = recv_reply(sock, TcpFetchReply)
        data = torch.empty((reply.num_blocks, *reply.block_shape),
                           dtype=getattr(torch, reply.dtype),
                           pin_memory=torch.cuda.is_available())
        recv_into(sock, tensor_bytes(data))
        seconds = time.perf_counter() - started
        release(sock, export_id)
    return seconds, data.numel() * data.element_size()


class LocalPool:
    """A generation-side pool of the context server's layout, to copy IPC blocks into."""

    def __init__(self, description: IpcPool, num_blocks: int) -> None:
        k = description.layers[0][0]
        shape = (num_blocks, *k.size[1:])
        dtype = getattr(torch, k.dtype)
        self.slot_caches = [(torch.empty(shape, dtype=dtype, device="cuda"),
                             torch.empty(shape, dtype=dtype, device="cuda"))
                            for _ in description.layers]


def fetch_ipc(endpoint: str, export_id: str, opened: dict) -> tuple[float, int, list]:
    sock, source_id = open_source(endpoint)
    with sock:
        send_message(sock, Fetch(id=export_id, transport="cuda_ipc"))
        reply = recv_reply(sock, IpcFetchReply)
        if source_id not in opened:     # the pool's handles, once (plain data, checked)
            send_message(sock, PoolRequest())
            description = recv_reply(sock, IpcPool)
            opened[source_id] = description, open_pool(
                description, LocalPool(description, 1).slot_caches)
        description, remote = opened[source_id]
        num_blocks = len(reply.block_ids)
        pool = LocalPool(description, num_blocks)
        events = []
        imported = IpcImportedKV(reply.num_tokens, remote, list(reply.block_ids),
                                 events.append)
        torch.cuda.synchronize()
        started = time.perf_counter()
        imported.write_into(pool, list(range(num_blocks)))
        events[0].synchronize()
        seconds = time.perf_counter() - started
        release(sock, export_id)
        nbytes = sum(k.numel() * k.element_size() * 2 for k, _ in pool.slot_caches)
    return seconds, nbytes, pool.slot_caches


def time_fetch(ctx_url: str, endpoint: str, prompt: list[int], transport: str, repeats: int,
               opened: dict) -> tuple[float, int]:
    """Median seconds of `repeats` prefills' KV fetched over `transport` ("tcp" or
    "cuda_ipc"; the first run warms up and opens the IPC handles), and the bytes of one."""
    times, nbytes = [], 0
    for _ in range(repeats + 1):
        export_id = prefill(ctx_url, prompt)
        if transport == "tcp":
            seconds, nbytes = fetch_tcp(endpoint, export_id)
        else:
            seconds, nbytes, _ = fetch_ipc(endpoint, export_id, opened)
        times.append(seconds)
    return sorted(times[1:])[len(times[1:]) // 2], nbytes


def copy_bandwidth(nbytes: int) -> float:
    """Device-to-device copy bandwidth (bytes/s) of one buffer of `nbytes`, best of 10."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def correctness(ctx_url: str, gen_url: str) -> list[dict]:
    from tllm.serve.fronts.disagg_front import DisaggFront, DisaggFrontConfig, build_front_app
    from tllm.serve.testing import ServerThread
    config = DisaggFrontConfig(context_servers={"urls": [ctx_url]},
                               generation_servers={"urls": [gen_url]})
    rows = []
    with ServerThread(build_front_app(DisaggFront(config))) as front:
        for length in (17, 300, 1500):
            prompt = [(31 * i + 7) % 30000 + 100 for i in range(length)]
            body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                    "logprobs": 1}
            ours = httpx.post(front.base_url + "/v1/completions", json=body, timeout=300).json()
            ref = httpx.post(gen_url + "/v1/completions", json=body, timeout=300).json()
            a = ours["choices"][0]["logprobs"]["tokens"]
            b = ref["choices"][0]["logprobs"]["tokens"]
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            rows.append({"prompt_tokens": length, "identical": a == b,
                         "first_difference": first})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    kv_port = free_port()
    ctx, ctx_url = start_server(args.model, "--role", "context", "--kv-port", str(kv_port))
    gen, gen_url = start_server(args.model, "--role", "generation", "--kv-transport",
                                "cuda_ipc", "--kv-sources", f"127.0.0.1:{kv_port}")
    results: dict = {"model": args.model, "device": torch.cuda.get_device_name()}
    try:
        wait_healthy(ctx, ctx_url)
        wait_healthy(gen, gen_url)
        endpoint = httpx.get(ctx_url + "/disagg/info").json()["kv_endpoint"]
        results["correctness"] = correctness(ctx_url, gen_url)
        opened: dict = {}
        rows = []
        for length in PROMPT_TOKENS:
            prompt = [(13 * i + 5) % 30000 + 100 for i in range(length)]
            for transport in ("cuda_ipc", "tcp"):
                median, nbytes = time_fetch(ctx_url, endpoint, prompt, transport, REPEATS,
                                            opened)
                bandwidth = copy_bandwidth(nbytes)
                rows.append({"prompt_tokens": length, "transport": transport, "bytes": nbytes,
                             "median_s": median, "ms_per_1k_tokens": median * 1e3 * 1024 / length,
                             "GB_per_s": nbytes / median / 1e9,
                             "d2d_copy_GB_per_s": bandwidth / 1e9,
                             "d2d_copy_ms_per_1k_tokens": nbytes / bandwidth * 1e3 * 1024 / length})
        results["transfer"] = rows
        results["generation_stats"] = httpx.get(gen_url + "/disagg/stats").json()
    finally:
        for proc in (ctx, gen):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc in (ctx, gen):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_disagg.json").write_text(json.dumps(results, indent=2))
    print(f"\n{results['device']}, {args.model} (bf16 random weights)")
    for row in results["correctness"]:
        print(f"correctness, prompt {row['prompt_tokens']:5d} tokens: identical="
              f"{row['identical']} first difference at {row['first_difference']}")
    print(f"{'prompt':>7} {'transport':>9} {'MB':>8} {'ms/1k tok':>10} {'GB/s':>7} "
          f"{'d2d GB/s':>9} {'d2d ms/1k':>10}")
    for r in results["transfer"]:
        print(f"{r['prompt_tokens']:7d} {r['transport']:>9} {r['bytes'] / 1e6:8.1f} "
              f"{r['ms_per_1k_tokens']:10.3f} {r['GB_per_s']:7.1f} {r['d2d_copy_GB_per_s']:9.0f} "
              f"{r['d2d_copy_ms_per_1k_tokens']:10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
