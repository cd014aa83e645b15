"""LTX-2's elementwise kernels (RMSNorm + modulation with the gated residual, QK RMSNorm across
heads + RoPE, interleaved and split) vs their torch references, on fresh random inputs."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels.triton.ltx2_norms import (norm_rope, norm_rope_ref, rms_modulate,  # noqa: E402
                                            rms_modulate_ref)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def _table(batch, groups, k, dim, dtype, device):
    """k modulation vectors per group as views of one [B, G, k, d] tensor, as a block's
    table + timestep embedding makes them."""
    return torch.randn(batch, groups, k, dim, device=device).mul(0.5).to(dtype).unbind(2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups,split", [(1, None), (2, 4)])
@pytest.mark.parametrize("num_mods", [0, 1, 2])
@pytest.mark.parametrize("residual", [None, "gated", "plain"])
def test_rms_modulate(device, dtype, groups, split, num_mods, residual):
    batch, n_tokens, dim = 2, 9, 80
    x = torch.randn(batch, n_tokens, dim, device=device).mul(3).add(1).to(dtype)
    params = _table(batch, groups, 5, dim, dtype, device)
    mods = [(params[0], params[1]), (params[2], params[3])][:num_mods]
    res = None
    if residual:     # y as a strided view, as an attention output slice is
        y = torch.randn(batch, n_tokens + 3, dim, device=device).to(dtype)[:, 3:]
        res = (y, params[4] if residual == "gated" else None)
    got = rms_modulate(x, mods, 1e-6, split, res)
    want = rms_modulate_ref(x.float(), [(s.float(), c.float()) for s, c in mods], 1e-6, split,
                            None if res is None else (res[0].float(), None if res[1] is None
                                                      else res[1].float()))
    if res is not None:
        assert relative_error(got[0], want[0]) < TOL[dtype]
        got, want = got[1], want[1]
    assert len(got) == max(1, num_mods)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == x.shape
        assert relative_error(g, w) < TOL[dtype]


def test_rms_modulate_one_group_broadcast_with_two(device):
    """A one-group gate expanded to two groups (stride 0) reads the same row for all tokens."""
    x = torch.randn(1, 6, 32, device=device)
    shift, scale, gate = _table(1, 2, 3, 32, torch.float32, device)
    one_gate = gate[:, :1].expand(-1, 2, -1)
    y = torch.randn(1, 6, 32, device=device)
    got = rms_modulate(x, [(shift, scale)], 1e-6, 2, (y, one_gate))
    want = rms_modulate_ref(x, [(shift, scale)], 1e-6, 2, (y, gate[:, :1]))
    assert relative_error(got[1][0], want[1][0]) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["none", "interleaved", "split"])
@pytest.mark.parametrize("width,chunks", [(64, 2), (96, 4), (40, 2)])
def test_norm_rope(device, dtype, mode, width, chunks):
    batch, n_tokens = 3, 7
    qkv = torch.randn(batch, n_tokens, 3 * width, device=device).mul(2).to(dtype)
    x = qkv[..., width:2 * width]          # the k slice of a fused projection
    weight = (1 + torch.randn(width, device=device) * 0.3).to(dtype)
    cos = sin = None
    if mode != "none":
        angles = torch.randn(n_tokens, width // 2, device=device) * 4
        cos, sin = angles.cos(), angles.sin()
    split = chunks if mode == "split" else None
    got = norm_rope(x, weight, 1e-6, cos, sin, split)
    want = norm_rope_ref(x.float(), weight.float(), 1e-6, cos, sin, split)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    assert relative_error(got, want) < TOL[dtype]


def test_transformer_on_the_kernels_equals_diffusers(device, monkeypatch):
    """The tiny LTX-2 transformer with every norm, modulation and QK-norm + RoPE in the
    kernels (interpreted on the CPU) gives diffusers' output (fp32)."""
    from tests.visual_gen.tiny_ltx2 import TEXT_DIM, tiny_transformer
    from tllm.visual_gen.models.ltx2 import blocks
    from tllm.visual_gen.models.ltx2.config import LTX2Config
    from tllm.visual_gen.models.ltx2.diffusers_transformer import DiffusersLTX2
    from tllm.visual_gen.models.ltx2.rope import LTX2Rope, audio_positions, video_positions
    from tllm.visual_gen.models.ltx2.transformer import LTX2Inputs, LTX2Transformer

    monkeypatch.setattr(blocks, "uses_triton", lambda x: True)
    torch.manual_seed(0)
    theirs = tiny_transformer().to(device)
    ours = LTX2Transformer(LTX2Config.from_dict(theirs.config)).to(device)
    ours.load_diffusers_state_dict(theirs.state_dict())
    config = ours.config
    rope = LTX2Rope.build(config, video_positions(2, 2, 3, config, 24.0, device),
                          audio_positions(5, config, device))
    video, audio = torch.randn(2, 12, 4, device=device), torch.randn(2, 5, 4, device=device)
    text = torch.randn(2, 2, 4, TEXT_DIM, device=device)
    timestep = torch.full((2,), 640.0, device=device)
    outputs = []
    with torch.no_grad():
        for model in (ours, DiffusersLTX2(theirs)):
            context = model.encode_text(text[0], text[1], None)
            outputs.append(model(LTX2Inputs(video, audio, timestep, context, rope,
                                            clean_tokens=6, cross_rows=torch.tensor([1.0, 0.0]))))
    for got, want in zip(*outputs):
        assert relative_error(got, want) < 1e-5
