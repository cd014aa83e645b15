"""Serving throughput with the engine in its own process (`tllm serve`'s default) against the
engine in the server's process (`--no-engine-process`), and the offline engine
(`tllm bench throughput`) as the ceiling, all in one run on the same machine.

For each server mode: start `tllm serve MODEL`, wait for /health, send a short warm-up, then
`tllm bench serve` once per --rates entry (ISL/OSL exact, streaming completions), then stop
the server with SIGINT. Every figure is written to --out as JSON as soon as it exists; a
markdown table is printed last, then the server's TTFT by stage for each run (server,
handoff to the engine process, queue, prefill, return to the HTTP handler).

One `tllm bench serve` process parses about 10k streamed tokens/s on these hosts' cores, so
--clients K runs it with --num-clients K: the same requests dealt over K processes that start
together, their per-request records merged (throughput over the longest one's duration).

    python benchmarks/gpu_serving.py --out serving.json                          # H200
    python benchmarks/gpu_serving.py --model dummy:smollm2-135m --num-prompts 64 \\
        --rates inf --max-seq-len 256 --out /tmp/serving.json                     # CPU check
"""
from __future__ import annotations

import argparse
import json
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TLLM = [sys.executable, "-m", "tllm.cli"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--osl", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--rates", default="inf,40", help="request rates, comma-separated")
    p.add_argument("--repeats", type=int, default=1, help="runs of each rate")
    p.add_argument("--clients", default="1", help="load-generator processes; a comma list "
                   "runs each rate once per count")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--modes", default="offline,engine-process,in-process")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--server-args", default="",
                   help="extra `tllm serve` flags, e.g. '--prefill-token-budget 1024'")
    p.add_argument("--out", required=True)
    return p.parse_args()


def run_offline(args, results: dict) -> None:
    path = Path(args.out).with_suffix(".offline.json")
    cmd = [*TLLM, "bench", "throughput", "--model", args.model, "--isl", str(args.isl),
           "--osl", str(args.osl), "--num-requests", str(args.num_prompts),
           "--max-seq-len", str(args.max_seq_len), "--json", str(path)]
    subprocess.run(cmd, check=True)
    results["offline"] = json.loads(path.read_text())


def run_server_mode(args, mode: str, results: dict, log_dir: Path) -> None:
    port = _free_port()
    cmd = [*TLLM, "serve", args.model, "--port", str(port), "--max-seq-len",
           str(args.max_seq_len), "--log-level", "warning"]
    if mode == "in-process":
        cmd.append("--no-engine-process")
    cmd += shlex.split(args.server_args)
    log = open(log_dir / f"server-{mode}.log", "w")
    start = time.monotonic()
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base_url, server, args.startup_timeout)
        results[mode] = {"startup_s": time.monotonic() - start, "runs": {}}
        _bench(args, base_url, "inf", min(64, args.num_prompts), log_dir / "warmup", 1)
        for rate, clients in [(r, int(c)) for r in args.rates.split(",")
                              for c in args.clients.split(",")] * args.repeats:
            num_prompts = args.num_prompts if rate == "inf" else int(args.num_prompts * 0.8)
            name = rate if clients == 1 else f"{rate} x{clients} clients"
            while name in results[mode]["runs"]:    # a rate given twice, or --repeats
                name = f"{rate} #{len(results[mode]['runs']) + 1}"
            results[mode]["runs"][name] = _bench(args, base_url, rate, num_prompts,
                                                 log_dir / f"{mode}-run", clients)
            _save(args, results)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def _bench(args, base_url: str, rate: str, num_prompts: int, stem: Path,
           num_clients: int) -> dict:
    """One `tllm bench serve` run (over num_clients load-generator processes); its summary."""
    path = stem.with_suffix(".json")
    subprocess.run([*TLLM, "bench", "serve", "--base-url", base_url, "--isl", str(args.isl),
                    "--osl", str(args.osl), "--num-prompts", str(num_prompts),
                    "--request-rate", rate, "--num-clients", str(num_clients),
                    "--result-file", str(path), "--plot-file", ""], check=True)
    summary = json.loads(path.read_text())["summary"]
    path.unlink()           # per-request records: keep only the summary
    return summary


def _wait_healthy(base_url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} while starting")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not come up")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _save(args, results: dict) -> None:
    Path(args.out).write_text(json.dumps(results, indent=2))


def print_table(results: dict) -> None:
    offline = results.get("offline", {})
    offline_tps = offline.get("output_tokens_per_s") or offline.get("output_throughput")
    print("\n| mode | rate | req/s | output tok/s | vs offline | TTFT p50 / p99 ms | "
          "TPOT p50 / p99 ms |")
    print("| --- | --- | ---: | ---: | ---: | --- | --- |")
    if offline_tps:
        print(f"| offline | all at once | - | {offline_tps:,.0f} | 1.00 | - | - |")
    for mode in ("engine-process", "in-process"):
        for rate, run in results.get(mode, {}).get("runs", {}).items():
            tps = run.get("output_throughput", 0.0)
            ratio = f"{tps / offline_tps:.2f}" if offline_tps else "-"
            print(f"| {mode} | {rate} | {run.get('request_throughput', 0):.1f} | {tps:,.0f} | "
                  f"{ratio} | {_pct(run, 'ttft')} | {_pct(run, 'tpot')} |")
    print_stages(results)


def print_stages(results: dict) -> None:
    """The server's TTFT by stage (tllm/serve/http/ttft_breakdown.py), p50 / p99 ms per run."""
    stages = ("server", "handoff", "queue", "prefill", "return")
    print("\n| mode | rate | " + " | ".join(f"{s} p50 / p99 ms" for s in stages) + " |")
    print("| --- | --- |" + " --- |" * len(stages))
    for mode in ("engine-process", "in-process"):
        for rate, run in results.get(mode, {}).get("runs", {}).items():
            figures = run.get("server_ttft_stages") or {}
            cells = [f"{figures[s]['p50_ms']:.1f} / {figures[s]['p99_ms']:.1f}"
                     if s in figures else "-" for s in stages]
            print(f"| {mode} | {rate} | " + " | ".join(cells) + " |")


def _pct(run: dict, name: str) -> str:
    return f"{run.get(f'p50_{name}_ms', float('nan')):.1f} / " \
           f"{run.get(f'p99_{name}_ms', float('nan')):.1f}"


def main() -> int:
    args = parse_args()
    log_dir = Path(args.out).resolve().parent
    results: dict = {"args": vars(args)}
    for mode in args.modes.split(","):
        try:
            if mode == "offline":
                run_offline(args, results)
            else:
                run_server_mode(args, mode, results, log_dir)
        except Exception as exc:      # keep the other modes' figures
            results.setdefault("errors", {})[mode] = repr(exc)
            print(f"{mode} failed: {exc!r}", file=sys.stderr)
        _save(args, results)
    print_table(results)
    return 1 if results.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
