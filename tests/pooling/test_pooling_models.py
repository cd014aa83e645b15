"""Pooling models on tiny random weights (fp32, CPU) against their references: embeddings
against sentence-transformers' `encode` (its layout decides pooling and normalisation),
cross-encoder scores and classifier probabilities against HF transformers' logits."""
import numpy as np
import pytest
import torch

from tiny_models import (TEXTS, add_sentence_transformers_layout, save_bert, save_qwen3)
from tllm import LLM
from tllm.config import KvCacheConfig

TOL = 1e-5


def make_llm(path, **kwargs):
    return LLM(str(path), kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024),
               **kwargs)


def st_encode(path, texts, **kwargs):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(path), device="cpu").encode(texts, batch_size=len(texts),
                                                                **kwargs)


@pytest.mark.parametrize("arch,pooling,normalize", [
    ("BertModel", "cls", True), ("BertModel", "mean", False),
    ("XLMRobertaModel", "mean", True), ("XLMRobertaModel", "cls", False)])
def test_encoder_embeddings_equal_sentence_transformers(tmp_path, arch, pooling, normalize):
    save_bert(tmp_path, arch)
    add_sentence_transformers_layout(tmp_path, pooling, normalize)
    expected = st_encode(tmp_path, TEXTS)
    with make_llm(tmp_path, max_num_tokens=32) as llm:
        assert llm.task == "embed"
        assert llm.pooling_info == {"embedding_size": 32, "labels": None}
        got = np.array([o.embedding for o in llm.embed(TEXTS)])
    np.testing.assert_allclose(got, expected, atol=TOL)


@pytest.mark.parametrize("pooling,max_num_tokens", [("lasttoken", 256), ("mean", 5)],
                         ids=["last", "mean-chunked"])
def test_decoder_embeddings_equal_sentence_transformers(tmp_path, pooling, max_num_tokens):
    """Qwen3-Embedding's shape: a decoder, last-token pooling (or mean over prompts
    computed in chunks of 5 tokens), normalised."""
    save_qwen3(tmp_path, "Qwen3Model")
    add_sentence_transformers_layout(tmp_path, pooling, True)
    expected = st_encode(tmp_path, TEXTS)
    with make_llm(tmp_path, max_num_tokens=max_num_tokens) as llm:
        got = np.array([o.embedding for o in llm.embed(TEXTS)])
    np.testing.assert_allclose(got, expected, atol=TOL)


def test_matryoshka_dimensions_cut_then_normalise(tmp_path):
    save_bert(tmp_path, "BertModel")
    add_sentence_transformers_layout(tmp_path, "mean", False)
    full = torch.tensor(st_encode(tmp_path, TEXTS))
    with make_llm(tmp_path) as llm:
        cut = np.array([o.embedding for o in llm.embed(TEXTS, dimensions=8, normalize=True)])
        raw = np.array([o.embedding for o in llm.embed(TEXTS, dimensions=8)])
    np.testing.assert_allclose(cut, torch.nn.functional.normalize(full[:, :8], dim=-1),
                               atol=TOL)
    np.testing.assert_allclose(raw, full[:, :8], atol=TOL)


@pytest.mark.parametrize("arch", ["BertForSequenceClassification",
                                  "XLMRobertaForSequenceClassification"])
def test_cross_encoder_scores_equal_hf(tmp_path, arch):
    from transformers import AutoTokenizer
    hf = save_bert(tmp_path, arch, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    query, docs = TEXTS[3], TEXTS[:3] + TEXTS[4:]
    with torch.no_grad():
        expected = [torch.sigmoid(hf(**tokenizer(query, d, return_tensors="pt")).logits)[0, 0]
                    for d in docs]
    with make_llm(tmp_path) as llm:
        assert llm.task == "score"
        got = [o.score for o in llm.score(query, docs)]
    np.testing.assert_allclose(got, expected, atol=TOL)


@pytest.mark.parametrize("arch", ["Qwen2ForSequenceClassification",
                                  "LlamaForSequenceClassification"])
def test_classifier_probs_equal_hf(tmp_path, arch):
    import transformers
    from tiny_models import save_bpe_tokenizer
    tokenizer = save_bpe_tokenizer(tmp_path)
    config_cls = getattr(transformers, arch.replace("ForSequenceClassification", "Config"))
    config = config_cls(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=128, num_labels=3,
                        pad_token_id=tokenizer.pad_token_id, architectures=[arch])
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(config).eval()
    hf.save_pretrained(tmp_path)
    with torch.no_grad():
        expected = [hf(**tokenizer(t, return_tensors="pt")).logits[0].softmax(-1)
                    for t in TEXTS]
    with make_llm(tmp_path, max_num_tokens=4) as llm:   # prompts in chunks
        assert llm.task == "classify"
        assert llm.pooling_info["labels"] == ["LABEL_0", "LABEL_1", "LABEL_2"]
        got = [o.probs for o in llm.classify(TEXTS)]
    np.testing.assert_allclose(got, torch.stack(expected), atol=TOL)


def test_qwen3_reranker_scores_by_the_yes_no_rule(tmp_path):
    """A causal LM with task "score": P(yes) of {yes, no} after the pair in Qwen3-Reranker's
    template, as HF's logits give it."""
    from transformers import AutoTokenizer
    from tllm.llmapi.pooling import reranker_prompt
    hf = save_qwen3(tmp_path, "Qwen3ForCausalLM", extra_tokens=("yes", "no"),
                    max_position_embeddings=512)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    yes, no = tokenizer.convert_tokens_to_ids(["yes", "no"])
    query, docs = TEXTS[3], TEXTS[4:]
    expected = []
    for doc in docs:
        ids = tokenizer(reranker_prompt(query, doc), return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = hf(ids).logits[0, -1]
        expected.append(logits[[no, yes]].softmax(-1)[1])
    with make_llm(tmp_path, task="score", max_num_tokens=64) as llm:
        assert llm.task == "score"
        got = [o.score for o in llm.score(query, docs)]
    np.testing.assert_allclose(got, expected, atol=TOL)


def test_modernbert_embeddings_equal_sentence_transformers(tmp_path):
    """Rotary positions, GeGLU, local layers attending two positions either side."""
    save_bert(tmp_path, "ModernBertModel")
    add_sentence_transformers_layout(tmp_path, "mean", True)
    expected = st_encode(tmp_path, TEXTS)
    with make_llm(tmp_path) as llm:
        got = np.array([o.embedding for o in llm.embed(TEXTS)])
    np.testing.assert_allclose(got, expected, atol=TOL)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_modernbert_classifier_probs_equal_hf(tmp_path, pooling):
    from transformers import AutoTokenizer
    hf = save_bert(tmp_path, "ModernBertForSequenceClassification", num_labels=3,
                   classifier_pooling=pooling)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    with torch.no_grad():
        expected = [hf(**tokenizer(t, return_tensors="pt")).logits[0].softmax(-1)
                    for t in TEXTS]
    with make_llm(tmp_path) as llm:
        assert llm.task == "classify"
        got = [o.probs for o in llm.classify(TEXTS)]
    np.testing.assert_allclose(got, torch.stack(expected), atol=TOL)
