"""The `tllm` command line: generate, chat, --version and user errors, run in-process on a tiny
random Llama with a real (trained) tokenizer, plus one end-to-end run of the console script."""
from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tllm import LLM, SamplingParams, __version__
from tllm.cli import main

STATS = re.compile(r"(\d+) prompts?, (\d+) output tokens in [\d.]+ s: [\d.]+ tokens/s")
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
CORPUS = ["hello world, how are you today?", "the quick brown fox jumps over the lazy dog",
          "what is two plus two? it is four.", "system user assistant: a small chat model",
          "tell me a story about a cat and a dog."]


@pytest.fixture(scope="session")
def tiny_llama_with_tokenizer_dir(tmp_path_factory) -> Path:
    """A random 2-layer HF Llama saved with a byte-level BPE tokenizer and a chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny_llama_with_tokenizer")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.1,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tiny_llama_with_tokenizer_dir) -> str:
    return str(tiny_llama_with_tokenizer_dir)


@pytest.fixture(scope="module")
def llm(model_dir):
    """The same model through the Python API, for the answers the CLI should print."""
    with LLM(model_dir) as llm:
        yield llm


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tllm {__version__}"


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "generate" in out and "chat" in out


def test_generate_prints_the_chat_formatted_answer_and_stats(model_dir, llm, capsys):
    assert main(["generate", "--model", model_dir, "--prompt", "hello world",
                 "--max-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    expected = llm.chat(user("hello world"), greedy(8), use_tqdm=False).outputs[0]
    assert out == expected.text + "\n"
    assert f"loaded {model_dir} in" in err
    stats = STATS.search(err)
    assert stats and stats.groups() == ("1", str(len(expected.token_ids)))


def test_generate_without_chat_template_uses_the_raw_text(model_dir, llm, capsys):
    assert main(["generate", "-m", model_dir, "-p", "the quick brown fox", "--max-tokens", "6",
                 "--no-chat-template"]) == 0
    out, err = capsys.readouterr()
    expected = llm.generate("the quick brown fox", greedy(6), use_tqdm=False).outputs[0].text
    assert out == expected + "\n"
    assert STATS.search(err)


def test_generate_batch_labels_each_prompt_and_sample(model_dir, capsys):
    assert main(["generate", "-m", model_dir, "-p", "hello", "-p", "tell me a story",
                 "--n", "2", "--temperature", "1.0", "--seed", "3", "--max-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    labels = [line for line in out.splitlines() if line.startswith("--- prompt")]
    assert labels == ["--- prompt 1, sample 1 ---", "--- prompt 1, sample 2 ---",
                      "--- prompt 2, sample 1 ---", "--- prompt 2, sample 2 ---"]
    assert STATS.search(err).group(1) == "2"


def test_generate_stream_prints_the_same_answer(model_dir, llm, capsys):
    assert main(["generate", "-m", model_dir, "-p", "hello world", "--max-tokens", "8",
                 "--system", "be brief", "--stream"]) == 0
    out, err = capsys.readouterr()
    messages = [{"role": "system", "content": "be brief"}] + user("hello world")
    assert out == llm.chat(messages, greedy(8), use_tqdm=False).outputs[0].text + "\n"
    assert STATS.search(err)


def test_chat_streams_a_reply_per_line_until_eof(model_dir, llm, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello world\nwhat is two plus two?\n"))
    assert main(["chat", "-m", model_dir, "--max-tokens", "6"]) == 0
    out, _ = capsys.readouterr()
    history = user("hello world")
    first = llm.chat(history, greedy(6), use_tqdm=False).outputs[0].text
    history += [{"role": "assistant", "content": first}] + user("what is two plus two?")
    second = llm.chat(history, greedy(6), use_tqdm=False).outputs[0].text
    assert out == f"{first}\n{second}\n"


def test_chat_reset_forgets_and_exit_stops(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/reset\nhello\n/exit\nnever read\n"))
    assert main(["chat", "-m", model_dir, "--max-tokens", "5"]) == 0
    out, _ = capsys.readouterr()
    half = len(out) // 2
    assert out[:half] == out[half:] and out.endswith("\n")


def test_chat_reports_a_too_long_turn_and_goes_on(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello " * 40 + "\nhello\n"))
    assert main(["chat", "-m", model_dir, "--max-tokens", "4", "--max-seq-len", "32"]) == 0
    out, err = capsys.readouterr()
    assert "error: inputs: the prompt has" in err
    assert out.endswith("\n") and out.count("\n") >= 1


@pytest.mark.parametrize("argv, message", [
    (["generate", "-m", "/no/such/model", "-p", "hi"], "does not exist"),
    (["generate", "-p", "a", "-p", "b", "--stream"], "--stream"),
    (["generate", "-m", "dummy:no-such-preset", "-p", "hi"], "unknown dummy preset"),
])
def test_user_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_prompt_too_long_for_max_seq_len(model_dir, capsys):
    assert main(["generate", "-m", model_dir, "-p", "hello " * 20, "--max-seq-len", "8"]) == 1
    err = capsys.readouterr().err
    assert "error: inputs: the prompt has" in err and "max_seq_len is 8" in err


def test_bad_option_values_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "-p", "hi", "--max-tokens", "0"])
    assert exit_info.value.code == 2
    assert "--max-tokens" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_on_the_default_model():
    script = Path(sys.executable).with_name("tllm")
    command = [str(script)] if script.exists() else [shutil.which("tllm") or "tllm"]
    proc = subprocess.run(command + ["generate", "--prompt", "What is 2+2?", "--max-tokens", "8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert STATS.search(proc.stderr).groups()[0] == "1"
    assert "Traceback" not in proc.stderr
