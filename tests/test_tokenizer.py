"""IncrementalDetokenizer on a real byte-level BPE tokenizer (trained in-process on ASCII, so
"é", "中文" and emoji are several byte tokens each): only whole characters stream, stop strings
are found across token boundaries and never streamed, `stream_len` holds back what could start
a stop string, min_tokens (check_stop=False) and skip_special_tokens. Every test runs on both
decoding paths: the fast tokenizer's DecodeStream and the decode-everything fallback."""
from __future__ import annotations

import pytest

from tllm.sampling_params import SamplingParams
from tllm.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = ["hello world, how are you today?", "the quick brown fox jumps over the lazy dog",
          "what is two plus two? it is four.", "a small chat model says hello"]
SEP = "<|sep|>"
PROMPT = "hello world"


class _WithoutBackend:
    """An HF tokenizer seen without its `backend_tokenizer`, as a slow (Python) one is."""

    def __init__(self, hf) -> None:
        self._hf = hf

    def __getattr__(self, name: str):
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self._hf, name)

    def __len__(self) -> int:
        return len(self._hf)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300,
                                  special_tokens=["<pad>", "<s>", "</s>", SEP],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", additional_special_tokens=[SEP])


@pytest.fixture(params=["fast", "slow"])
def tokenizer(request, hf_tokenizer) -> Tokenizer:
    hf = hf_tokenizer if request.param == "fast" else _WithoutBackend(hf_tokenizer)
    tokenizer = Tokenizer(hf)
    assert (tokenizer.backend is not None) == (request.param == "fast")
    return tokenizer


def ids_of(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def detokenizer(tokenizer: Tokenizer, **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, ids_of(tokenizer, PROMPT),
                                  SamplingParams(max_tokens=64, **params))


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], list[str], str | None]:
    """Add tokens until one stops; (text after each token, streamed text after each token,
    the stop string or None)."""
    texts, streamed = [], []
    for token in ids:
        stop = detok.add_token(token)
        texts.append(detok.text)
        streamed.append(detok.text[:detok.stream_len])
        if stop is not None:
            return texts, streamed, stop
    return texts, streamed, None


def test_the_test_tokenizer_splits_multibyte_characters(tokenizer):
    assert [len(ids_of(tokenizer, c)) for c in ("é", "中", "🙂")] == [2, 3, 4]


@pytest.mark.parametrize("text", ["café", "中文", "a 🙂 b", "é中🙂", "x\u00e9\u0301 🇫🇷 ok"])
def test_only_whole_characters_stream(tokenizer, text):
    ids = ids_of(tokenizer, text)
    detok = detokenizer(tokenizer)
    texts, _, stop = feed(detok, ids)
    assert stop is None
    assert all("\ufffd" not in t for t in texts)
    assert all(texts[-1].startswith(t) for t in texts)  # text only grows
    assert len(set(texts)) < len(texts)  # some tokens held a partial character back
    assert texts[-1] == text == tokenizer.decode(ids)
    detok.finalize()
    assert detok.stream_len == len(text)


def _spanning_stop(tokenizer: Tokenizer, ids: list[int], first: int, num_tokens: int) -> str:
    """A stop string made of the last character of token `first`, all of the tokens after it
    but the last, and the first character of the last: it spans `num_tokens` tokens."""
    pieces = [tokenizer.decode([i]) for i in ids[first:first + num_tokens]]
    return pieces[0][-1] + "".join(pieces[1:-1]) + pieces[-1][0]


@pytest.mark.parametrize("num_tokens", [2, 3])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_token_boundaries(tokenizer, num_tokens, include):
    text = "the quick brown fox jumps over the lazy dog"
    ids = ids_of(tokenizer, text)
    first = 4
    stop = _spanning_stop(tokenizer, ids, first, num_tokens)
    assert len(stop) >= 2
    where = len(tokenizer.decode(ids[:first + 1])) - 1
    assert text.find(stop) == where  # the first occurrence is the spanning one
    detok = detokenizer(tokenizer, stop=["zzz", stop], include_stop_str_in_output=include)
    texts, streamed, found = feed(detok, ids)
    assert found == stop and detok.stopped_by == stop
    assert len(texts) == first + num_tokens  # it stops at the token that completes the stop
    final = text[:where + len(stop)] if include else text[:where]
    assert detok.text == final and detok.stream_len == len(final)
    # nothing streamed before the stop is taken back, and no part of the stop streams early
    assert all(final.startswith(s) for s in streamed)
    assert all(len(s) <= where for s in streamed[:-1])


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_of_multibyte_characters(tokenizer, include):
    text = "ok 中文 and 🙂 end"
    for stop in ("中文", "🙂"):
        detok = detokenizer(tokenizer, stop=stop, include_stop_str_in_output=include)
        texts, streamed, found = feed(detok, ids_of(tokenizer, text))
        where = text.find(stop)
        assert found == stop
        assert detok.text == (text[:where + len(stop)] if include else text[:where])
        assert all("\ufffd" not in t for t in texts + streamed)
        assert all(len(s) <= where for s in streamed[:-1])


def test_stream_len_holds_back_a_possible_stop_prefix_and_releases_it(tokenizer):
    text = "the lazy fox jumps over the lazy dog"
    stop = "fox!"  # "fox" could start it, until the next character says otherwise
    ids = ids_of(tokenizer, text)
    at_fox = next(n for n in range(len(ids) + 1) if tokenizer.decode(ids[:n]).endswith("fox"))
    detok = detokenizer(tokenizer, stop=stop)
    for n, token in enumerate(ids, 1):
        assert detok.add_token(token) is None
        assert detok.stream_len == max(0, len(detok.text) - (len(stop) - 1))
        if n == at_fox:  # the text ends with "fox": none of it streams yet
            assert detok.text[:detok.stream_len] == "the lazy "
    assert detok.text == text
    assert detok.text[:detok.stream_len] == text[:-(len(stop) - 1)]  # "fox" went out
    detok.finalize()  # no more tokens: the tail cannot become a stop any more
    assert detok.stream_len == len(text)


def test_without_stop_strings_everything_streams(tokenizer):
    detok = detokenizer(tokenizer)
    for token in ids_of(tokenizer, "hello there"):
        detok.add_token(token)
        assert detok.stream_len == len(detok.text)


def test_stop_strings_are_not_checked_before_min_tokens(tokenizer):
    """The executor adds the first min_tokens tokens with check_stop=False: a stop string
    that they complete is not a stop, then or later."""
    text = "the fox and the fox ran"
    ids = ids_of(tokenizer, text)
    detok = detokenizer(tokenizer, stop="fox")
    first_fox_end = text.index("fox") + 3
    num_unchecked = next(n for n in range(len(ids) + 1)
                         if len(tokenizer.decode(ids[:n])) >= first_fox_end + 3)
    for token in ids[:num_unchecked]:  # the first "fox" comes and goes: min_tokens not reached
        assert detok.add_token(token, check_stop=False) is None
    assert detok.text.startswith("the fox a") and detok.stopped_by is None
    stop = None
    for token in ids[num_unchecked:]:
        if (stop := detok.add_token(token)) is not None:
            break
    assert stop == "fox" and detok.text == "the fox and the "


def test_a_stop_completed_by_the_first_checked_token_is_found(tokenizer):
    ids = ids_of(tokenizer, "the fox ran")
    end = next(n for n in range(len(ids) + 1) if "fox" in tokenizer.decode(ids[:n]))
    detok = detokenizer(tokenizer, stop="fox")
    for token in ids[:end - 1]:
        assert detok.add_token(token, check_stop=False) is None
    assert detok.add_token(ids[end - 1]) == "fox"
    assert detok.text == "the "


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    ids = ids_of(tokenizer, "hello") + ids_of(tokenizer, SEP) + ids_of(tokenizer, " world")
    assert len(ids_of(tokenizer, SEP)) == 1
    detok = detokenizer(tokenizer, skip_special_tokens=skip)
    texts, _, _ = feed(detok, ids)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert detok.text == ("hello world" if skip else f"hello{SEP} world")
    assert all(texts[-1].startswith(t) for t in texts)


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    detok = detokenizer(tokenizer, stop=["lazy dog", "fox", "quick brown fox"])
    _, _, found = feed(detok, ids_of(tokenizer, "the quick brown fox jumps over the lazy dog"))
    assert found == "quick brown fox" and detok.text == "the "


def test_encode_batch_equals_encode_each(tokenizer):
    texts = ["héllo wörld", "a", "日本語のテキスト and more", "x " * 40]
    assert tokenizer.encode_batch(texts) == [tokenizer.encode(t) for t in texts]
    assert tokenizer.encode_batch(texts, add_special_tokens=False) == [
        tokenizer.encode(t, add_special_tokens=False) for t in texts]
