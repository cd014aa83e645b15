"""Soak test of `tllm serve` (loopback only, bounded): memory growth, 5xx and leaked KV blocks
under mixed load.

Starts `tllm serve MODEL` on a free 127.0.0.1 port (a small KV pool, so the load cycles
through all of it) and takes the server's and the engine process's RSS (psutil) at start
(the engine's CPU KV pool allocated, its pages not yet touched). Then it fills the KV pool to
the brim twice with distinct prompts (every block written at least once; RSS again: the
pool's real size is in it now), runs --warmup-minutes of the mixed load, takes
RSS as the baseline, then runs --minutes more of it, sampling RSS every --sample-s. The mix,
from --clients concurrent clients: streamed completions and chats read to the end, streams
dropped mid-way, non-streamed requests with n > 1, clients that give up before the answer,
and requests from a small catalogue of hostile ones (each must get a 4xx).
At the end, once every request has finished: 5xx seen by the clients and counted by the
server's /metrics, KV blocks still in use (leaked), RSS growth over the baseline.

Goals: RSS growth < 2% after warm-up (server and engine), 0 x 5xx, 0 leaked blocks; the exit
status is 1 if one is missed. Full figures go to --out (JSON); a table is printed last.

    python benchmarks/soak.py --minutes 10 --out /tmp/soak.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

TLLM = [sys.executable, "-m", "tllm.cli"]
WORDS = ("river stone light quiet engine garden winter paper music window story number "
         "silver market ocean thunder forest letter candle bridge").split()
TIMEOUT = httpx.Timeout(60.0, connect=10.0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--minutes", type=float, default=10.0, help="mixed load after warm-up")
    p.add_argument("--warmup-minutes", type=float, default=1.0)
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling period")
    p.add_argument("--kv-cache-tokens", type=int, default=8192)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--out", help="write every figure here as JSON")
    return p.parse_args(argv)


# ---- the load ----

@dataclass
class Tally:
    """What the clients saw."""

    statuses: Counter = field(default_factory=Counter)      # (kind, status) -> count
    server_errors: list[str] = field(default_factory=list)  # 5xx and broken connections
    hostile_not_4xx: list[str] = field(default_factory=list)

    def record(self, kind: str, status: int | str, detail: str = "") -> None:
        """status: the HTTP status, "client left" (its own timeout), or what went wrong on
        the server's side ("error event", "transport error: ...", "no answer")."""
        self.statuses[(kind, status)] += 1
        if status != "client left" and (isinstance(status, str) or status >= 500):
            self.server_errors.append(f"{kind}: {status} {detail[:200]}")

    @property
    def num_requests(self) -> int:
        return sum(self.statuses.values())

    def by_kind(self) -> dict[str, int]:
        counts: Counter = Counter()
        for (kind, _), n in self.statuses.items():
            counts[kind] += n
        return dict(counts)


@dataclass(frozen=True)
class Load:
    """Where and what to send."""

    base_url: str
    model: str
    max_token_id: int       # prompts as token ids stay below it
    body_read_timeout_s: float = 2.0


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def hostile_catalogue(load: Load) -> list[tuple[str, dict | str | None, dict]]:
    """(name, JSON body or raw text, extra headers) of requests that must get a 4xx."""
    m = load.model
    return [
        ("top_k 1e20", {"model": m, "prompt": "Hi", "temperature": 0.8,
                        "top_k": 100000000000000000000}, {}),
        ("logit_bias superscript key", {"model": m, "prompt": "Hi", "logit_bias": {"²": 5}}, {}),
        ("stream_options without stream", {"model": m, "prompt": "Hi",
                                           "stream_options": {"include_usage": True}}, {}),
        ("token id past the vocabulary", {"model": m, "prompt": [1, 10**9]}, {}),
        ("n 129", {"model": m, "prompt": "Hi", "n": 129}, {}),
        ("max_tokens 2**70", {"model": m, "prompt": "Hi", "max_tokens": 2**70}, {}),
        ("seed 2**64", {"model": m, "prompt": "Hi", "seed": 2**64}, {}),
        ("max_tokens a string", {"model": m, "prompt": "Hi", "max_tokens": "ten"}, {}),
        ("wrong model", {"model": "no-such-model", "prompt": "Hi"}, {}),
        ("empty prompt", {"model": m, "prompt": ""}, {}),
        ("lone surrogate", '{"model": "%s", "prompt": "\\ud800"}' % m, {}),
        ("malformed JSON", '{"model": "%s", "prompt": ' % m, {}),
        ("deeply nested", '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", {}),
        ("NaN temperature", '{"model": "%s", "prompt": "Hi", "temperature": NaN}' % m, {}),
        ("text/plain body", '{"prompt": "Hi"}', {"content-type": "text/plain"}),
        ("huge header", {"model": m, "prompt": "Hi"}, {"x-filler": "x" * 40000}),
        ("chat: no messages", {"model": m, "messages": []}, {"path": "/v1/chat/completions"}),
        ("chat: image part", {"model": m, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
         {"path": "/v1/chat/completions"}),
        ("chat: bad role", {"model": m, "messages": [{"role": "wizard", "content": "x"}]},
         {"path": "/v1/chat/completions"}),
    ]


async def send_hostile(client: httpx.AsyncClient, load: Load, rng: random.Random,
                       tally: Tally) -> None:
    catalogue = hostile_catalogue(load)
    if rng.random() < 0.1:
        await send_short_body(load, tally)
        return
    name, body, headers = rng.choice(catalogue)
    headers = dict(headers)
    path = headers.pop("path", "/v1/completions")
    if isinstance(body, str):
        headers.setdefault("content-type", "application/json")
        request = client.build_request("POST", path, content=body, headers=headers)
    else:
        request = client.build_request("POST", path, json=body, headers=headers)
    try:
        response = await client.send(request)
    except httpx.TransportError as exc:
        tally.record("hostile", f"transport error: {type(exc).__name__}", name)
        return
    tally.record("hostile", response.status_code, f"{name}: {response.text}")
    if not 400 <= response.status_code < 500:
        tally.hostile_not_4xx.append(f"{name}: {response.status_code}")


async def send_short_body(load: Load, tally: Tally) -> None:
    """A body shorter than its Content-Length: the server must answer 408 and hang up."""
    host, port = load.base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        await writer.drain()
        head = await asyncio.wait_for(reader.readline(), load.body_read_timeout_s + 10)
        status = int(head.split()[1]) if head.startswith(b"HTTP/") else "no answer"
        tally.record("hostile", status, "short body")
        if status != 408:
            tally.hostile_not_4xx.append(f"short body: {status}")
    finally:
        writer.close()


async def send_stream(client: httpx.AsyncClient, load: Load, rng: random.Random, tally: Tally,
                      drop_after: int | None) -> None:
    """A streamed completion or chat, read to the end, or dropped after `drop_after` chunks."""
    kind = "stream" if drop_after is None else "dropped stream"
    max_tokens = rng.randint(8, 64)
    if rng.random() < 0.5:
        path, body = "/v1/completions", {"prompt": words(rng, rng.randint(3, 40))}
    else:
        path, body = "/v1/chat/completions", {"messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": words(rng, rng.randint(3, 30))}]}
    body = {"model": load.model, **body, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True,
                               "continuous_usage_stats": rng.random() < 0.5}}
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            tally.record(kind, response.status_code, (await response.aread()).decode())
            return
        num_chunks = 0
        async for line in response.aiter_lines():
            if '"error"' in line:
                tally.record(kind, "error event", line)
                return
            num_chunks += line.startswith("data: {")
            if drop_after is not None and num_chunks >= drop_after:
                break
        tally.record(kind, 200)


async def send_samples(client: httpx.AsyncClient, load: Load, rng: random.Random,
                       tally: Tally) -> None:
    """Non-streamed, n > 1, as completions (text or token ids) or chat."""
    n = rng.randint(2, 4)
    if rng.random() < 0.5:
        prompt = (words(rng, rng.randint(3, 30)) if rng.random() < 0.5 else
                  [rng.randrange(100, load.max_token_id) for _ in range(rng.randint(3, 60))])
        path, body = "/v1/completions", {"prompt": prompt, "logprobs": rng.choice([None, 2])}
    else:
        path, body = "/v1/chat/completions", {"messages": [
            {"role": "user", "content": words(rng, rng.randint(3, 30))}]}
    body = {"model": load.model, **body, "n": n, "max_tokens": rng.randint(4, 24),
            "temperature": 0.8, "seed": rng.randrange(2**31)}
    response = await client.post(path, json=body)
    tally.record("n > 1", response.status_code, response.text)


async def send_and_give_up(client: httpx.AsyncClient, load: Load, rng: random.Random,
                           tally: Tally) -> None:
    """A long non-streamed request whose client leaves before the answer."""
    body = {"model": load.model, "prompt": words(rng, 10), "max_tokens": 200,
            "ignore_eos": True}
    try:
        response = await client.post("/v1/completions", json=body,
                                     timeout=rng.uniform(0.2, 1.5))
    except httpx.TimeoutException:
        tally.record("gave up", "client left")
        return
    tally.record("gave up", response.status_code, response.text)


MIX = ((0.30, "stream"), (0.20, "dropped stream"), (0.20, "n > 1"), (0.10, "gave up"),
       (0.20, "hostile"))


async def one_request(client: httpx.AsyncClient, load: Load, rng: random.Random,
                      tally: Tally) -> None:
    kind = rng.choices([k for _, k in MIX], weights=[w for w, _ in MIX])[0]
    try:
        if kind == "stream":
            await send_stream(client, load, rng, tally, drop_after=None)
        elif kind == "dropped stream":
            await send_stream(client, load, rng, tally, drop_after=rng.randint(1, 6))
        elif kind == "n > 1":
            await send_samples(client, load, rng, tally)
        elif kind == "gave up":
            await send_and_give_up(client, load, rng, tally)
        else:
            await send_hostile(client, load, rng, tally)
    except httpx.TransportError as exc:     # the server dropped the connection
        tally.record(kind, f"transport error: {type(exc).__name__}", str(exc))


async def run_load(load: Load, seconds: float, num_clients: int, seed: int,
                   tally: Tally) -> None:
    """num_clients clients, each sending one request after another until `seconds` pass."""
    deadline = time.monotonic() + seconds

    async def client_loop(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        async with httpx.AsyncClient(base_url=load.base_url, timeout=TIMEOUT) as client:
            while time.monotonic() < deadline:
                await one_request(client, load, rng, tally)

    await asyncio.gather(*(client_loop(i) for i in range(num_clients)))


async def fill_kv_pool(load: Load, capacity_tokens: int, seed: int) -> float:
    """Distinct long prompts worth 1.25x the pool, all at once; the peak KV use seen."""
    rng = random.Random(seed)
    prompt_len = 480
    num_requests = int(1.25 * capacity_tokens / (prompt_len + 16)) + 1
    peak = 0.0

    async def one(client: httpx.AsyncClient) -> None:
        prompt = [rng.randrange(100, load.max_token_id) for _ in range(prompt_len)]
        response = await client.post("/v1/completions", json={
            "model": load.model, "prompt": prompt, "max_tokens": 16, "ignore_eos": True})
        response.raise_for_status()

    async def watch(client: httpx.AsyncClient) -> None:
        nonlocal peak
        while True:
            peak = max(peak, scrape(await client.get("/metrics"))["kv_use"])
            await asyncio.sleep(0.2)

    limits = httpx.Limits(max_connections=num_requests + 2)
    async with httpx.AsyncClient(base_url=load.base_url, timeout=300, limits=limits) as client:
        watcher = asyncio.create_task(watch(client))
        await asyncio.gather(*(one(client) for _ in range(num_requests)))
        watcher.cancel()
    return peak


# ---- the server and what it reports ----

def scrape(response: httpx.Response) -> dict[str, float]:
    """The figures of /metrics this script checks."""
    values = {"running": 0.0, "waiting": 0.0, "kv_use": 0.0, "kv_blocks": 0.0,
              "kv_tokens": 0.0, "http_5xx": 0.0}
    names = {"tllm:num_requests_running": "running", "tllm:num_requests_waiting": "waiting",
             "tllm:kv_cache_usage_perc": "kv_use", "tllm:kv_cache_blocks_total": "kv_blocks",
             "tllm:kv_cache_capacity_tokens": "kv_tokens"}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in names:
                values[names[sample.name]] = sample.value
            elif (sample.name == "tllm:http_requests_total"
                  and sample.labels.get("status", "").startswith("5")):
                values["http_5xx"] += sample.value
    return values


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args, port: int, log_path: Path) -> subprocess.Popen:
    cmd = [*TLLM, "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
           "--kv-cache-tokens", str(args.kv_cache_tokens),
           "--max-batch-size", str(args.max_batch_size), "--max-seq-len", str(args.max_seq_len),
           "--max-num-tokens", "512", "--max-queue-size", "256", "--body-read-timeout", "2",
           "--log-level", "warning"]
    print("server:", " ".join(cmd[2:]), file=sys.stderr)
    return subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT)


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=base_url, timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                if client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
    raise RuntimeError("the server did not come up")


def engine_process(server: psutil.Process) -> psutil.Process:
    """The engine process: the server's child that multiprocessing spawned."""
    for child in server.children():
        if "spawn_main" in " ".join(child.cmdline()):
            return child
    raise RuntimeError("no engine process under the server")


class RssLog:
    """RSS of the server and engine processes, sampled every period_s from a task."""

    def __init__(self, pids: dict[str, int], period_s: float) -> None:
        self.processes = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.period_s = period_s
        self.samples: list[dict] = []
        self.phase = "warm-up"

    def sample(self) -> dict:
        row = {"t": time.monotonic(), "phase": self.phase,
               **{name: p.memory_info().rss for name, p in self.processes.items()}}
        self.samples.append(row)
        return row

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.period_s)

    def mean_of(self, phase: str, last: int = 3) -> dict[str, float]:
        rows = [r for r in self.samples if r["phase"] == phase][-last:]
        return {name: statistics.mean(r[name] for r in rows) for name in self.processes}

    def max_of(self, phase: str) -> dict[str, float]:
        rows = [r for r in self.samples if r["phase"] == phase]
        return {name: max(r[name] for r in rows) for name in self.processes}


async def drain(base_url: str, timeout_s: float = 60) -> dict[str, float]:
    """/metrics once nothing runs or waits (every request has finished)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        while True:
            figures = scrape(await client.get("/metrics"))
            idle = figures["running"] == 0 and figures["waiting"] == 0
            if (idle and figures["kv_use"] == 0) or time.monotonic() > deadline:
                return figures
            await asyncio.sleep(0.2)


async def soak(args, base_url: str, pids: dict[str, int]) -> dict:
    async with httpx.AsyncClient(base_url=base_url) as client:
        capacity = scrape(await client.get("/metrics"))["kv_tokens"]
    load = Load(base_url, args.model, max_token_id=49152)
    result: dict = {"kv_capacity_tokens": capacity}
    rss = RssLog(pids, args.sample_s)
    rss.phase = "start"  # these two samples stay out of the warm-up baseline
    rss.sample()
    result["rss_at_start"] = rss.samples[0]
    result["kv_fill_peaks"] = [await fill_kv_pool(load, int(capacity), args.seed + i)
                               for i in range(2)]
    result["rss_after_kv_fill"] = rss.sample()
    rss.phase = "warm-up"
    sampler = asyncio.create_task(rss.run())
    tally = Tally()
    await run_load(load, args.warmup_minutes * 60, args.clients, args.seed, tally)
    rss.sample()
    rss.phase = "soak"
    started = time.monotonic()
    await run_load(load, args.minutes * 60, args.clients, args.seed + 1, tally)
    result["soak_s"] = time.monotonic() - started
    rss.sample()
    sampler.cancel()
    result["end"] = await drain(base_url)
    baseline, final, peak = rss.mean_of("warm-up"), rss.mean_of("soak"), rss.max_of("soak")
    result["rss"] = {name: {"at_start": result["rss_at_start"][name],
                            "after_kv_fill": result["rss_after_kv_fill"][name],
                            "after_warmup": baseline[name], "end": final[name],
                            "max": peak[name], "growth": final[name] / baseline[name] - 1,
                            "max_growth": peak[name] / baseline[name] - 1}
                     for name in pids}
    result["rss_samples"] = rss.samples
    result["requests"] = tally.num_requests
    result["by_kind"] = tally.by_kind()
    result["statuses"] = {f"{k} {s}": n for (k, s), n in sorted(tally.statuses.items(),
                                                                key=str)}
    result["client_5xx"] = tally.server_errors
    result["hostile_not_4xx"] = tally.hostile_not_4xx
    result["leaked_blocks"] = round(result["end"]["kv_use"] * result["end"]["kv_blocks"])
    return result


def verdict(result: dict) -> list[tuple[str, str, str, bool]]:
    """(figure, value, goal, met) rows."""
    mib = 1 << 20
    rows = [("requests", f"{result['requests']} " + json.dumps(result["by_kind"]), "", True),
            ("5xx seen by clients", str(len(result["client_5xx"])), "0",
             not result["client_5xx"]),
            ("5xx counted by /metrics", f"{result['end']['http_5xx']:.0f}", "0",
             result["end"]["http_5xx"] == 0),
            ("hostile requests not 4xx", str(len(result["hostile_not_4xx"])), "0",
             not result["hostile_not_4xx"]),
            ("KV blocks in use at the end", str(result["leaked_blocks"]), "0",
             result["leaked_blocks"] == 0)]
    for name, r in result["rss"].items():
        rows.append((f"{name} RSS at start, after the KV fill (MiB)",
                     f"{r['at_start'] / mib:.0f}, {r['after_kv_fill'] / mib:.0f} "
                     f"({r['after_kv_fill'] / r['at_start'] - 1:+.2%})", "", True))
        rows.append((f"{name} RSS after warm-up -> end (max)",
                     f"{r['after_warmup'] / mib:.0f} -> {r['end'] / mib:.0f} MiB "
                     f"({r['growth']:+.2%}; max {r['max'] / mib:.0f}, {r['max_growth']:+.2%})",
                     "< +2%", r["growth"] < 0.02))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = Path(args.out or "soak").with_suffix(".server.log")
    proc = start_server(args, port, log_path)
    try:
        wait_healthy(base_url, proc, args.startup_timeout)
        server = psutil.Process(proc.pid)
        pids = {"server": proc.pid, "engine": engine_process(server).pid}
        result = asyncio.run(soak(args, base_url, pids))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    result.update(command=" ".join(sys.argv), server_exit_status=proc.returncode,
                  server_log=str(log_path))
    rows = verdict(result)
    rows.append(("server exit status", str(proc.returncode), "0", proc.returncode == 0))
    if args.out:
        Path(args.out).write_text(json.dumps({**result, "verdict": rows}, indent=1))
    print("\n| figure | value | goal | met |\n|---|---|---|---|")
    for figure, value, goal, met in rows:
        print(f"| {figure} | {value} | {goal} | {'yes' if met else 'NO'} |")
    return 0 if all(met for *_, met in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
