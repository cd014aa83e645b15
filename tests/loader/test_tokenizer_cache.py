"""The on-disk cache of GGUF-built tokenizers: the saved folder gives the same tokenizer as
the file (ids, text, special tokens, chat template, EOS), it is what a second load reads,
it can be turned off, and a damaged entry is rebuilt."""
from __future__ import annotations

import pytest

from tllm.loader import gguf, smollm2_path
from tllm.loader import tokenizer_cache as cache

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "naïve café — 東京 🙂",
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2  # code", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]


@pytest.fixture(scope="module")
def direct():
    """SmolLM2's tokenizer built from the file's metadata (no cache)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TLLM_CACHE_DIR", "off")
        return gguf.load_tokenizer(smollm2_path())


def test_the_saved_tokenizer_equals_the_file_and_is_read_back(direct, tmp_path, monkeypatch):
    monkeypatch.setenv("TLLM_CACHE_DIR", str(tmp_path))
    first = gguf.load_tokenizer(smollm2_path())            # builds and saves
    entry = cache.entry_dir(smollm2_path())
    assert (entry / "tokenizer.json").is_file()
    built = []
    monkeypatch.setattr(gguf, "_SPECS", {})                  # a rebuild would still work,
    second = cache.cached_tokenizer(smollm2_path(), lambda: built.append(1))  # but is not run
    assert not built
    for tokenizer in (first, second):
        for text in TEXTS:
            for special in (True, False):
                ids = direct.encode(text, add_special_tokens=special)
                assert tokenizer.encode(text, add_special_tokens=special) == ids
                assert tokenizer.decode(ids) == direct.decode(ids)
                assert tokenizer.decode(ids, skip_special_tokens=False) == direct.decode(
                    ids, skip_special_tokens=False)
        assert tokenizer.eos_token_ids == direct.eos_token_ids
        assert tokenizer.vocab_size == direct.vocab_size
        assert tokenizer.apply_chat_template(MESSAGES) == direct.apply_chat_template(MESSAGES)


def test_off_writes_nothing_and_a_damaged_entry_is_rebuilt(direct, tmp_path, monkeypatch):
    monkeypatch.setenv("TLLM_CACHE_DIR", "off")
    assert cache.entry_dir(smollm2_path()) is None
    monkeypatch.setenv("TLLM_CACHE_DIR", str(tmp_path))
    entry = cache.entry_dir(smollm2_path())
    entry.mkdir(parents=True)
    (entry / "tokenizer.json").write_text("{not json")
    rebuilt = cache.cached_tokenizer(smollm2_path(), lambda: direct)
    assert rebuilt is direct
    again = cache.cached_tokenizer(smollm2_path(), lambda: None)   # the entry was replaced
    assert again.encode(TEXTS[2]) == direct.encode(TEXTS[2])
