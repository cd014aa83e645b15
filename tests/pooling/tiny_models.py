"""Tiny random pooling models saved in-process (fp32), with a sentence-transformers layout
where asked: BERT and XLM-RoBERTa with a WordPiece tokenizer, Qwen3 with a byte-level BPE
one."""
from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = ("the a cat dog sat on mat ran fast slow red blue green house tree river "
         "what is how why where capital of france paris berlin city big small").split()
TEXTS = ["the cat sat on the mat", "a dog", "why is the river blue",
         "what is the capital of france", "paris is a big city",
         "the red house on the green tree sat"]


def save_wordpiece_tokenizer(path: Path, token_types: bool = True):
    from transformers import BertTokenizerFast
    path.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(WORDS)]
    names = ["input_ids", "token_type_ids", "attention_mask"]
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)},
                                  model_input_names=(names if token_types else
                                                     [n for n in names if n != "token_type_ids"]))
    assert len(tokenizer) == len(vocab)
    tokenizer.save_pretrained(path)
    return tokenizer


def save_bpe_tokenizer(path: Path, extra_tokens: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(TEXTS * 3, trainer)
    # Qwen3-Embedding's rule: every text ends with the end-of-text token (pooled last)
    backend.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                        eos_token="<|endoftext|>")
    tokenizer.add_tokens(list(extra_tokens))
    tokenizer.save_pretrained(path)
    return tokenizer


def bert_config(arch: str, vocab_size: int, **extra):
    from transformers import BertConfig, ModernBertConfig, XLMRobertaConfig
    if arch.startswith("ModernBert"):  # a window of 2 either side, every 2nd layer global
        return ModernBertConfig(**{**dict(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, max_position_embeddings=64, local_attention=4,
            global_attn_every_n_layers=2, pad_token_id=0, cls_token_id=2, sep_token_id=3,
            bos_token_id=2, eos_token_id=3, architectures=[arch], initializer_range=0.2),
            **extra})
    cls = XLMRobertaConfig if arch.startswith("XLMRoberta") else BertConfig
    kwargs = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                  pad_token_id=0, architectures=[arch], initializer_range=0.2)
    if cls is XLMRobertaConfig:
        kwargs["type_vocab_size"] = 1
    return cls(**{**kwargs, **extra})


def save_bert(path: Path, arch: str = "BertModel", **extra):
    """A random BERT-family model of `arch` with its tokenizer; returns the HF model."""
    import transformers
    # XLM-RoBERTa's tokenizer makes no token types (its model has one)
    tokenizer = save_wordpiece_tokenizer(path, token_types=not arch.startswith("XLM"))
    config = bert_config(arch, len(tokenizer), **extra)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    model.save_pretrained(path)
    return model


def save_qwen3(path: Path, arch: str = "Qwen3Model", extra_tokens=(), **extra):
    import transformers
    tokenizer = save_bpe_tokenizer(path, extra_tokens)
    config = transformers.Qwen3Config(**{**dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        architectures=[arch]), **extra})
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    model.save_pretrained(path)
    return model


def add_sentence_transformers_layout(path: Path, pooling: str, normalize: bool) -> None:
    """modules.json (Transformer, Pooling, maybe Normalize) and 1_Pooling/config.json, in
    the legacy pooling_mode_* form most published models have."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
             "lasttoken": "pooling_mode_lasttoken"}
    config = {"word_embedding_dimension": hidden, "include_prompt": True,
              **{key: mode == pooling for mode, key in modes.items()}}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))
