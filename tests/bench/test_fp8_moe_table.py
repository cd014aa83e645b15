"""benchmarks/fp8_moe_table.py: the FP8 expert sweep's verdicts become a table that pastes
into tllm/kernels/triton/fp8_moe_configs.py (the sweep itself runs on a GPU)."""
import importlib.util
import math
from pathlib import Path

import pytest

from tllm.kernels.triton.fused_moe import GemmTile, MoeConfig

_PATH = Path(__file__).parents[2] / "benchmarks" / "fp8_moe_table.py"
_SPEC = importlib.util.spec_from_file_location("fp8_moe_table", _PATH)
table = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(table)


def sweep(fast_bm: int, fast_tile: str) -> dict:
    """Two block_m timed; `fast_tile` at `fast_bm` wins both GEMMs."""
    slow = {"n64 k128 w4 s4": 50.0, "n32 k128 w4 s4": 60.0}
    return {bm: {gemm: {**slow, **({fast_tile: 10.0} if bm == fast_bm else {})}
                 for gemm in ("gate_up", "down")} for bm in (16, 32)}


def test_best_config_and_pasted_table():
    results = {"meta": {"device": "H100", "date": "2026-12-06T18:00"},
               "models": {"a": {"shape": {"top_k": 2, "experts": 8},
                                "sweep": {1: {"channel": sweep(16, "n32 k256 w4 s4")},
                                          512: {"channel": sweep(32, "n64 k128 w8 s3"),
                                                "block": sweep(32, "n64 k128 w8 s3")}}}}}
    assert table.best_config(results["models"]["a"]["sweep"][512]["channel"]) == {
        "block_m": 32, "gate_up": "n64 k128 w8 s3", "down": "n64 k128 w8 s3", "us": 20.0}
    scope = {"MoeConfig": MoeConfig, "GemmTile": GemmTile}
    exec(table.python_table(results), scope)
    channel = scope["FP8_CONFIGS"]["channel"]
    assert channel[0][0] == pytest.approx(math.sqrt(0.25 * 128), rel=1e-2)
    assert channel[0][1] == MoeConfig(16, GemmTile(32, 256, 4, 4), GemmTile(32, 256, 4, 4), 1)
    assert channel[1][0] == math.inf and channel[1][1].block_m == 32
    assert len(scope["FP8_CONFIGS"]["block"]) == 1


def test_tiles_clamped_to_the_scale_block_and_capped():
    tiles = table.tiles_to_time(128, "gate_up", [(64, 256, 8, 3)], 128)
    assert len(tiles) <= table.MAX_TILES and tiles[0] == (64, 128, 8, 3)
    assert all(bk <= 128 for _, bk, _, _ in tiles) and len(set(tiles)) == len(tiles)
    assert table.candidate_block_ms(128) == [64, 128]
    assert table.candidate_block_ms(0.25) == [16]


def test_merged_config_minimises_the_summed_slowdown():
    a = {32: {"gate_up": {"x": 10.0, "y": 11.0}, "down": {"x": 5.0}}}
    b = {32: {"gate_up": {"x": 30.0, "y": 10.0}, "down": {"x": 5.0}}}
    assert table.merged_config([a, b])["gate_up"] == "y"


def test_apply_rewrites_the_configs_module(tmp_path):
    """--apply puts the sweep's table into fp8_moe_configs.py; the module still imports and
    looks its configurations up from the new table."""
    results = {"meta": {"device": "H100", "date": "2026-12-07T10:00"},
               "models": {"a": {"shape": {"top_k": 2, "experts": 8},
                                "sweep": {1: {"channel": sweep(16, "n32 k256 w4 s4"),
                                              "block": sweep(16, "n16 k128 w4 s4")}}}}}
    sweep_file = tmp_path / "sweep.json"
    sweep_file.write_text(__import__("json").dumps(results))
    module = Path(__file__).parents[2] / "tllm" / "kernels" / "triton" / "fp8_moe_configs.py"
    target = tmp_path / "fp8_moe_configs.py"
    target.write_text(module.read_text())
    assert table.main([str(sweep_file), "--apply", str(target)]) == 0
    spec = importlib.util.spec_from_file_location("applied_configs", target)
    applied = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(applied)
    assert applied.fp8_moe_config(1, 2, 8).gate_up == GemmTile(32, 256, 4, 4)
    assert applied.fp8_moe_config(4096, 2, 8, "block").gate_up == GemmTile(16, 128, 4, 4)
    assert "on H100, 2026-12-07" in target.read_text()


def test_apply_keeps_the_file_when_a_scheme_has_no_rows(tmp_path):
    results = {"meta": {}, "models": {"a": {"shape": {"top_k": 2, "experts": 8},
                                            "sweep": {1: {"channel": sweep(16, "n32 k256 w4 s4")}}}}}
    sweep_file = tmp_path / "sweep.json"
    sweep_file.write_text(__import__("json").dumps(results))
    target = tmp_path / "configs.py"
    target.write_text("before\n")
    assert table.main([str(sweep_file), "--apply", str(target)]) == 1
    assert target.read_text() == "before\n"
