"""The MoE layer: routing and renormalisation, our sparse blocks against transformers' own
(Mixtral, Qwen2-MoE with its shared expert), the tensor- and expert-parallel shards summing to
the whole, both checkpoint layouts of the experts, and the errors a user can hit."""
from __future__ import annotations

import pytest
import torch

from tests.models.test_moe_parity import make_tiny_moe
from tllm.distributed import comm
from tllm.distributed.mapping import Mapping
from tllm.layers.moe import W2, W13, FusedMoE, SparseMoeBlock, select_experts

E, H, I, TOP_K = 4, 32, 24, 2


@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts(renormalize):
    logits = torch.randn(7, E, dtype=torch.bfloat16)
    weights, ids = select_experts(logits, TOP_K, renormalize)
    probs = logits.float().softmax(-1)
    assert weights.dtype == torch.float32 and ids.shape == (7, TOP_K)
    assert torch.equal(ids, probs.topk(TOP_K, dim=-1).indices)
    expected = probs.gather(1, ids)
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
        assert torch.allclose(weights.sum(-1), torch.ones(7))
    assert torch.allclose(weights, expected)


def _hf_block(arch: str):
    import transformers
    torch.manual_seed(0)
    if arch == "Mixtral":
        config = transformers.MixtralConfig(hidden_size=H, intermediate_size=I,
                                            num_local_experts=E, num_experts_per_tok=TOP_K)
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    else:
        config = transformers.Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I,
                                             num_experts=E, num_experts_per_tok=TOP_K,
                                             shared_expert_intermediate_size=40,
                                             norm_topk_prob=False)
        block = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(config)
    for param in block.parameters():
        param.data.normal_(0, 0.2)
    return config, block.eval()


def _our_block(arch: str, config):
    if arch == "Mixtral":
        return SparseMoeBlock(H, E, TOP_K, I, renormalize=True)
    from tllm.models.qwen2_moe import Qwen2MoeSparseBlock
    return Qwen2MoeSparseBlock(config, None, "mlp")


def _load_hf_block(ours, hf_block) -> None:
    """Our block from the HF module's tensors (the stacked expert layout)."""
    for name, tensor in hf_block.state_dict().items():
        if name == "experts.gate_up_proj":
            ours.experts.load_stacked(W13, tensor)
        elif name == "experts.down_proj":
            ours.experts.load_stacked(W2, tensor)
        elif name.startswith("shared_expert."):
            proj = name.split(".")[1]
            merged = ours.shared_expert.gate_up_proj
            if proj == "down_proj":
                ours.shared_expert.down_proj.load_weight("weight", tensor)
            else:
                merged.load_shard("weight", ("gate_proj", "up_proj").index(proj), tensor)
        else:
            ours.get_submodule(name.rpartition(".")[0]).load_weight("weight", tensor)


@pytest.mark.parametrize("arch", ["Mixtral", "Qwen2Moe"])
def test_sparse_block_matches_transformers(arch):
    config, hf_block = _hf_block(arch)
    ours = _our_block(arch, config)
    _load_hf_block(ours, hf_block)
    x = torch.randn(9, H)
    with torch.no_grad():
        expected = hf_block(x[None])[0]
        got = ours(x)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4)


def _expert_tensors(seed: int = 0) -> dict:
    """Per-expert checkpoint tensors: (param, expert, shard) -> full tensor."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(E):
        out[W13, e, 0] = torch.randn(I, H, generator=g)
        out[W13, e, 1] = torch.randn(I, H, generator=g)
        out[W2, e, None] = torch.randn(H, I, generator=g)
    return out


def _build_experts(monkeypatch, mapping: Mapping) -> FusedMoE:
    monkeypatch.setattr(comm, "mapping", lambda: mapping)
    experts = FusedMoE(E, H, I)
    loaded = set()
    for (param, e, shard), tensor in _expert_tensors().items():
        loaded |= experts.load_expert(param, e, shard, tensor)
    assert loaded == experts.expected_keys()
    return experts


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_rank_shards_sum_to_the_whole(monkeypatch, expert_parallel):
    """Two ranks' partial outputs (before the all-reduce) add up to one rank's output."""
    whole = _build_experts(monkeypatch, Mapping())
    x = torch.randn(11, H)
    weights, ids = select_experts(torch.randn(11, E), TOP_K, True)
    expected = whole(x, weights, ids)
    parts = []
    for rank in range(2):
        shard = _build_experts(monkeypatch, Mapping(2, 2, 1, rank, expert_parallel))
        if expert_parallel:  # whole experts, half of them each
            assert shard.w13_weight.shape == (E // 2, 2 * I, H)
            assert shard.expert_start == rank * E // 2
            assert torch.equal(shard.w2_weight, whole.w2_weight[shard.expert_start:][:E // 2])
        else:  # every expert, half its intermediate features
            assert shard.w13_weight.shape == (E, I, H) and shard.w2_weight.shape == (E, H, I // 2)
        parts.append(shard(x, weights, ids))  # no process group: the all-reduce is identity
    assert torch.allclose(parts[0] + parts[1], expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(parts[0], expected, atol=1e-3)


def test_stacked_layout_loads_the_same(monkeypatch):
    per_expert = _build_experts(monkeypatch, Mapping(2, 2, 1, 1))
    tensors = _expert_tensors()
    gate_up = torch.stack([torch.cat([tensors[W13, e, 0], tensors[W13, e, 1]]) for e in range(E)])
    down = torch.stack([tensors[W2, e, None] for e in range(E)])
    stacked = FusedMoE(E, H, I)
    assert stacked.load_stacked(W13, gate_up) | stacked.load_stacked(W2, down) == \
        stacked.expected_keys()
    assert torch.equal(stacked.w13_weight, per_expert.w13_weight)
    assert torch.equal(stacked.w2_weight, per_expert.w2_weight)


@pytest.mark.parametrize("arch", ["Mixtral", "Qwen2Moe"])
def test_model_loads_both_checkpoint_layouts(arch, tmp_path):
    """What save_pretrained writes (one tensor per expert, Mixtral's w1/w2/w3) and the
    stacked tensors of transformers 5's modules give the same parameters."""
    from tllm import loader
    from tllm.attention import get_attention_backend
    from tllm.loader import hf as hf_files
    hf_model = make_tiny_moe(arch, tmp_path)
    names = list(hf_files.iter_safetensors(hf_files.safetensors_files(tmp_path)))
    stacked = hf_model.state_dict()
    assert any(".experts.0." in n for n, _ in names) and not any(
        ".experts.0." in n for n in stacked)
    models = []
    for weights in (names, stacked.items()):
        model = loader.build_model(hf_model.config, get_attention_backend("torch"),
                                   torch.float32, torch.device("cpu"), 64)
        assert model.expected_weights() <= model.load_weights(weights)
        models.append(dict(model.named_parameters()))
    assert models[0].keys() == models[1].keys()
    for name, param in models[0].items():
        assert torch.equal(param, models[1][name]), name


def test_missing_expert_is_reported(tmp_path):
    from tllm import loader
    from tllm.attention import get_attention_backend
    hf_model = make_tiny_moe("Mixtral", tmp_path)
    model = loader.build_model(hf_model.config, get_attention_backend("torch"), torch.float32,
                               torch.device("cpu"), 64)
    weights = [(n, t) for n, t in hf_model.state_dict().items()
               if n != "model.layers.1.mlp.experts.down_proj"]
    missing = model.expected_weights() - model.load_weights(weights)
    assert missing == {f"layers.1.mlp.experts.w2_weight#{e}.None" for e in range(4)}


def test_bad_arguments(monkeypatch):
    from tllm.layers.quant.woq import online_config
    with pytest.raises(ValueError, match="int8_wo.*mixture-of-experts"):
        FusedMoE(E, H, I, online_config("int8_wo"))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        SparseMoeBlock(H, E, E + 1, I, renormalize=True)
    experts = FusedMoE(E, H, I)
    with pytest.raises(ValueError, match="expert 4"):
        experts.load_expert(W13, 4, 0, torch.randn(I, H))
    with pytest.raises(ValueError, match="intermediate"):
        experts.load_expert(W13, 0, 0, torch.randn(I + 1, H))
    with pytest.raises(ValueError, match="experts along dim 0"):
        experts.load_stacked(W2, torch.randn(E - 1, H, I))
    monkeypatch.setattr(comm, "mapping", lambda: Mapping(3, 3, 1, 0, True))
    with pytest.raises(ValueError, match="tensor_parallel_size .3. must divide .* 4 experts"):
        FusedMoE(E, H, I)


def test_mapping_places_experts_on_the_tp_ranks():
    sliced, whole = Mapping(4, 2, 2, 3), Mapping(4, 2, 2, 3, enable_expert_parallel=True)
    assert (sliced.moe_tp_size, sliced.moe_tp_rank, sliced.moe_ep_size) == (2, 1, 1)
    assert (whole.moe_tp_size, whole.moe_ep_size, whole.moe_ep_rank) == (1, 2, 1)
    assert whole.with_rank(0).enable_expert_parallel


@pytest.mark.parametrize("preset,billions,w13", [
    ("mixtral-8x7b", 46.70, (8, 2 * 14336, 4096)),
    ("qwen3-30b-a3b", 30.53, (128, 2 * 768, 2048))])
def test_dummy_presets_have_the_real_shapes(preset, billions, w13):
    """Built on the meta device: the parameter count of the published checkpoints."""
    from tllm import loader
    from tllm.attention import get_attention_backend
    from tllm.loader.dummy import dummy_config
    model = loader.build_model(dummy_config(preset), get_attention_backend("torch"),
                               torch.bfloat16, torch.device("meta"), 4096)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)
    assert tuple(model.layers[0].mlp.experts.w13_weight.shape) == w13
