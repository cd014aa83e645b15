"""Our Qwen-Image transformer against diffusers' QwenImageTransformer2DModel on tiny random
configs (fp32, CPU): same outputs, batched CFG rows equal to rows run alone, checkpoint
loading, dummy weights."""
import copy
import dataclasses
import inspect
import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.loader.hf import CheckpointError  # noqa: E402
from tllm.visual_gen.models.qwen_image.transformer import (  # noqa: E402
    QwenImageTransformer, QwenImageTransformerConfig, dummy_transformer_config,
    init_dummy_weights)

TOL = 1e-5
TINY = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=32,
            num_attention_heads=3, joint_attention_dim=24, axes_dims_rope=(8, 12, 12))
TINY_DIM = TINY["num_attention_heads"] * TINY["attention_head_dim"]
LAYERED = dict(use_layer3d_rope=True, use_additional_t_cond=True)
ZERO_COND = dict(zero_cond_t=True)


def _models(seed=0, **overrides):
    """(diffusers model with random weights, ours loaded from its state dict)."""
    torch.manual_seed(seed)
    ref = diffusers.QwenImageTransformer2DModel(**{**TINY, **overrides}).eval()
    with torch.no_grad():
        for p in ref.parameters():  # every weight random, norms included, none left at zero
            p.normal_(0.0, 0.2)
    ours = QwenImageTransformer(QwenImageTransformerConfig(**{**TINY, **overrides}))
    ours.load_diffusers_state_dict(ref.state_dict())
    return ref, ours


def _shapes(overrides, h=6, w=10):
    """One row's img_shapes as diffusers' pipelines build them for each variant."""
    if overrides.get("use_layer3d_rope"):  # two layers + the composite, then the condition
        return [(1, h, w)] * 3 + [(1, h - 2, w + 2)]
    if overrides.get("zero_cond_t"):  # the target, then an edit reference image
        return [(1, h, w), (1, w, h)]
    return [(1, h, w)]


def _inputs(overrides, txt_lens, txt_len=None, seed=1):
    """Random inputs for len(txt_lens) rows, text right-padded to txt_len."""
    gen = torch.Generator().manual_seed(seed)
    batch, txt_len = len(txt_lens), txt_len or max(txt_lens)
    shapes = _shapes(overrides)
    num_img = sum(f * h * w for f, h, w in shapes)
    mask = torch.zeros(batch, txt_len, dtype=torch.long)
    for row, n in enumerate(txt_lens):
        mask[row, :n] = 1
    kwargs = dict(hidden_states=torch.randn(batch, num_img, TINY["in_channels"], generator=gen),
                  encoder_hidden_states=torch.randn(batch, txt_len, TINY["joint_attention_dim"],
                                                    generator=gen),
                  encoder_hidden_states_mask=mask,
                  timestep=torch.rand(batch, generator=gen), img_shapes=[shapes] * batch)
    if overrides.get("use_additional_t_cond"):
        kwargs["additional_t_cond"] = torch.randint(0, 2, (batch,), generator=gen)
    return kwargs


def _run_ref(ref, kwargs):
    with torch.no_grad():
        return ref(**kwargs, return_dict=False)[0]


def _run_ours(ours, kwargs):
    with torch.no_grad():
        return ours(**kwargs)


def _row(kwargs, row, txt_len):
    """Row `row` alone, its text unpadded and with no mask."""
    out = {k: v[row:row + 1] for k, v in kwargs.items()}  # tensors and img_shapes alike
    out["encoder_hidden_states"] = out["encoder_hidden_states"][:, :txt_len]
    out["encoder_hidden_states_mask"] = None
    return out


VARIANTS = {"plain": {}, "zero_cond_t": ZERO_COND, "layered": LAYERED}


@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_diffusers_with_padded_text(variant):
    overrides = VARIANTS[variant]
    ref, ours = _models(**overrides)
    kwargs = _inputs(overrides, txt_lens=[5, 9])
    want, got = _run_ref(ref, kwargs), _run_ours(ours, kwargs)
    assert got.shape == want.shape == (2, kwargs["hidden_states"].shape[1], 16)
    assert relative_error(got, want) < TOL


def test_matches_diffusers_with_unpadded_text_and_no_mask():
    ref, ours = _models()
    kwargs = _inputs({}, txt_lens=[7, 7])
    kwargs["encoder_hidden_states_mask"] = None
    assert relative_error(_run_ours(ours, kwargs), _run_ref(ref, kwargs)) < TOL


def test_matches_diffusers_with_a_general_mask():
    """Padding that is not a suffix (left padding, a hole) takes the masked-attention path."""
    ref, ours = _models()
    kwargs = _inputs({}, txt_lens=[8, 8])
    kwargs["encoder_hidden_states_mask"][0, :3] = 0
    kwargs["encoder_hidden_states_mask"][1, 4] = 0
    assert relative_error(_run_ours(ours, kwargs), _run_ref(ref, kwargs)) < TOL


@pytest.mark.parametrize("variant", ["plain", "layered"])
def test_batched_cfg_rows_equal_rows_run_alone(variant):
    """[uncond, cond] in one forward, text padded to the longer: each row equals that row run
    alone unpadded, by us and by diffusers."""
    overrides = VARIANTS[variant]
    ref, ours = _models(**overrides)
    txt_lens = [3, 11]
    kwargs = _inputs(overrides, txt_lens)
    if "additional_t_cond" in kwargs:
        kwargs["additional_t_cond"] = torch.tensor([0, 0])
    kwargs["timestep"] = kwargs["timestep"][:1].expand(2)  # one denoising step: one timestep
    batched = _run_ours(ours, kwargs)
    for row, n in enumerate(txt_lens):
        alone = _row(kwargs, row, n)
        assert relative_error(batched[row:row + 1], _run_ours(ours, alone)) < TOL
        assert relative_error(batched[row:row + 1], _run_ref(ref, alone)) < TOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16_is_as_accurate_as_diffusers(variant):
    """In bf16 both implementations round differently; measured against diffusers in fp32 on
    the same (bf16-representable) weights and inputs, ours must be about as close."""
    overrides = VARIANTS[variant]
    ref, _ = _models(**overrides)
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    ref.load_state_dict({k: v.float() for k, v in ref16.state_dict().items()})
    ours16 = QwenImageTransformer(QwenImageTransformerConfig(**{**TINY, **overrides}))
    ours16.to(torch.bfloat16).load_diffusers_state_dict(ref16.state_dict())
    kwargs16 = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in _inputs(overrides, txt_lens=[5, 9]).items()}
    kwargs32 = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in kwargs16.items()}
    want = _run_ref(ref, kwargs32)
    theirs_error = relative_error(_run_ref(ref16, kwargs16), want)
    assert relative_error(_run_ours(ours16, kwargs16), want) < 1.5 * theirs_error + 1e-3


def test_from_pretrained_round_trip(tmp_path):
    ref, _ = _models(**LAYERED)
    ref.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = QwenImageTransformer.from_pretrained(tmp_path, dtype=torch.float32, device="cpu")
    assert loaded.config == QwenImageTransformerConfig(**{**TINY, **LAYERED})
    assert loaded.dtype == torch.float32 and not loaded.training
    kwargs = _inputs(LAYERED, txt_lens=[4, 6])
    assert relative_error(_run_ours(loaded, kwargs), _run_ref(ref, kwargs)) < TOL


def test_diffusers_state_dict_inverts_loading():
    ref, ours = _models(**LAYERED)
    want, got = ref.state_dict(), ours.diffusers_state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    fused = ours.blocks[1].img_qkv.weight
    assert got["transformer_blocks.1.attn.to_k.weight"].data_ptr() == fused[TINY_DIM:].data_ptr()


def test_load_rejects_missing_and_unexpected_weights():
    ref, ours = _models()
    state = ref.state_dict()
    with pytest.raises(CheckpointError, match="lacks"):
        ours.load_diffusers_state_dict({k: v for k, v in state.items()
                                        if not k.endswith("attn.to_k.weight")})
    with pytest.raises(CheckpointError, match="unexpected"):
        ours.load_diffusers_state_dict({**state, "transformer_blocks.0.attn.extra.weight":
                                        state["proj_out.weight"]})
    with pytest.raises(CheckpointError, match="does not fit"):  # layered-only weight
        ours.load_diffusers_state_dict({**state, "time_text_embed.addition_t_embedding.weight":
                                        torch.zeros(2, 96)})


def test_config_from_dict_ignores_unknown_keys():
    raw = json.loads(json.dumps({**TINY, **LAYERED, "_class_name": "QwenImageTransformer2DModel",
                                 "_diffusers_version": "0.36.0"}))
    config = QwenImageTransformerConfig.from_dict(raw)
    assert config.axes_dims_rope == (8, 12, 12) and config.use_layer3d_rope
    with pytest.raises(ValueError, match="axes_dims_rope"):
        QwenImageTransformerConfig(attention_head_dim=64)


def test_dummy_configs_have_the_released_shapes():
    base = dummy_transformer_config("qwen-image")
    assert (base.num_layers, base.num_attention_heads, base.attention_head_dim) == (60, 24, 128)
    assert (base.joint_attention_dim, base.in_channels, base.out_channels) == (3584, 64, 16)
    assert base.axes_dims_rope == (16, 56, 56) and base.inner_dim == 3072
    assert not (base.zero_cond_t or base.use_additional_t_cond or base.use_layer3d_rope)
    layered = dummy_transformer_config("qwen-image-layered")
    assert layered == dataclasses.replace(base, use_additional_t_cond=True,
                                          use_layer3d_rope=True)
    # the fields and defaults are diffusers' own
    params = inspect.signature(diffusers.QwenImageTransformer2DModel.__init__).parameters
    defaults = {name: p.default for name, p in params.items() if name != "self"}
    assert defaults == dataclasses.asdict(QwenImageTransformerConfig())
    with pytest.raises(ValueError, match="qwen-image"):
        dummy_transformer_config("flux")


@pytest.mark.parametrize("variant", ["plain", "layered"])
def test_init_dummy_weights_deep_bf16_stays_finite(variant):
    overrides = VARIANTS[variant]
    config = QwenImageTransformerConfig(**{**TINY, **overrides, "num_layers": 8})
    model = QwenImageTransformer(config).to(torch.bfloat16)
    init_dummy_weights(model, seed=3)
    assert torch.equal(model.blocks[0].img_q_norm, torch.ones_like(model.blocks[0].img_q_norm))
    assert model.blocks[0].img_out.weight.std() < model.blocks[0].img_qkv.weight.std() / 2
    kwargs = _inputs(overrides, txt_lens=[5, 9])
    kwargs = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
              for k, v in kwargs.items()}
    out = _run_ours(model, kwargs)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all() and out.abs().max() > 0
    again = QwenImageTransformer(config).to(torch.bfloat16)
    init_dummy_weights(again, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_rejects_bad_inputs():
    _, ours = _models()
    kwargs = _inputs({}, txt_lens=[4, 6])
    with pytest.raises(ValueError, match="cover"):
        _run_ours(ours, {**kwargs, "img_shapes": [[(1, 5, 10)]] * 2})
    with pytest.raises(ValueError, match="same for every row"):
        _run_ours(ours, {**kwargs, "img_shapes": [[(1, 6, 10)], [(1, 10, 6)]]})
    with pytest.raises(ValueError, match="guidance"):
        _run_ours(ours, {**kwargs, "guidance": torch.ones(2)})
