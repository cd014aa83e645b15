"""The kernels FLUX and Wan run on a GPU, on the CPU under the Triton interpreter: the tiny
Wan transformer with its norms, modulations, fused residuals and QK-norm + RoPE in the
kernels gives diffusers' output (fp32); FLUX's single-stream blocks feed the MMDiT QK-norm +
RoPE kernel a strided slice of their fused projection."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402


@pytest.mark.parametrize("cross_attn_norm", [True, False])
def test_transformer_on_the_kernels_equals_diffusers(device, monkeypatch, cross_attn_norm):
    from tests.visual_gen.tiny_wan import tiny_transformer
    from tllm.visual_gen.models.wan import transformer as wan

    monkeypatch.setattr(wan, "uses_triton", lambda x: True)
    torch.manual_seed(0)
    theirs = tiny_transformer(4, cross_attn_norm=cross_attn_norm).to(device)
    ours = wan.WanTransformer(wan.WanConfig.from_dict(theirs.config)).to(device)
    ours.load_diffusers_state_dict(theirs.state_dict())
    hidden = torch.randn(2, 4, 2, 4, 6, device=device)
    context = torch.randn(2, 5, 32, device=device)
    timestep = torch.tensor([900, 300], device=device)
    with torch.no_grad():
        want = theirs(hidden_states=hidden, timestep=timestep, encoder_hidden_states=context,
                      return_dict=False)[0]
        got = ours(hidden, timestep, context)
    assert relative_error(got, want) < 1e-5


def test_qk_norm_rope_reads_a_slice_of_the_fused_projection(device):
    from tllm.kernels.triton.mmdit import qk_norm_rope, qk_norm_rope_ref
    batch, tokens, heads, head_dim = 2, 5, 2, 8
    dim = heads * head_dim
    fused = torch.randn(batch, tokens, 7 * dim, device=device)    # q, k, v, then the MLP's
    qkv = fused[..., :3 * dim]
    weights = [torch.rand(head_dim, device=device) + 0.5 for _ in range(2)]
    angles = torch.rand(tokens, head_dim // 2, device=device) * 6
    out = [torch.empty(batch, tokens, heads, head_dim, device=device) for _ in range(3)]
    qk_norm_rope(qkv, *weights, angles.cos(), angles.sin(), 1e-6, out, 0)
    want = qk_norm_rope_ref(qkv, *weights, angles.cos(), angles.sin(), 1e-6, heads)
    for got, expected in zip(out, want):
        assert relative_error(got, expected) < 1e-5
