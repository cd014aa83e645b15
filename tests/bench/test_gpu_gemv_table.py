"""benchmarks/gpu_gemv.py --write-table: a sweep's winners become the device's dense GEMV
table, merged over the rows already there (the sweep itself runs on a GPU)."""
import importlib.util
import json
from pathlib import Path

_BENCH = Path(__file__).parents[2] / "benchmarks"
_SPEC = importlib.util.spec_from_file_location("gpu_gemv", _BENCH / "gpu_gemv.py")
gpu_gemv = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_gemv)

from tllm.kernels.triton.dense_gemv_configs import parse_table  # noqa: E402


def _launch(block_n):
    return {"block_n": block_n, "block_k": 1024, "num_warps": 4, "num_stages": 2}


def test_winners_replace_their_rows_and_keep_the_others():
    old = [{"kind": "plain", "n": 64, "k": 128, "use": True, "block_n": 2, "block_k": 256,
            "num_warps": 4, "num_stages": 3, "us": 3.0, "cublas_us": 4.0, "device": "A"},
           {"kind": "plain", "n": 32, "k": 128, "use": True, "block_n": 8, "block_k": 512,
            "num_warps": 8, "num_stages": 2, "us": 2.0, "cublas_us": 3.0, "device": "A"}]
    results = {"device": "B",
               "shape_list": [("x", "plain", 64, 128, True), ("y", "silu_mul", 96, 128, True),
                              ("head", "plain", 999, 128, False)],
               "shapes": {"x": {"best": 0, "launches": [_launch(4)], "best_us": 5.0,
                                "cublas_us": 4.0},
                          "y": {"best": 0, "launches": [_launch(1)], "best_us": 1.0,
                                "cublas_us": 2.0},
                          "head": {"best": 0, "launches": [_launch(4)], "best_us": 1.0,
                                   "cublas_us": 2.0}}}
    rows = json.loads(gpu_gemv.winners_table(results, old))
    table = parse_table(rows)
    assert set(table) == {("plain", 64, 128), ("plain", 32, 128), ("silu_mul", 96, 128)}
    assert table[("plain", 64, 128)].config.block_n == 4          # re-swept: the new winner,
    assert not table[("plain", 64, 128)].use                      # slower than cuBLAS now
    assert table[("plain", 32, 128)].config.block_n == 8          # not swept: kept
    assert table[("silu_mul", 96, 128)].use
    devices = {(r["kind"], r["n"]): r["device"] for r in rows}
    assert devices == {("plain", 64): "B", ("plain", 32): "A", ("silu_mul", 96): "B"}
