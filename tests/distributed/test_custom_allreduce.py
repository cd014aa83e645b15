"""The tensor-parallel all-reduce: the choice of one-shot / two-shot / NCCL by size, the
pure-torch math of both algorithms against the plain sum, NCCL/gloo off the GPU (two gloo
processes), and on two GPUs the custom all-reduce against the reference across sizes and
dtypes, eagerly and inside a CUDA graph."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from tllm.distributed import comm
from tllm.distributed import custom_allreduce as car
from tllm.distributed.mapping import Mapping
from tllm.config import AllReduceConfig, LlmArgs

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
DEFAULT = AllReduceConfig()


def _check(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str,
           scale: torch.Tensor | None = None) -> None:
    """Error relative to the norm of `scale` (default: the sum itself; the sum of the
    inputs' magnitudes where they may cancel); NaN never passes."""
    assert not torch.isnan(got).any(), what
    scale = expected if scale is None else scale
    error = ((got.double() - expected.double()).norm() / scale.double().norm()).item()
    assert error < (1e-6 if dtype == torch.float32 else 1e-2), (what, error)


@pytest.mark.parametrize("nbytes,dtype,config,available,expected", [
    (8 << 10, torch.bfloat16, DEFAULT, True, car.ONE_SHOT),
    (256 << 10, torch.bfloat16, DEFAULT, True, car.ONE_SHOT),
    ((256 << 10) + 4, torch.bfloat16, DEFAULT, True, car.TWO_SHOT),
    (8 << 20, torch.float32, DEFAULT, True, car.TWO_SHOT),
    ((8 << 20) + 4, torch.float32, DEFAULT, True, car.NCCL),      # over the peer buffer
    (8 << 10, torch.float16, DEFAULT, True, car.NCCL),            # no fp16 kernel in torch
    (6, torch.bfloat16, DEFAULT, True, car.NCCL),                 # 3 elements: not 4-aligned
    (0, torch.bfloat16, DEFAULT, True, car.NCCL),
    (8 << 10, torch.bfloat16, DEFAULT, False, car.NCCL),          # CPU, gloo, no P2P
    (8 << 10, torch.bfloat16, AllReduceConfig(strategy="nccl"), True, car.NCCL),
    (1 << 20, torch.bfloat16, AllReduceConfig(strategy="oneshot"), True, car.ONE_SHOT),
    (1 << 10, torch.bfloat16, AllReduceConfig(strategy="twoshot"), True, car.TWO_SHOT),
    (64 << 10, torch.bfloat16, AllReduceConfig(one_shot_max_bytes=32 << 10), True,
     car.TWO_SHOT),
])
def test_pick_algorithm_by_size_and_dtype(nbytes, dtype, config, available, expected):
    assert car.pick_algorithm(nbytes, dtype, config, available) == expected


def test_config_is_validated_and_reaches_llm_args():
    with pytest.raises(ValueError, match="one_shot_max_bytes"):
        AllReduceConfig(one_shot_max_bytes=2 << 20, custom_max_bytes=1 << 20)
    with pytest.raises(ValueError, match="strategy"):
        AllReduceConfig(strategy="ring")
    args = LlmArgs(model="m", allreduce_config={"strategy": "twoshot"})
    assert args.allreduce_config.strategy == "twoshot"
    assert LlmArgs(model="m").allreduce_config.strategy == "auto"


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(1,), (7, 5), (3, 4096), (129, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_algorithms_equal_the_sum(world_size, shape, dtype):
    """Both accumulate in the dtype, rank by rank, as torch's kernels do."""
    buffers = [torch.randn(shape).to(dtype) for _ in range(world_size)]
    expected = car.reference_all_reduce(buffers)
    magnitude = car.reference_all_reduce([b.abs() for b in buffers])
    _check(car.one_shot_reference(buffers), expected, dtype, "one-shot", magnitude)
    two_shot = car.two_shot_reference(buffers)
    assert len(two_shot) == world_size
    for out in two_shot:
        assert out.shape == buffers[0].shape and out.dtype == dtype
        assert torch.equal(out, two_shot[0])   # every rank holds the same sum
        _check(out, expected, dtype, "two-shot", magnitude)


@pytest.mark.parametrize("numel", [1, 9, 64, 1000, 4099])
@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_two_shot_slices_cover_the_message_aligned(numel, world_size):
    slices = car.two_shot_slices(numel, 2, world_size)
    covered = [i for s in slices for i in range(s.start, s.stop)]
    assert covered == list(range(numel))
    assert all(s.start % 8 == 0 for s in slices if s.start < numel)   # 16 bytes of bf16


def test_unavailable_reasons():
    cuda0 = torch.device("cuda", 0)
    here = [(socket.gethostname(), 0), (socket.gethostname(), 1)]
    assert "CUDA" in car.unavailable_reason(DEFAULT, torch.device("cpu"), 2, here)
    assert "nccl" in car.unavailable_reason(AllReduceConfig(strategy="nccl"), cuda0, 2, here)
    assert "one rank" in car.unavailable_reason(DEFAULT, cuda0, 1, here[:1])
    assert "hosts" in car.unavailable_reason(DEFAULT, cuda0, 2, [("a", 0), ("b", 0)])
    assert "custom_max_bytes" in car.unavailable_reason(
        AllReduceConfig(custom_max_bytes=0, one_shot_max_bytes=0), cuda0, 2, here)


def _rank_tensor(rank: int, numel: int, dtype: torch.dtype, step: int) -> torch.Tensor:
    """Rank `rank`'s input: fresh random values any rank can regenerate."""
    generator = torch.Generator().manual_seed(1000 * step + 17 * rank + numel)
    return torch.randn(numel, generator=generator).to(dtype)


def _join(rank: int, port: int, device: torch.device) -> None:
    comm.init_distributed(Mapping(2, 2, 1, rank), device, f"tcp://127.0.0.1:{port}",
                          timeout_s=120)


def _gloo_worker(rank: int, port: int) -> None:
    _join(rank, port, torch.device("cpu"))
    try:
        reason = comm.setup_all_reduce(DEFAULT)
        assert reason is not None and "cpu" in reason, reason
        assert comm.state().custom_all_reduce is None
        for step, numel in enumerate((1, 2048, 70000)):
            x = _rank_tensor(rank, numel, torch.float32, step)
            expected = car.reference_all_reduce([_rank_tensor(r, numel, torch.float32, step)
                                                 for r in range(2)])
            assert torch.allclose(comm.tp_all_reduce(x), expected, atol=1e-6)
    finally:
        comm.destroy_distributed()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_gloo_ranks_reduce_through_gloo():
    mp.spawn(_gloo_worker, args=(_free_port(),), nprocs=2, join=True)


# ---- two GPUs ----

SIZES = (2, 8, 1000, 4096, 4096 * 8, 65536, 3 * 2**17 + 8, 2**20)


def _gpu_worker(rank: int, port: int) -> None:
    device = torch.device("cuda", rank)
    _join(rank, port, device)
    try:
        assert comm.setup_all_reduce(DEFAULT) is None
        custom = comm.state().custom_all_reduce
        _check_eager(custom, rank, device)
        _check_graph(custom, rank, device)
        _check_nccl_fallbacks(rank, device)
        torch.cuda.synchronize(device)
    finally:
        comm.destroy_distributed()


def _expected(numel: int, dtype: torch.dtype, step: int, device) -> torch.Tensor:
    return car.reference_all_reduce([_rank_tensor(r, numel, dtype, step)
                                     for r in range(2)]).to(device)


def _check_eager(custom, rank: int, device) -> None:
    step = 0
    for dtype in car.SUPPORTED_DTYPES:
        for numel in SIZES:
            for algorithm in (car.ONE_SHOT, car.TWO_SHOT):
                step += 1
                x = _rank_tensor(rank, numel, dtype, step).to(device)
                before = x.clone()
                got = custom.all_reduce(x, algorithm)
                _check(got, _expected(numel, dtype, step, device), dtype,
                       f"{algorithm} {dtype} {numel}")
                assert torch.equal(x, before)   # the input is left as it was


def _check_graph(custom, rank: int, device) -> None:
    """Captured once per algorithm with a static input; every replay reduces new values."""
    for algorithm, numel in ((car.ONE_SHOT, 4096), (car.TWO_SHOT, 3 * 2**17 + 8)):
        static = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            custom.all_reduce(static, algorithm)   # warm up outside the capture
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = custom.all_reduce(static, algorithm)
        for step in range(3):
            static.copy_(_rank_tensor(rank, numel, torch.bfloat16, 900 + step))
            out.fill_(float("nan"))   # poison: unwritten elements show
            graph.replay()
            _check(out, _expected(numel, torch.bfloat16, 900 + step, device), torch.bfloat16,
                   f"graph {algorithm} replay {step}")


def _check_nccl_fallbacks(rank: int, device) -> None:
    """Through comm.tp_all_reduce: fp16 and a message over the peer buffer go to NCCL."""
    for step, (numel, dtype) in enumerate(((4096, torch.float16), ((8 << 20) // 4 + 4,
                                                                  torch.float32))):
        x = _rank_tensor(rank, numel, dtype, 500 + step).to(device)
        assert comm.state().custom_all_reduce.algorithm(x) == car.NCCL
        _check(comm.tp_all_reduce(x), _expected(numel, dtype, 500 + step, device), dtype,
               f"nccl {dtype} {numel}")


@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs")
def test_custom_all_reduce_matches_reference_on_two_gpus():
    mp.spawn(_gpu_worker, args=(_free_port(),), nprocs=2, join=True)


@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("strategy", ["auto", "nccl"])
def test_tp2_greedy_equals_tp1_on_two_gpus(tiny_llama, strategy):
    """fp32 tiny Llama: TP=2 with the custom all-reduce (or NCCL) gives TP=1's tokens."""
    from tllm import LLM, SamplingParams
    path = str(tiny_llama[0])
    prompts = [[1] + list(range(5 + i, 40 + 7 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    runs = {}
    for tp in (1, 2):
        with LLM(path, dtype="float32", tensor_parallel_size=tp,
                 kv_cache_config={"max_tokens": 4096},
                 allreduce_config={"strategy": strategy}) as llm:
            if tp == 2:
                assert (comm.state().custom_all_reduce is not None) == (strategy == "auto")
            runs[tp] = [o.outputs[0].token_ids
                        for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runs[2] == runs[1]
