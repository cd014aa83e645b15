"""Draft-target drafting: a second tiny model (or the target cut to its first layers)
proposes exactly its own greedy continuation (HF transformers fp32 is the reference) over its
own paged KV cache, across rounds where the target keeps some drafts and rejects the rest;
sampled drafts come with their probabilities; a draft with another tokenizer is refused;
every draft KV block is free at the end."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import make_tiny_model
from tllm import loader
from tllm.attention import get_attention_backend
from tllm.kv_cache.manager import KVCacheManager
from tllm.config import DraftTargetDecodingConfig
from tllm.request import Request
from tllm.sampling_params import SamplingParams
from tllm.speculative import draft_model
from tllm.speculative.draft_model import build_drafter, layer_skip_layers


def target_parts(path, num_blocks: int = 64) -> SimpleNamespace:
    """What the engine's RankParts holds, built the way build_rank builds it."""
    source = loader.resolve_model(str(path))
    config, checkpoint = loader.load_config(source)
    model = loader.build_model(config, get_attention_backend("torch"), torch.float32,
                               torch.device("cpu"), 256)
    loader.load_weights(model, source, checkpoint, 0)
    kv = KVCacheManager(num_layers=config.num_hidden_layers, num_kv_heads=2, head_dim=16,
                        num_blocks=num_blocks, tokens_per_block=4, dtype=torch.float32,
                        device="cpu")
    return SimpleNamespace(config=config, model=model, kv_cache=kv, device=torch.device("cpu"),
                           dtype=torch.float32, max_seq_len=256, source=source)


def hf_greedy(hf, token_ids: list[int], num: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([token_ids]), max_new_tokens=num, do_sample=False,
                          min_new_tokens=num, pad_token_id=0)
    return out[0, len(token_ids):].tolist()


def make_request(i: int, prompt: list[int], temperature: float = 0.0, seed=None) -> Request:
    params = SamplingParams(max_tokens=64, temperature=temperature, seed=seed)
    return Request(f"r{i}", prompt, params, max_new_tokens=64)


def rounds_match_reference(drafter, hf, requests, k: int = 3) -> None:
    """Each round every request's draft must be the reference's greedy continuation; the
    target then 'accepts' a varying number of drafts and adds a token of its own."""
    g = torch.Generator().manual_seed(0)
    for round_ in range(4):
        drafts = drafter.propose(requests, [k] * len(requests))
        assert drafts.probs is None
        for i, (request, draft) in enumerate(zip(requests, drafts.token_ids)):
            assert draft == hf_greedy(hf, request.token_ids, k), (round_, i)
            keep = (round_ + i) % (k + 1)
            extra = int(torch.randint(3, 300, (1,), generator=g))
            for token in draft[:keep] + [extra]:
                request.append_token(token)
            request.num_computed_tokens = request.num_tokens - 1
    for request in requests:
        drafter.free(request)
    assert drafter.kv_cache.num_free_blocks == drafter.kv_cache.num_blocks


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 380, (n,), generator=g).tolist() for n in (5, 11, 2)]


def test_draft_model_proposes_its_own_greedy_continuation(tiny_llama, tmp_path):
    target_dir, _ = tiny_llama
    draft_hf = make_tiny_model("Llama", tmp_path / "draft", seed=5)
    parts = target_parts(target_dir)
    drafter = build_drafter(DraftTargetDecodingConfig(speculative_model=str(tmp_path / "draft"),
                                                      max_draft_len=3), parts)
    requests = [make_request(i, p) for i, p in enumerate(prompts())]
    rounds_match_reference(drafter, draft_hf, requests)


def test_layer_skip_draft_is_the_target_cut_to_its_first_layers(tiny_llama):
    import transformers
    target_dir, _ = tiny_llama
    parts = target_parts(target_dir)
    drafter = build_drafter(DraftTargetDecodingConfig(speculative_model="self:layers=1",
                                                      max_draft_len=3), parts)
    # the same modules as the target's (no copy), one layer and its own one-layer cache
    assert drafter.model.layers[0] is parts.model.layers[0]
    assert drafter.model.lm_head is parts.model.lm_head
    assert list(drafter.model.stage_layers) == [0]
    assert list(parts.model.stage_layers) == [0, 1]
    assert len(drafter.kv_cache.kv_caches) == 1
    cut = transformers.LlamaForCausalLM.from_pretrained(target_dir, num_hidden_layers=1).eval()
    requests = [make_request(i, p) for i, p in enumerate(prompts())]
    rounds_match_reference(drafter, cut, requests)


def test_layer_skip_option_is_checked():
    assert layer_skip_layers("self:layers=8") == 8
    assert layer_skip_layers("/some/dir") is None
    for bad in ("self:layers=0", "self:layers=x", "self:layers="):
        with pytest.raises(ValueError, match="self:layers=N"):
            layer_skip_layers(bad)


def test_layer_skip_needs_fewer_layers_than_the_target(tiny_llama):
    parts = target_parts(tiny_llama[0])
    with pytest.raises(ValueError, match="1..1"):
        build_drafter(DraftTargetDecodingConfig(speculative_model="self:layers=2"), parts)


def test_sampled_drafts_carry_their_probabilities(tiny_llama):
    target_dir, _ = tiny_llama
    parts = target_parts(target_dir)
    drafter = build_drafter(DraftTargetDecodingConfig(speculative_model="self:layers=1",
                                                      max_draft_len=4), parts)
    requests = [make_request(0, prompts()[0], temperature=0.8, seed=7),
                make_request(1, prompts()[1])]
    drafts = drafter.propose(requests, [4, 2])
    assert [len(d) for d in drafts.token_ids] == [4, 2]
    probs = drafts.probs
    assert probs.shape == (2, 4, parts.config.vocab_size)
    assert torch.allclose(probs[0].sum(-1), torch.ones(4))
    for j, token in enumerate(drafts.token_ids[0]):
        assert probs[0, j, token] > 0
    for j, token in enumerate(drafts.token_ids[1]):  # the greedy request: one-hot
        assert probs[1, j, token] == 1.0 and probs[1, j].sum() == 1.0
    for request in requests:
        drafter.free(request)
    assert drafter.kv_cache.num_free_blocks == drafter.kv_cache.num_blocks


def word_tokenizer(path, words: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                            eos_token="</s>").save_pretrained(path)


def test_draft_with_another_tokenizer_is_refused(tmp_path):
    make_tiny_model("Llama", tmp_path / "target")
    make_tiny_model("Llama", tmp_path / "draft", seed=1)
    words = ["<unk>", "</s>", "a", "b", "c"]
    word_tokenizer(tmp_path / "target", words)
    word_tokenizer(tmp_path / "draft", words[:2] + ["c", "b", "a"])
    parts = target_parts(tmp_path / "target")
    with pytest.raises(ValueError, match="tokenizer differs from the target's"):
        draft_model.load_draft_model(str(tmp_path / "draft"), parts)
    word_tokenizer(tmp_path / "draft", words)  # the same vocabulary: accepted
    draft_model.load_draft_model(str(tmp_path / "draft"), parts)


def test_draft_with_another_vocabulary_size_is_refused(tiny_llama, tmp_path):
    import transformers
    from tests.conftest import TINY
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 512},
                                      architectures=["LlamaForCausalLM"])
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "draft")
    parts = target_parts(tiny_llama[0])
    with pytest.raises(ValueError, match="vocabulary of 512 tokens, the target has 384"):
        draft_model.load_draft_model(str(tmp_path / "draft"), parts)


def engine_greedy(path, spec, prompts_: list[list[int]]):
    from tllm import LLM, KvCacheConfig
    args = dict(max_num_tokens=24, max_batch_size=3,
                kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=2048))
    if spec is not None:
        args["speculative_config"] = spec
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(str(path), **args) as llm:
        out = llm.generate([{"prompt_token_ids": p} for p in prompts_], params, use_tqdm=False)
        kv = llm._engine.kv_cache
        assert kv.num_free_blocks == kv.num_blocks
        stats = llm.get_stats()
    return [o.outputs[0].token_ids for o in out], stats


def test_engine_greedy_identical_with_draft_models(tiny_llama):
    path, _ = tiny_llama
    batch = prompts() + [list(range(3, 20))]
    plain, _ = engine_greedy(path, None, batch)
    cut, stats = engine_greedy(path, DraftTargetDecodingConfig(
        speculative_model="self:layers=1", max_draft_len=3), batch)
    assert cut == plain and stats["spec_draft_tokens"] > 0
    same, stats = engine_greedy(path, DraftTargetDecodingConfig(  # the target as its draft
        speculative_model=str(path), max_draft_len=3), batch)
    assert same == plain and stats["spec_acceptance_rate"] == 1.0
