"""EAGLE-3 heads in the public checkpoint layout (fc, midlayer.* or layers.0.*, norm,
lm_head over draft_vocab_size, d2t / t2d): the head's forward through the paged cache equals
a reference written here from the layout's definition; names load; d2t maps draft ids to
target ids; the drafter proposes the reference's chain; the engine's greedy output is the
same with and without it."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tests.speculative.test_draft_model import make_request, target_parts
from tllm.config import EagleDecodingConfig
from tllm.loader.hf import CheckpointError
from tllm.models.eagle3 import captured_target_layers
from tllm.speculative.eagle3 import Eagle3Drafter, build_drafter, load_head
from tllm.speculative.interface import VerifyResult

H, HEADS, KV_HEADS, HD, INTER, VOCAB, DRAFT_VOCAB = 64, 4, 2, 16, 128, 384, 96


def head_config(**extra) -> dict:
    return {**dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=H,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=INTER,
                num_hidden_layers=1, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB,
                target_hidden_size=H, max_position_embeddings=256, rms_norm_eps=1e-5,
                rope_theta=10000.0, tie_word_embeddings=False,
                eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}), **extra}


def head_tensors(prefix: str = "midlayer", seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    t = {"fc.weight": rand(H, 3 * H), "norm.weight": 1 + rand(H),
         "lm_head.weight": rand(DRAFT_VOCAB, H)}
    layer = {"input_layernorm.weight": 1 + rand(H), "hidden_norm.weight": 1 + rand(H),
             "post_attention_layernorm.weight": 1 + rand(H),
             "self_attn.q_proj.weight": rand(HEADS * HD, 2 * H),
             "self_attn.k_proj.weight": rand(KV_HEADS * HD, 2 * H),
             "self_attn.v_proj.weight": rand(KV_HEADS * HD, 2 * H),
             "self_attn.o_proj.weight": rand(H, HEADS * HD),
             "mlp.gate_proj.weight": rand(INTER, H), "mlp.up_proj.weight": rand(INTER, H),
             "mlp.down_proj.weight": rand(H, INTER)}
    t.update({f"{prefix}.{k}": v for k, v in layer.items()})
    targets = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    t["d2t"] = targets - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[targets] = True
    t["t2d"] = t2d
    return t


def save_head(path, tensors, **config) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(head_config(**config)))
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, positions):
    inv = 1.0 / (10000.0 ** (torch.arange(0, HD, 2).float() / HD))
    freqs = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    x1, x2 = x[..., :HD // 2], x[..., HD // 2:]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def reference(t, embedding, tokens, fused, prefix="midlayer"):
    """The layout's definition, one sequence of T positions: token i is the token after
    position i, fused[i] the (fused) hidden state of position i. -> (target-vocab logits
    [T, VOCAB], pre-norm hidden [T, H])."""
    w = {k.removeprefix(prefix + "."): v for k, v in t.items()}
    T = len(tokens)
    x = torch.cat([rms(embedding[tokens], w["input_layernorm.weight"]),
                   rms(fused, w["hidden_norm.weight"])], -1)
    pos = torch.arange(T)
    q = rope((x @ w["self_attn.q_proj.weight"].T).view(T, HEADS, HD), pos)
    k = rope((x @ w["self_attn.k_proj.weight"].T).view(T, KV_HEADS, HD), pos)
    v = (x @ w["self_attn.v_proj.weight"].T).view(T, KV_HEADS, HD)
    attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                          v.transpose(0, 1), is_causal=True, enable_gqa=True)
    h = attn.transpose(0, 1).reshape(T, -1) @ w["self_attn.o_proj.weight"].T + fused
    m = rms(h, w["post_attention_layernorm.weight"])
    h = h + (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) \
        @ w["mlp.down_proj.weight"].T
    draft_logits = rms(h, t["norm.weight"]) @ t["lm_head.weight"].T
    logits = torch.full((T, VOCAB), float("-inf"))
    logits[:, torch.arange(DRAFT_VOCAB) + t["d2t"]] = draft_logits
    return logits, h


def fused_of(t, target_hidden):
    return target_hidden @ t["fc.weight"].T


@pytest.fixture
def parts(tiny_llama):
    return target_parts(tiny_llama[0])


@pytest.mark.parametrize("prefix", ["midlayer", "layers.0"])
def test_head_forward_through_the_paged_cache_equals_the_layout(parts, tmp_path, prefix):
    t = head_tensors(prefix)
    head = load_head(save_head(tmp_path / "head", t), parts)
    assert head.embed_tokens is parts.model.embed_tokens  # the target's, shared
    drafter = build_drafter(EagleDecodingConfig(speculative_model=str(tmp_path / "head")),
                            parts)
    g = torch.Generator().manual_seed(1)
    T = 7
    tokens = torch.randint(3, VOCAB, (T,), generator=g)
    target_hidden = torch.randn(T, 3 * H, generator=g)
    ref_logits, ref_pre = reference(t, parts.model.embed_tokens.weight, tokens,
                                    fused_of(t, target_hidden), prefix)
    seq = drafter.cache.sequence(make_request(0, tokens.tolist() + [5]))
    assert drafter.cache.reserve(seq, T)
    out = []
    for start, end in ((0, 5), (5, 7)):  # two chunks over the cache
        md = drafter.cache.metadata([seq], [start], [end])
        normed, pre = head(tokens[start:end], head.fuse(target_hidden[start:end]),
                           drafter.kv_cache.kv_caches, md)
        seq.num_computed_tokens = end
        out.append((drafter.target_logits(head.compute_logits(normed)), pre))
    logits, pre = torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])
    finite = torch.isfinite(ref_logits)
    assert torch.equal(finite, torch.isfinite(logits))
    assert torch.allclose(logits[finite], ref_logits[finite], atol=1e-4)
    assert torch.allclose(pre, ref_pre, atol=1e-4)
    drafter.free(seq.request)
    assert drafter.kv_cache.num_free_blocks == drafter.kv_cache.num_blocks


def test_d2t_maps_draft_ids_to_target_ids(parts, tmp_path):
    t = head_tensors()
    head = load_head(save_head(tmp_path / "head", t), parts)
    targets = torch.nonzero(t["t2d"]).flatten()
    assert torch.equal(head.to_target_ids(torch.arange(DRAFT_VOCAB)), targets)


def test_missing_or_misshapen_head_weights_are_refused(parts, tmp_path):
    t = head_tensors()
    del t["fc.weight"]
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_head(save_head(tmp_path / "a", t), parts)
    with pytest.raises(ValueError, match="vocabulary"):
        load_head(save_head(tmp_path / "b", head_tensors(), vocab_size=500), parts)


def test_captured_layers_follow_the_config_conventions():
    cfg = SimpleNamespace(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 16, 29]})
    assert captured_target_layers(cfg, 32) == (1, 15, 28)   # vLLM ids: the stream entering
    assert captured_target_layers(SimpleNamespace(), 32) == (1, 15, 28)  # EAGLE-3's default
    assert captured_target_layers(cfg, 32, (3, 4, 5)) == (3, 4, 5)
    with pytest.raises(ValueError, match="eagle3_layers_to_capture"):
        captured_target_layers(SimpleNamespace(), 32, (1, 2, 40))


def test_drafter_proposes_the_reference_chain(parts, tmp_path):
    t = head_tensors()
    drafter = build_drafter(EagleDecodingConfig(speculative_model=save_head(
        tmp_path / "head", t), max_draft_len=3), parts)
    assert drafter.hidden_state_layers == (0, 0, 1)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, VOCAB, (6,), generator=g).tolist()
    request = make_request(0, prompt)
    hidden = torch.randn(6, 3 * H, generator=g)  # the target's states of positions 0..5
    request.append_token(7)  # the target's first token
    drafter.on_verified(VerifyResult([request], [0], [6], [0], [[7]], [0], hidden))
    drafts = drafter.propose([request], [3]).token_ids[0]
    emb = parts.model.embed_tokens.weight
    tokens, fused = request.token_ids[1:], fused_of(t, hidden)
    expected = []
    for _ in range(3):  # EAGLE's chain: feed the draft with the last pre-norm state
        logits, pre = reference(t, emb, torch.tensor(tokens), fused)
        expected.append(int(logits[-1].argmax()))
        tokens, fused = tokens + [expected[-1]], torch.cat([fused, pre[-1:]])
    assert drafts == expected
    drafter.free(request)
    assert drafter.kv_cache.num_free_blocks == drafter.kv_cache.num_blocks


@pytest.mark.parametrize("num_layers, layer_ids", [(4, [1, 2, 3]), (2, [1, 1, 2])])
def test_engine_greedy_identical_with_an_eagle3_head(tmp_path, num_layers, layer_ids):
    import transformers
    from tests.conftest import TINY
    from tests.speculative.test_draft_model import engine_greedy, prompts
    torch.manual_seed(0)
    target = tmp_path / "target"  # two layers: a captured layer named twice
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**TINY, "num_hidden_layers": num_layers}, architectures=["LlamaForCausalLM"])
    ).save_pretrained(target)
    head = save_head(tmp_path / "head", head_tensors(),
                     eagle_config={"eagle_aux_hidden_state_layer_ids": layer_ids})
    plain, _ = engine_greedy(target, None, prompts())
    spec, stats = engine_greedy(target, EagleDecodingConfig(speculative_model=head,
                                                            max_draft_len=3), prompts())
    assert spec == plain and stats["spec_draft_tokens"] > 0
