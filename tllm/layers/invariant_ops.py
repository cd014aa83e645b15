"""The two batch-invariant primitives of deterministic mode (tllm.layers.batch_invariant
says what they fix): GEMM row counts, and elementwise ops over whole rows."""
from __future__ import annotations

import torch

MIN_ROWS = 8   # GEMM rows: at least this many, and a multiple of it
_GRAIN = 16384   # elements per piece: below torch's parallel grain (32768), one thread


def padded_rows(rows: int, min_rows: int = MIN_ROWS) -> int:
    """The rows a GEMM of `rows` rows runs with: a multiple of MIN_ROWS, at least min_rows."""
    return max(min_rows, -(-rows // MIN_ROWS) * MIN_ROWS)


def row_tiled(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, computed so that each row of x [rows, cols] is split into
    vector and tail parts the same way whatever the number of rows."""
    rows, cols = x.shape[0], x.shape[-1]
    # a row stride other than cols keeps torch from merging the rows into one long loop
    padded = x.new_empty(*x.shape[:-1], cols + 1)[..., :cols]
    padded.copy_(x)
    out = torch.empty_like(x)
    step = max(1, _GRAIN // max(1, x[0].numel()))
    for start in range(0, rows, step):
        out[start:start + step] = fn(padded[start:start + step])
    return out
