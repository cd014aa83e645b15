"""RoPE tables and rotations against HF's own rotary modules, for every scaling type: exact
within the original length (every token of any sequence), and beyond it for the rule the
rotary module documents (position p rotates as HF rotates the newest token of a (p + 1)-token
sequence; static scalings at every position). Partial rotary against GPT-NeoX's."""
from __future__ import annotations

import pytest
import torch

from tllm.layers.rotary import rotary_dim_of, rotary_embedding

MAX_POSITION = 160
ORIGINAL = 48  # original_max_position_embeddings of the scalings that take one
HEAD_DIM = 16
LLAMA = dict(vocab_size=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
             "beta_fast": 16, "beta_slow": 2},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL},
}


def llama_config(scaling: dict | None):
    import transformers
    return transformers.LlamaConfig(**LLAMA, rope_scaling=scaling)


def phi3_longrope_config(partial: float = 0.75, max_position_embeddings: int = 256, **extra):
    """A Phi-3 config with longrope factors (away from 1) over its partial rotary dims."""
    import transformers
    pairs = int(16 * partial) // 2
    scaling = {"rope_type": "longrope", "partial_rotary_factor": partial,
               "short_factor": [1.0 + 0.15 * i for i in range(pairs)],
               "long_factor": [1.5 + 0.9 * i for i in range(pairs)]}
    kwargs = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, rope_scaling=scaling)
    return transformers.Phi3Config(**{**kwargs, **extra},
                                   max_position_embeddings=max_position_embeddings,
                                   original_max_position_embeddings=ORIGINAL)


def hf_rotary_module(config):
    """HF's own rotary module of the config's model family."""
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    modules = {"phi3": Phi3RotaryEmbedding, "gpt_neox": GPTNeoXRotaryEmbedding}
    return modules.get(config.model_type, LlamaRotaryEmbedding)(config)


def hf_newest_token_tables(config, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position, rotary_dim]: row p is what HF's rotary module gives the last
    token of a (p + 1)-token sequence, called as in generation (one token per step, lengths
    growing, so a length-dependent module rescales for each)."""
    module, x = hf_rotary_module(config), torch.zeros(1, 1, HEAD_DIM)
    rows = [module(x, torch.tensor([[p]])) for p in range(max_position)]
    return (torch.stack([cos[0, 0] for cos, _ in rows]),
            torch.stack([sin[0, 0] for _, sin in rows]))


class PositionTableRotary(torch.nn.Module):
    """Stands in for an HF model's rotary_emb: cos/sin looked up by position in fixed tables
    (HF's model code with the per-position rule, for sequences past the original length)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        super().__init__()
        self.cos, self.sin = cos, sin

    def forward(self, x, position_ids):
        return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)


def hf_sequence_tables(config, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos, sin for every token of one `length`-token sequence computed at once."""
    cos, sin = hf_rotary_module(config)(torch.zeros(1, 1, HEAD_DIM), torch.arange(length)[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_llama_scalings_match_hf(kind):
    config = llama_config(SCALINGS[kind])
    ours = rotary_embedding(config, HEAD_DIM, MAX_POSITION)
    within = config.max_position_embeddings if kind == "dynamic" else MAX_POSITION
    # any sequence within the length where HF rescales: every token of it, exactly
    for length in (1, 17, within):
        cos, sin = hf_sequence_tables(config, length)
        assert torch.equal(ours.cos[:length], cos) and torch.equal(ours.sin[:length], sin)
    # every position as the newest token (static kinds: the same as above, to MAX_POSITION)
    cos, sin = hf_newest_token_tables(config, MAX_POSITION)
    tol = 1e-5 if kind == "dynamic" else 0.0  # HF's base per length, vectorised here: 1 ulp
    torch.testing.assert_close(ours.cos, cos, atol=tol, rtol=0)
    torch.testing.assert_close(ours.sin, sin, atol=tol, rtol=0)


def test_dynamic_beyond_max_position_raises_the_base():
    config = llama_config(SCALINGS["dynamic"])
    ours = rotary_embedding(config, HEAD_DIM, MAX_POSITION)
    default = rotary_embedding(llama_config(None), HEAD_DIM, MAX_POSITION)
    switch = config.max_position_embeddings
    assert torch.equal(ours.cos[:switch], default.cos[:switch])
    assert not torch.allclose(ours.cos[switch:], default.cos[switch:], atol=1e-3)


def test_longrope_short_within_long_beyond_the_original_length():
    config = phi3_longrope_config()
    ours = rotary_embedding(config, HEAD_DIM, MAX_POSITION)
    assert ours.rotary_dim == 12 == rotary_dim_of(config, HEAD_DIM)
    for length in (1, 30, ORIGINAL):  # the short factors, every token
        cos, sin = hf_sequence_tables(config, length)
        assert torch.equal(ours.cos[:length], cos) and torch.equal(ours.sin[:length], sin)
    cos, sin = hf_newest_token_tables(config, MAX_POSITION)
    assert torch.equal(ours.cos, cos) and torch.equal(ours.sin, sin)
    # past the switch HF takes the long factors for the whole sequence; we for new positions
    long_cos, _ = hf_sequence_tables(config, MAX_POSITION)
    assert torch.equal(ours.cos[ORIGINAL:], long_cos[ORIGINAL:])
    assert not torch.allclose(ours.cos[:ORIGINAL], long_cos[:ORIGINAL], atol=1e-3)


@pytest.mark.parametrize("pct", [0.25, 0.5])
def test_partial_rotary_matches_gpt_neox(pct):
    import transformers
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb
    config = transformers.GPTNeoXConfig(hidden_size=64, num_attention_heads=4,
                                        max_position_embeddings=MAX_POSITION, rotary_pct=pct)
    ours = rotary_embedding(config, HEAD_DIM, MAX_POSITION)
    assert ours.rotary_dim == int(HEAD_DIM * pct)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, MAX_POSITION, 4, HEAD_DIM, generator=g)
    positions = torch.arange(MAX_POSITION)
    q_ours, k_ours = ours(positions, q, k)  # [T, heads, D]; HF's [1, heads, T, D]
    cos, sin = hf_rotary_module(config)(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.equal(q_ours, q_hf[0].transpose(0, 1))
    assert torch.equal(k_ours, k_hf[0].transpose(0, 1))
    assert torch.equal(q_ours[..., ours.rotary_dim:], q[..., ours.rotary_dim:])


def test_longrope_rotation_matches_phi3_within_the_original_length():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb
    config = phi3_longrope_config(partial=0.5)
    ours = rotary_embedding(config, HEAD_DIM, MAX_POSITION)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, ORIGINAL, 4, HEAD_DIM, generator=g)
    positions = torch.arange(ORIGINAL).flip(0)  # any order: rows are gathered by position
    q_ours, k_ours = ours(positions, q, k)  # [T, heads, D]; HF's [1, heads, T, D]
    cos, sin = hf_rotary_module(config)(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.equal(q_ours, q_hf[0].transpose(0, 1))
    assert torch.equal(k_ours, k_hf[0].transpose(0, 1))


def test_bad_rope_settings_raise_value_error():
    import transformers
    config = llama_config(None)
    config.rope_parameters = {"rope_type": "no-such-rope", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope_type"):
        rotary_embedding(config, HEAD_DIM, MAX_POSITION)
    neox = transformers.GPTNeoXConfig(hidden_size=64, num_attention_heads=4, rotary_pct=0.05)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rotary_embedding(neox, HEAD_DIM, MAX_POSITION)
    phi3 = phi3_longrope_config()
    phi3.rope_parameters["short_factor"] = phi3.rope_parameters["short_factor"][:-1]
    with pytest.raises(ValueError, match="short_factor needs 6"):
        rotary_embedding(phi3, HEAD_DIM, MAX_POSITION)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_capture_gathers_its_own_tables():
    """A graph's warm-up and capture share one positions buffer: the captured rotation must
    follow the positions of each replay, not the tables kept from the warm-up (DeepSeek's
    MLA prefill went wrong under piecewise graphs that way)."""
    from tllm.layers.rotary import RotaryEmbedding
    device = torch.device("cuda")
    rotary = RotaryEmbedding(torch.rand(8) * 0.5, 1.0, 64).to(device)
    positions = torch.zeros(5, dtype=torch.long, device=device)
    q, k = torch.randn(5, 2, 16, device=device), torch.randn(5, 1, 16, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rotary(positions, q, k)            # the warm-up keeps tables for this buffer
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first = rotary(positions, q, k)    # layer 0 of the piece
        second = rotary(positions, q, k)   # a later layer, same positions
    positions.copy_(torch.randint(1, 64, (5,), device=device))
    graph.replay()
    want = rotary(positions.clone(), q, k)
    for got in (first, second):
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
