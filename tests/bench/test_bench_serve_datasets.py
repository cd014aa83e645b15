"""`tllm bench serve` beyond random prompts: ShareGPT and JSONL files, the chat endpoint,
vLLM's flag spellings, where results go (nowhere unless asked), and the progress bar."""
from __future__ import annotations

import argparse
import json
import time

import pytest

from tllm.bench import serve_cli
from tllm.bench.serve import BenchConfig, BenchRun, dataset_requests
from tllm.bench.serve_cli import add_bench_serve_parser
from tllm.bench.serve_datasets import jsonl_prompts, load_tokenizer, sharegpt_prompts
from tllm.bench.serve_results import result_name
from tllm.serve.testing import FakeTokenizer

TOKENIZER = FakeTokenizer()   # a byte a token: lengths are len(text)


def bench(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tllm bench")
    add_bench_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *argv])
    return args.run(args)


def conversation(*turns: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": who, "value": text} for who, text in turns]}


KEPT = [("Tell me about cats", "Cats are small furry animals."),   # 18 / 29 tokens
        ("What is two plus two?", "Four, of course.")]              # 21 / 16
SHAREGPT = [conversation(*[("human", p), ("gpt", a)]) for p, a in KEPT] + [
    conversation(("human", "Hi"), ("gpt", "Hello there!")),          # prompt too short
    conversation(("human", "Say ok please"), ("gpt", "ok")),         # answer too short
    conversation(("human", "x" * 1100), ("gpt", "fine answer")),     # prompt too long
    conversation(("human", "y" * 1000), ("gpt", "z" * 1100)),        # both too long
    conversation(("gpt", "I speak first"), ("human", "and I answer")),
    conversation(("human", "a lone question")),
    "not a conversation"]


@pytest.fixture()
def sharegpt_file(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    return path


@pytest.fixture()
def jsonl_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "first prompt", "output_len": 3}\n\n'
                    '{"prompt": "second", "max_tokens": 5}\n'
                    '{"prompt": "third, no length"}\n'
                    '{"prompt": "fourth", "output_len": 2, "extra": true}\n')
    return path


def test_sharegpt_takes_first_turns_and_skips_what_vllm_skips(sharegpt_file):
    requests = sharegpt_prompts(sharegpt_file, None, TOKENIZER, seed=1)
    assert sorted((r.prompt, r.max_tokens, r.num_prompt_tokens) for r in requests) == sorted(
        (p, len(a), len(p)) for p, a in KEPT)
    assert requests == sharegpt_prompts(sharegpt_file, None, TOKENIZER, seed=1)  # seeded
    fixed = sharegpt_prompts(sharegpt_file, None, TOKENIZER, output_len=5)
    # the answers' lengths no longer count: "ok" is back, and "y" * 1000 fits with 5
    assert {r.max_tokens for r in fixed} == {5}
    assert {r.prompt for r in fixed} == {p for p, _ in KEPT} | {"Say ok please", "y" * 1000}
    assert len(sharegpt_prompts(sharegpt_file, 1, TOKENIZER)) == 1
    with pytest.raises(ValueError, match="2 conversations fit .* fewer than --num-prompts 3"):
        sharegpt_prompts(sharegpt_file, 3, TOKENIZER)


@pytest.mark.parametrize("text, message", [
    ("{}", "expected a ShareGPT JSON list"), ("[", "not valid JSON"),
    ("[]", "no conversation fits")])
def test_bad_sharegpt_files(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        sharegpt_prompts(path, None, TOKENIZER)
    with pytest.raises(ValueError, match="cannot read"):
        sharegpt_prompts(tmp_path / "missing.json", None, TOKENIZER)


def test_jsonl_prompts_and_their_lengths(jsonl_file):
    requests = jsonl_prompts(jsonl_file, None)
    assert [(r.prompt, r.max_tokens) for r in requests] == [
        ("first prompt", 3), ("second", 5), ("third, no length", 128), ("fourth", 2)]
    assert all(r.num_prompt_tokens is None for r in requests)   # the server counts them
    assert [r.max_tokens for r in jsonl_prompts(jsonl_file, 2, output_len=7)] == [7, 7]
    with pytest.raises(ValueError, match="4 prompts, fewer than --num-prompts 5"):
        jsonl_prompts(jsonl_file, 5)


@pytest.mark.parametrize("line, message", [
    ("not json", "line 2: not valid JSON"), ('{"text": "x"}', 'line 2: expected .* "prompt"'),
    ('{"prompt": "x", "output_len": 0}', "line 2: output_len / max_tokens must be a positive"),
    ('{"prompt": "x", "max_tokens": "9"}', "positive integer, got '9'")])
def test_bad_jsonl_lines_are_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        jsonl_prompts(path, None)


def test_random_prompts_for_chat_are_text():
    config = BenchConfig(base_url="", num_prompts=2, input_len=5, vocab_size=128,
                         endpoint="chat")
    assert config.needs_tokenizer
    requests = dataset_requests(config, TOKENIZER)
    assert all(isinstance(r.prompt, str) and len(r.prompt) == 5 for r in requests)
    with pytest.raises(ValueError, match="needs --dataset-path"):
        BenchConfig(base_url="", dataset_name="sharegpt")


def test_a_tokenizer_that_is_nowhere_is_a_user_error():
    with pytest.raises(ValueError, match="no such file or folder, nor a hub id"):
        load_tokenizer("/no/such/model")


def test_sharegpt_over_chat_writes_a_dated_result_in_result_dir(
        server, sharegpt_file, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.setattr(serve_cli, "load_tokenizer", lambda name: TOKENIZER)
    results = tmp_path / "results"
    assert bench("--base-url", server.base_url, "--dataset-name", "sharegpt",
                 "--dataset-path", str(sharegpt_file), "--endpoint", "chat",
                 "--result-dir", str(results)) == 0
    assert "Requests: 100%" in capsys.readouterr().err
    [path] = results.iterdir()
    assert path.name.startswith("tllm-serve-sharegpt-infqps-fake-") and path.suffix == ".json"
    record = json.loads(path.read_text())
    summary = record["summary"]
    assert (summary["endpoint"], summary["dataset_name"]) == ("chat", "sharegpt")
    assert summary["completed"] == 2 and summary["input_len"] is None
    assert sorted(r["output_tokens"] for r in record["requests"]) == sorted(
        len(a) for _, a in KEPT)
    # prompt tokens as the server counted them, chat template included
    assert sorted(r["prompt_tokens"] for r in record["requests"]) == sorted(
        len(TOKENIZER.encode_chat([{"role": "user", "content": p}])) for p, _ in KEPT)
    for request in record["requests"]:   # the role chunk is no token: one ITL per gap
        assert len(request["itl_s"]) == request["output_tokens"] - 1


def test_jsonl_with_vllm_spellings_and_save_result(server, jsonl_file, tmp_path, monkeypatch,
                                                   capsys):
    monkeypatch.chdir(tmp_path)
    assert bench("--base-url", server.base_url, "--backend", "openai", "--endpoint",
                 "/v1/completions", "--dataset-name", "custom", "--dataset-path",
                 str(jsonl_file), "--num-prompts", "3", "--save-result",
                 "--result-filename", "run.json", "--metric-percentiles", "50,95",
                 "--disable-tqdm") == 0
    assert "Requests" not in capsys.readouterr().err
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["summary"]["dataset_name"] == "jsonl"
    assert record["summary"]["endpoint"] == "completions"
    assert "p95_ttft_ms" in record["summary"]
    assert [r["output_tokens"] for r in record["requests"]] == [3, 5, 128]
    assert [r["prompt_tokens"] for r in record["requests"]] == [12, 6, 16]


def test_nothing_is_written_unless_asked_and_plot_goes_beside_the_result(
        server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = ("--base-url", server.base_url, "--num-prompts", "3", "--isl", "4", "--osl",
             "3", "--random-vocab-size", "64", "--disable-tqdm")
    assert bench(*small) == 0
    assert list(tmp_path.iterdir()) == []
    names = []
    monkeypatch.setattr(serve_cli, "load_tokenizer", lambda name: names.append(name) or TOKENIZER)
    assert bench(*small, "--result-dir", "out", "--plot", "--backend", "openai-chat") == 0
    assert names == ["fake"]    # no --tokenizer, no --model: the server's model
    [result, plot] = sorted((tmp_path / "out").iterdir())
    assert result.suffix == ".json" and plot == result.with_suffix(".png")
    assert json.loads(result.read_text())["summary"]["endpoint"] == "chat"


def test_result_name_says_dataset_rate_concurrency_model_and_date():
    run = BenchRun(BenchConfig(base_url="", request_rate=2.5, max_concurrency=8),
                   "org/Model-1", [], 1.0)
    now = time.mktime((2025, 1, 2, 3, 4, 5, 0, 0, -1))
    assert result_name(run, now) == "tllm-serve-random-2.5qps-c8-Model-1-20250102-030405.json"


@pytest.mark.parametrize("argv", [["--endpoint", "embeddings"], ["--dataset-name", "hf"]])
def test_unknown_endpoint_or_dataset_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench(*argv)
    assert exit_info.value.code == 2
    assert "expected one of" in capsys.readouterr().err
