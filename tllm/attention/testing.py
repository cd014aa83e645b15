"""Random paged-attention batches and error measures, shared by the kernel tests and the
kernel benchmark. Needs only torch."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tllm.attention.interface import AttentionMetadata, KVCache


@dataclass
class PagedBatch:
    """This step's q/k/v plus a cache whose prefixes already hold random keys and values."""
    q: torch.Tensor          # [T, Hq, D]
    k: torch.Tensor          # [T, Hkv, D]
    v: torch.Tensor
    kv_cache: KVCache
    metadata: AttentionMetadata


def make_paged_batch(query_lens: list[int], prefix_lens: list[int], num_heads: int,
                     num_kv_heads: int, head_dim: int, tokens_per_block: int,
                     dtype: torch.dtype, device: torch.device | str = "cpu",
                     spare_blocks: int = 3, generator: torch.Generator | None = None
                     ) -> PagedBatch:
    """Request i has prefix_lens[i] cached tokens and query_lens[i] new ones. Blocks are
    shuffled across the cache so tables are not contiguous, and every slot holds random data,
    so a kernel reading a wrong slot shows up as an error."""
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
    blocks_per_seq = [-(-s // tokens_per_block) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator)
    # Padding past a table's end points at block 0, as the model runner's tables do.
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used:used + n]
        used += n
    positions, slots = _positions_and_slots(tables, prefix_lens, seq_lens, tokens_per_block)
    shape = (num_blocks, tokens_per_block, num_kv_heads, head_dim)
    cache = (_randn(shape, dtype, device, generator), _randn(shape, dtype, device, generator))
    num_tokens = sum(query_lens)
    metadata = AttentionMetadata(
        positions=positions.to(device), slot_mapping=slots.to(device),
        query_start_loc=_cumsum(query_lens).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), tokens_per_block=tokens_per_block,
        query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens)
    return PagedBatch(_randn((num_tokens, num_heads, head_dim), dtype, device, generator),
                      _randn((num_tokens, num_kv_heads, head_dim), dtype, device, generator),
                      _randn((num_tokens, num_kv_heads, head_dim), dtype, device, generator),
                      cache, metadata)


def _positions_and_slots(tables, prefix_lens, seq_lens, tokens_per_block):
    positions, slots = [], []
    for i, (start, end) in enumerate(zip(prefix_lens, seq_lens)):
        pos = torch.arange(start, end)
        positions.append(pos)
        slots.append(tables[i, pos // tokens_per_block].long() * tokens_per_block
                     + pos % tokens_per_block)
    return torch.cat(positions), torch.cat(slots)


def _cumsum(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths).cumsum(0)
    return out


def _randn(shape, dtype, device, generator) -> torch.Tensor:
    if generator is None:
        return torch.randn(shape, dtype=dtype, device=device)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype).to(device)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; a NaN in `out` gives NaN, which fails any `<`."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def setup_triton_for_tests() -> torch.device:
    """Where kernel tests run: the GPU when there is one; otherwise the CPU under the Triton
    interpreter, which must be switched on before any kernel module is imported."""
    import os
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return torch.device("cuda")
    os.environ["TRITON_INTERPRET"] = "1"
    _single_threaded_blas()
    return torch.device("cpu")


def _single_threaded_blas() -> None:
    """The interpreter runs tl.dot as numpy matmuls of small tiles; multithreaded OpenBLAS
    spins on those and made the interpreted tests ~3x slower on a busy 2-core machine."""
    import ctypes
    import os
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # if numpy is not loaded yet
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
                     "scipy_openblas_set_num_threads"):
            if hasattr(lib, name):
                getattr(lib, name)(1)
                break
