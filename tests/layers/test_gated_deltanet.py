"""The gated DeltaNet layer against transformers' Qwen3-Next layer (its torch path) on tiny
random weights in fp32: the delta rule's chunked and single-step forms against HF's and each
other from a random state; then the whole layer over a flattened batch of two requests whose
slots hold stale state: a prompt prefilled in chunks split at arbitrary points, with a
checkpoint save inside a chunk, then decode steps, equal to one pass of HF's layer."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as hf  # noqa: E402

from tllm.kernels import gated_delta_ref  # noqa: E402
from tllm.layers.gated_deltanet import (DeltaNetStateSpec, GatedDeltaNet,  # noqa: E402
                                        GatedDeltaNetDims)
from tllm.layers.mamba2 import MambaBatch  # noqa: E402

CONFIG = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
              num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=64,
              rms_norm_eps=1e-5)


def _rule_inputs(num_tokens: int, heads: int = 3, dk: int = 8, dv: int = 5):
    q, k = (gated_delta_ref.l2_normalize(torch.randn(num_tokens, heads, dk))
            for _ in range(2))
    v = torch.randn(num_tokens, heads, dv)
    g = -torch.rand(num_tokens, heads) * 0.5
    beta = torch.rand(num_tokens, heads)
    return q * dk ** -0.5, k, v, g, beta, torch.randn(heads, dk, dv)


@pytest.mark.parametrize("num_tokens,chunk", [(1, 4), (13, 4), (13, 64), (20, 5)])
def test_chunked_and_step_forms_match_hf(num_tokens, chunk):
    torch.manual_seed(num_tokens + chunk)
    q, k, v, g, beta, state = _rule_inputs(num_tokens)
    out, final = gated_delta_ref.gated_delta_chunked_ref(q, k, v, g, beta, state, chunk)
    # HF's normalises q and k itself and scales q: hand it the raw ones (already unit norm)
    scale = q.shape[-1] ** 0.5
    want, want_state = hf.torch_recurrent_gated_delta_rule(
        (q * scale)[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
        output_final_state=True)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_state[0], atol=1e-5, rtol=1e-5)
    chunked, chunked_state = hf.torch_chunk_gated_delta_rule(
        (q * scale)[None], k[None], v[None], g[None], beta[None], chunk_size=chunk,
        initial_state=state[None], output_final_state=True)
    torch.testing.assert_close(out, chunked[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, chunked_state[0], atol=1e-5, rtol=1e-5)
    stepped, rows = [], state[None].clone()   # token by token, as decode does
    for t in range(num_tokens):
        stepped.append(gated_delta_ref.gated_delta_step_ref(
            q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], rows))
    torch.testing.assert_close(torch.cat(stepped), out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rows[0], final, atol=1e-5, rtol=1e-5)


def _layers():
    config = transformers.Qwen3NextConfig(**CONFIG)
    torch.manual_seed(0)
    layer = hf.Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        layer.A_log.copy_(torch.rand(4).log())
    dims = GatedDeltaNetDims(
        hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6,
        conv_kernel=4, eps=1e-5, chunk_size=4)
    ours = GatedDeltaNet(dims)
    ours.load_state_dict(layer.state_dict())
    return layer, ours, DeltaNetStateSpec(dims, 1)


@torch.no_grad()
def test_layer_chunked_prefill_then_decode_matches_hf():
    hf_layer, layer, spec = _layers()
    state = spec.empty_layer(3, torch.float32, "cpu")
    state.saved = spec.empty_layer(2, torch.float32, "cpu")
    state.conv.normal_()       # what earlier requests left: a new one must not read it
    state.ssm.normal_()
    lens, num_decode, slots = [11, 6], 3, [2, 0]
    seqs = [torch.randn(n + num_decode, 32) for n in lens]
    want = [hf_layer(s[None])[0] for s in seqs]          # the whole sequence at once
    chunks = [[(0, 5), (5, 6), (6, 11)], [(0, 6)]]      # one chunk of a single token
    for step in range(3):
        parts, seq_lens, step_slots, starts, wanted = [], [], [], [], []
        for i, plan in enumerate(chunks):
            if step < len(plan):
                a, b = plan[step]
                parts += [seqs[i][a:b]]
                seq_lens += [b - a]
                step_slots += [slots[i]]
                starts += [a]
                wanted += [want[i][a:b]]
        save = dict(save_after=[3] + [0] * (len(parts) - 1), save_rows=[1] + [-1] * 5)
        batch = MambaBatch(seq_lens, step_slots, starts, **(save if step == 0 else {}))
        got = layer(torch.cat(parts), batch, state)
        torch.testing.assert_close(got, torch.cat(wanted), atol=1e-5, rtol=1e-5)
    _check_saved_state(hf_layer, layer, spec, seqs[0][:3], state.saved, row=1)
    for n in range(num_decode):
        rows = [lens[0] + n, lens[1] + n]
        x = torch.stack([seqs[0][rows[0]], seqs[1][rows[1]]])
        got = layer(x, MambaBatch([1, 1], slots, rows), state)
        torch.testing.assert_close(got, torch.stack([want[0][rows[0]], want[1][rows[1]]]),
                                   atol=1e-5, rtol=1e-5)


def _check_saved_state(hf_layer, layer, spec, prefix, saved, row):
    """The checkpoint saved after a prompt's first tokens is the state those tokens leave."""
    fresh = spec.empty_layer(1, torch.float32, "cpu")
    layer(prefix, MambaBatch([len(prefix)], [0], [0]), fresh)
    torch.testing.assert_close(saved.conv[row], fresh.conv[0])
    torch.testing.assert_close(saved.ssm[row], fresh.ssm[0])


def test_state_spec_sizes():
    dims = GatedDeltaNetDims(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=8,
                             head_v_dim=6, conv_kernel=4, eps=1e-6)
    spec = DeltaNetStateSpec(dims, num_layers=3)
    layer = spec.empty_layer(5, torch.bfloat16, "cpu")
    assert layer.conv.shape == (5, 2 * 16 + 24, 3) and layer.conv.dtype == torch.bfloat16
    assert layer.ssm.shape == (5, 4, 8, 6) and layer.ssm.dtype == torch.float32
    assert spec.bytes_per_request(torch.bfloat16) == 3 * (56 * 3 * 2 + 4 * 8 * 6 * 4)
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        GatedDeltaNetDims(32, 3, 4, 8, 6, 4, 1e-6)


@pytest.mark.parametrize("use_triton", [False, True])
def test_decode_slots_as_a_graph_runs_them(use_triton, check_decode_slots):
    """Decode with device slots and padding rows on a scratch slot (what a CUDA graph
    replays) equals the per-request decode; the Triton kernels under the interpreter."""
    pytest.importorskip("triton")
    from tests.layers.conftest import triton_device
    device = triton_device(use_triton)
    _, layer, spec = _layers()
    check_decode_slots(layer.to(device), spec.empty_layer(4, torch.float32, device), 32,
                       use_triton)
