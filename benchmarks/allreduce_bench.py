"""All-reduce latency per message size over two ranks: the custom one-shot and two-shot
all-reduce (tllm.distributed.custom_allreduce) against NCCL, each checked against the
pure-torch reference first, then timed inside a CUDA graph of back-to-back all-reduces (as
a decode step runs them). On the CPU (--smoke) the ranks use gloo, the custom path reports
why it is off, and gloo is timed eagerly.

    python benchmarks/allreduce_bench.py [--smoke] [--out allreduce.json]

Used by benchmarks/gpu_multi.py (its `allreduce` section)."""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

# NVLink multicast stays off (the shared hosts require it; multimem ops are never used)
for _key in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_key, "0" if _key.startswith("NCCL") else "1")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tllm.distributed import comm  # noqa: E402
from tllm.distributed import custom_allreduce as car  # noqa: E402
from tllm.distributed.mapping import Mapping  # noqa: E402
from tllm.config import AllReduceConfig  # noqa: E402

GPU_SIZES = [2 << 10, 8 << 10, 32 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20,
             4 << 20, 8 << 20, 32 << 20]
SMOKE_SIZES = [2 << 10, 8 << 10, 32 << 10, 128 << 10]
OPS_PER_GRAPH = 16
TIMED_REPLAYS = 30


def _tensor(rank: int, numel: int, seed: int, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7919 * seed + rank)
    return torch.randn(numel, generator=generator).to(torch.bfloat16).to(device)


def _reference(numel: int, seed: int, device) -> torch.Tensor:
    return car.reference_all_reduce([_tensor(r, numel, seed, "cpu") for r in range(2)]).to(device)


def _reduce(path: str, x: torch.Tensor) -> torch.Tensor:
    if path == car.NCCL:
        torch.distributed.all_reduce(x, group=comm.state().tp_group)
        return x
    return comm.state().custom_all_reduce.all_reduce(x, path)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if torch.isnan(got).any():
        return float("inf")
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _time_graph(path: str, numel: int, device) -> float:
    """Microseconds per all-reduce: OPS_PER_GRAPH of them captured in one graph, replayed."""
    x = torch.randn(numel, device=device).to(torch.bfloat16)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        _reduce(path, x.clone())   # warm-up outside the capture (NCCL sets up here)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(OPS_PER_GRAPH):
            y = _reduce(path, y)   # values double each op: 2^16 stays far inside bf16
    for _ in range(3):
        graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.distributed.barrier(group=comm.state().cpu_group)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(TIMED_REPLAYS):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / (TIMED_REPLAYS * OPS_PER_GRAPH)


def _time_eager(numel: int) -> float:
    x = torch.randn(numel).to(torch.bfloat16)
    _reduce(car.NCCL, x)
    started = time.perf_counter()
    for _ in range(10):
        _reduce(car.NCCL, x)
    return (time.perf_counter() - started) * 1e6 / 10


def _rank_main(rank: int, port: int, smoke: bool, out_path: str) -> None:
    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    comm.init_distributed(Mapping(2, 2, 1, rank), device, f"tcp://127.0.0.1:{port}",
                          timeout_s=120)
    try:
        result = _measure(rank, device, smoke)
        if rank == 0:
            Path(out_path).write_text(json.dumps(result))
    finally:
        comm.destroy_distributed()


def _measure(rank: int, device, smoke: bool) -> dict:
    config = AllReduceConfig()
    off = comm.setup_all_reduce(config)
    custom = comm.state().custom_all_reduce
    rows = []
    for seed, nbytes in enumerate(SMOKE_SIZES if smoke else GPU_SIZES):
        numel = nbytes // 2
        paths = [car.NCCL] + ([car.ONE_SHOT, car.TWO_SHOT]
                              if custom is not None and nbytes <= config.custom_max_bytes else [])
        row = {"bytes": nbytes, "auto": car.pick_algorithm(nbytes, torch.bfloat16, config,
                                                           custom is not None)}
        for path in paths:
            got = _reduce(path, _tensor(rank, numel, seed, device))
            row[f"{path}_error"] = _relative_error(got, _reference(numel, seed, device))
            row[f"{path}_us"] = _time_eager(numel) if smoke else _time_graph(path, numel, device)
        rows.append(row)
    return {"custom_all_reduce": custom is not None, "off_reason": off, "ops_per_graph":
            OPS_PER_GRAPH, "timed": "eager, perf_counter" if smoke else "CUDA graph, events",
            "rows": rows}


def run(smoke: bool) -> dict:
    """Both ranks in processes of their own (spawned); rank 0's figures."""
    import tempfile
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "allreduce.json")
        mp.spawn(_rank_main, args=(port, smoke, out_path), nprocs=2, join=True)
        return json.loads(Path(out_path).read_text())


def table(result: dict) -> str:
    lines = [f"custom all-reduce: {'on' if result['custom_all_reduce'] else 'off'}"
             + (f" ({result['off_reason']})" if result["off_reason"] else ""),
             "| bytes | auto picks | NCCL (gloo) us | one-shot us | two-shot us | max rel. error |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        cells = [f"{r[f'{p}_us']:.1f}" if f"{p}_us" in r else "-"
                 for p in (car.NCCL, car.ONE_SHOT, car.TWO_SHOT)]
        error = max(v for k, v in r.items() if k.endswith("_error"))
        lines.append(f"| {r['bytes']} | {r['auto']} | {' | '.join(cells)} | {error:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo")
    parser.add_argument("--out", default="allreduce.json")
    args = parser.parse_args()
    result = run(args.smoke)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
