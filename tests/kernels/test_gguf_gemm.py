"""GGUF kernels (tllm.kernels.triton.gguf_gemm) on random blocks of every type they take,
against the torch reference (tllm.kernels.gguf), whose values are gguf's own dequantize bit
for bit: the GEMV (with and without split-K), the fused tensor-core GEMM, the row decode, the
dispatch above the fused kernel's rows. Under the Triton interpreter on the CPU, compiled on a
GPU (and a larger 8B-like shape there)."""
import pytest
import torch

pytest.importorskip("triton")

from tests.kernels.gguf_blocks import random_blocks  # noqa: E402
from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels.gguf import (KERNEL_TYPES, dequantize_planes, gguf_mm_ref,  # noqa: E402
                               pack_planes, planes_view)
from tllm.kernels.triton.gguf_gemm import (MAX_FUSED_M, FusedMmConfig, GemvConfig,  # noqa: E402
                                           fused_mm_config, gemv_config, gguf_dequantize,
                                           gguf_fused_mm, gguf_gemv, gguf_mm)
from tllm.layers.quant.gguf import dequantize_blocks  # noqa: E402

CUDA = torch.cuda.is_available()
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def planes_of(qtype, n, k, seed, device):
    blocks = random_blocks(qtype, n, k, seed, device)
    return planes_view(pack_planes(blocks, qtype), qtype, n, k), blocks


def k_of(qtype):
    return 768 if qtype not in K_QUANTS else 512  # 24 groups: a partial K step below


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_planes_hold_ggufs_values(qtype, monkeypatch):
    """The repack loses nothing: the planes decode to gguf.quants.dequantize bit for bit
    (repacked a few rows at a time: 24 rows in chunks of 7)."""
    import tllm.kernels.gguf as layout
    monkeypatch.setattr(layout, "_CHUNK_VALUES", 7 * 512)
    planes, blocks = planes_of(qtype, 24, 512, seed=1, device="cpu")
    assert torch.equal(dequantize_planes(planes), dequantize_blocks(blocks, qtype))


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv(device, qtype, dtype):
    n, k = 40, k_of(qtype)          # 40: a partial last N tile
    planes, _ = planes_of(qtype, n, k, seed=2, device=device)
    x = torch.randn(1, k, device=device).to(dtype)
    ref = gguf_mm_ref(x, planes)
    # default, uneven split (folded; two kernels), no split
    for config in (None, GemvConfig(16, 4, 3), GemvConfig(16, 4, 3, fold=False),
                   GemvConfig(32, 8, 1)):
        out = torch.full((1, n), float("nan"), device=device, dtype=dtype)
        out[:] = gguf_gemv(x, planes, config)
        assert out.dtype == dtype
        err = relative_error(out, ref)
        assert err < TOL[dtype], (config, err)


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_fused_mm(device, qtype):
    n, k, m = 72, k_of(qtype), 9
    planes, _ = planes_of(qtype, n, k, seed=3, device=device)
    x = torch.randn(m, k, device=device)
    ref = gguf_mm_ref(x, planes)
    assert relative_error(gguf_fused_mm(x, planes), ref) < 1e-5
    out = gguf_fused_mm(x.bfloat16(), planes, FusedMmConfig(16, 32, 2, 3))  # folded split
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert relative_error(out, ref) < 1e-2


@pytest.mark.parametrize("qtype", ["Q5_1", "Q4_K", "Q6_K"])
def test_fused_mm_row_tiles(device, qtype):
    """Rows beyond one M tile (21 rows in tiles of 16), with split K folded and in two
    kernels, and the first (tile-transposing) kernel."""
    planes, _ = planes_of(qtype, 40, 512, seed=8, device=device)
    x = torch.randn(21, 512, device=device)
    for config in (FusedMmConfig(16, 32, 4, 2), FusedMmConfig(16, 32, 4, 2, fold=False),
                   FusedMmConfig(16, 32, 2, 3, tile=True)):
        out = gguf_fused_mm(x, planes, config)
        assert relative_error(out, gguf_mm_ref(x, planes)) < 1e-5, config


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_decoded_rows(device, qtype):
    """Embedding lookups: float32 rows exact; bf16 rows one rounding of them (the
    interpreter truncates where the GPU rounds to nearest: within one bf16 step)."""
    planes, _ = planes_of(qtype, 48, 256, seed=4, device=device)
    full = dequantize_planes(planes)
    assert torch.equal(gguf_dequantize(planes), full)
    ids = torch.tensor([5, 0, 47, 5, 13], device=device)
    assert torch.equal(gguf_dequantize(planes, ids), full[ids])
    rows = gguf_dequantize(planes, ids, torch.bfloat16).float()
    assert ((rows - full[ids]).abs() <= full[ids].abs() * 2 ** -7).all()
    assert gguf_dequantize(planes, ids[:0]).shape == (0, 256)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_gguf_mm_dispatch(device, qtype):
    """One row: the GEMV; a few: the fused kernel; above MAX_FUSED_M: decode + matmul."""
    planes, _ = planes_of(qtype, 32, 256, seed=5, device=device)
    for m in (1, 3, MAX_FUSED_M + 1):
        x = torch.randn(m, 256, device=device)
        assert relative_error(gguf_mm(x, planes), gguf_mm_ref(x, planes)) < 1e-5


def test_bad_inputs_are_refused(device):
    planes, _ = planes_of("Q8_0", 32, 256, seed=6, device=device)
    with pytest.raises(ValueError, match="does not multiply"):
        gguf_mm(torch.randn(2, 128, device=device), planes)
    with pytest.raises(ValueError, match="one row"):
        gguf_gemv(torch.randn(2, 256, device=device), planes)
    with pytest.raises(ValueError, match="GPU kernel"):
        pack_planes(torch.zeros(4, 1, 110, dtype=torch.uint8), "Q3_K")
    with pytest.raises(ValueError, match="take"):
        planes_view(torch.zeros(10, dtype=torch.uint8), "Q8_0", 32, 256)


def test_configs_split_narrow_layers():
    cpu = torch.device("cpu")  # counts as 8 SMs
    assert gemv_config("Q4_K", 4096, 4096, cpu).split_k == 1
    narrow = gemv_config("Q4_K", 64, 4096, cpu)
    assert narrow.block_n == 4 and narrow.block_g == 16 and narrow.split_k == 4
    assert gemv_config("Q8_0", 64, 256, cpu).block_g == 8
    assert fused_mm_config("Q4_K", 32, 64, 4096, cpu).split_k > 1
    assert fused_mm_config("Q4_K", 100, 4096, 4096, cpu) == FusedMmConfig(
        64, 64, 4, 1, num_stages=2, tile=True)


def test_tuned_entries_override_and_round_trip(tmp_path, monkeypatch):
    from tllm.kernels.triton import gguf_configs
    monkeypatch.setattr(gguf_configs, "TUNED", {})
    cpu = torch.device("cpu")
    gemv, fused = GemvConfig(4, 32, 2, 8, fold=False), FusedMmConfig(32, 128, 4, 1, tile=True)
    gguf_configs.TUNED.update({("Q6_K", 512, 1024, 1): gemv, ("Q6_K", 512, 1024, 32): fused})
    assert gemv_config("Q6_K", 512, 1024, cpu) == gemv
    assert fused_mm_config("Q6_K", 20, 512, 1024, cpu) == fused   # rows 17-32: bucket 32
    assert fused_mm_config("Q6_K", 8, 512, 1024, cpu) != fused
    path = tmp_path / "tuned.json"
    path.write_text(gguf_configs.tuned_to_json(gguf_configs.TUNED))
    table = dict(gguf_configs.TUNED)
    gguf_configs.TUNED.clear()
    assert gguf_configs.load_tuned(path) == 2 and gguf_configs.TUNED == table


def test_folded_split_leaves_its_counters_at_zero(device):
    """The last split of a tile resets its counter: a second call (a graph replay) folds
    the same way."""
    from tllm.kernels.triton import gguf_gemm
    planes, _ = planes_of("Q4_K", 24, 1024, seed=9, device=device)
    x = torch.randn(1, 1024, device=device)
    ref = gguf_mm_ref(x, planes)
    for _ in range(2):
        assert relative_error(gguf_gemv(x, planes, GemvConfig(8, 4, 4)), ref) < 1e-5
    locks = [v for (_, ptr, _), v in gguf_gemm._LOCKS.items() if ptr == planes.qs.data_ptr()]
    assert locks and all(int(v.abs().sum()) == 0 for v in locks)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("qtype", KERNEL_TYPES)
@pytest.mark.parametrize("m", [1, 32])
def test_8b_shape_on_gpu(qtype, m):
    """An 8B-sized layer (4096 x 4096), bf16 activations, the default configurations."""
    planes, _ = planes_of(qtype, 4096, 4096, seed=7, device="cuda")
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    out = gguf_mm(x, planes)
    assert relative_error(out, gguf_mm_ref(x, planes)) < 1e-2
    rows = gguf_dequantize(planes, torch.arange(0, 4096, 97, device="cuda"), torch.bfloat16)
    assert torch.equal(rows, dequantize_planes(planes)[::97].bfloat16())  # round to nearest
