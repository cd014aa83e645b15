"""LTX-2 step caching (visual_gen/step_cache.py) with the transformer's norms, modulations and
QK-norm + RoPE in the Triton kernels (interpreted on the CPU): a full step, a cached one (the
output layer takes the residual with gate 1) and the last step give the torch path's outputs."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402


@pytest.mark.parametrize("mode", ["teacache", "first_block"])
def test_cached_steps_on_the_kernels_equal_torch(device, monkeypatch, mode):
    from tests.visual_gen.tiny_ltx2 import TEXT_DIM, tiny_transformer
    from tllm.visual_gen.models.ltx2 import blocks
    from tllm.visual_gen.models.ltx2.config import LTX2Config
    from tllm.visual_gen.models.ltx2.rope import LTX2Rope, audio_positions, video_positions
    from tllm.visual_gen.models.ltx2.transformer import LTX2Inputs, LTX2Transformer
    from tllm.visual_gen.step_cache import StepCache

    torch.manual_seed(0)
    theirs = tiny_transformer()
    model = LTX2Transformer(LTX2Config.from_dict(theirs.config))
    model.load_diffusers_state_dict(theirs.state_dict())
    model = model.to(device)
    config = model.config
    rope = LTX2Rope.build(config, video_positions(2, 2, 3, config, 24.0, device),
                          audio_positions(5, config, device))
    video, audio = torch.randn(2, 12, 4, device=device), torch.randn(2, 5, 4, device=device)
    text = torch.randn(2, 2, 4, TEXT_DIM, device=device)
    outputs = {}
    for on_kernels in (True, False):
        monkeypatch.setattr(blocks, "uses_triton", lambda x, on=on_kernels: on)
        cache = StepCache(mode, 1e9)        # skips every step it may: the middle one
        context = model.encode_text(text[0], text[1], None)
        runs = []
        with torch.no_grad():
            for index, t in enumerate((900.0, 800.0, 700.0)):
                cache.step_index, cache.num_steps = index, 3
                runs.append(model(LTX2Inputs(video + index, audio - index,
                                             torch.full((2,), t, device=device), context, rope,
                                             clean_tokens=6, step_cache=cache)))
        assert cache.skipped == 1
        outputs[on_kernels] = runs
    for got, want in zip(outputs[True], outputs[False]):
        for g, w in zip(got, want):
            assert relative_error(g, w) < 1e-5
