"""The Mamba-2 mixer against transformers' NemotronH mixer (its torch path) on tiny random
weights in fp32: a whole prompt, the same prompt prefilled in chunks carrying the state, then
decode steps, for two requests in one flattened batch whose slots hold stale state.
tests/kernels/test_mamba_ssd.py runs the same check through the Triton kernels."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.nemotron_h import modeling_nemotron_h as hf  # noqa: E402

from tllm.layers.mamba2 import Mamba2Dims, Mamba2Mixer, MambaBatch, MambaLayerState  # noqa: E402


def _hf_mixer():
    config = transformers.NemotronHConfig(
        hidden_size=32, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
        conv_kernel=4, chunk_size=4, layer_norm_epsilon=1e-5, layers_block_type=["mamba"],
        vocab_size=64)
    torch.manual_seed(0)
    mixer = hf.NemotronHMamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        mixer.A_log.copy_(torch.rand(4).log())
        mixer.dt_bias.copy_(torch.randn(4) * 0.5)
    return config, mixer


def _ours(config, hf_mixer, use_triton: bool, device):
    dims = Mamba2Dims(hidden_size=config.hidden_size, num_heads=config.mamba_num_heads,
                      head_dim=config.mamba_head_dim, num_groups=config.n_groups,
                      state_size=config.ssm_state_size, conv_kernel=config.conv_kernel,
                      chunk_size=config.chunk_size, eps=config.layer_norm_epsilon)
    mixer = Mamba2Mixer(dims)
    mixer.load_state_dict(hf_mixer.state_dict())
    mixer.use_triton = use_triton
    state = MambaLayerState.empty(dims, 3, torch.float32, device)
    state.conv.normal_()       # what earlier requests left: a new one must not read it
    state.ssm.normal_()
    return mixer.to(device), state


@torch.no_grad()
def check_against_hf(use_triton: bool, device) -> None:
    config, hf_mixer = _hf_mixer()
    mixer, state = _ours(config, hf_mixer, use_triton, device)
    hf_mixer.to(device)
    lens, num_decode = [11, 6], 3
    seqs = [torch.randn(n + num_decode, config.hidden_size, device=device) for n in lens]
    want = [hf_mixer(s[None])[0] for s in seqs]        # the whole sequence at once
    slots = [2, 0]
    # prompt chunks of different sizes per request (one of them a single token)
    chunks = [[(0, 5), (5, 6), (6, 11)], [(0, 6)]]
    for step in range(3):
        parts, seq_lens, step_slots, starts, wanted = [], [], [], [], []
        for i, plan in enumerate(chunks):
            if step < len(plan):
                a, b = plan[step]
                parts.append(seqs[i][a:b])
                seq_lens.append(b - a)
                step_slots.append(slots[i])
                starts.append(a)
                wanted.append(want[i][a:b])
        got = mixer(torch.cat(parts), MambaBatch(seq_lens, step_slots, starts), state)
        torch.testing.assert_close(got, torch.cat(wanted), atol=1e-5, rtol=1e-4)
    for k in range(num_decode):
        rows = [lens[0] + k, lens[1] + k]
        x = torch.stack([seqs[0][rows[0]], seqs[1][rows[1]]])
        got = mixer(x, MambaBatch([1, 1], slots, rows), state)
        torch.testing.assert_close(got, torch.stack([want[0][rows[0]], want[1][rows[1]]]),
                                   atol=1e-5, rtol=1e-4)


def test_chunked_prefill_then_decode_matches_hf():
    check_against_hf(use_triton=False, device=torch.device("cpu"))


@pytest.mark.parametrize("use_triton", [False, True])
def test_decode_slots_as_a_graph_runs_them(use_triton, check_decode_slots):
    """Decode with device slots and padding rows on a scratch slot (what a CUDA graph
    replays) equals the per-request decode; the Triton kernels under the interpreter."""
    pytest.importorskip("triton")
    config, hf_mixer = _hf_mixer()
    from tests.layers.conftest import triton_device
    device = triton_device(use_triton)
    mixer, _ = _ours(config, hf_mixer, use_triton, device)
    state = MambaLayerState.empty(mixer.dims, 4, torch.float32, device)
    check_decode_slots(mixer, state, config.hidden_size, use_triton)
