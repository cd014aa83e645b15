"""The engine flags shared by `tllm generate | chat | serve | bench throughput | latency`: flags
over the --config YAML over a command's defaults, `model` in the YAML, the kv_cache_config
merge, errors for bad files, and every command turning the same flags into the same LLM
arguments."""
from __future__ import annotations

import argparse

import pytest

from tllm.cli import main
from tllm.llmapi.cli_args import add_engine_args, llm_kwargs
from tllm.config import LlmArgs
from tllm.loader import DEFAULT_MODEL

ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--max-batch-size", "3",
                "--max-num-tokens", "64", "--max-seq-len", "48", "--tp-size", "1",
                "--pp-size", "1", "--kv-cache-tokens", "512",
                "--kv-cache-free-memory-fraction", "0.5", "--revision", "v2",
                "--download-dir", "/tmp/hf"]
ENGINE_KWARGS = {"dtype": "float32", "device": "cpu", "max_batch_size": 3, "max_num_tokens": 64,
                 "max_seq_len": 48, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                 "revision": "v2", "download_dir": "/tmp/hf"}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


@pytest.fixture()
def config(tmp_path):
    """Write a YAML file, return its path."""
    def write(text: str) -> str:
        path = tmp_path / "llm.yml"
        path.write_text(text)
        return str(path)
    return write


def test_no_flag_has_a_default():
    args = parse()
    assert all(value is None for value in vars(args).values())
    assert llm_kwargs(args) == {"model": DEFAULT_MODEL}


def test_flags_over_yaml_over_defaults(config):
    path = config("dtype: bfloat16\nmax_batch_size: 8\nmax_num_tokens: 128\n"
                  "enable_chunked_prefill: false\n")
    kwargs = llm_kwargs(parse("--config", path, "--max-batch-size", "4"), model="m",
                        defaults={"max_batch_size": 2, "max_num_tokens": 16, "seed": 7})
    assert kwargs == {"model": "m", "dtype": "bfloat16", "max_batch_size": 4,
                      "max_num_tokens": 128, "enable_chunked_prefill": False, "seed": 7}
    LlmArgs(**kwargs)  # every key is an LLM argument


def test_a_default_may_depend_on_the_other_arguments(config):
    path = config("kv_cache_config:\n  tokens_per_block: 16\n")
    block = lambda kwargs: kwargs["kv_cache_config"]["tokens_per_block"]  # noqa: E731
    assert llm_kwargs(parse("--config", path), defaults={"max_seq_len": block})[
        "max_seq_len"] == 16
    assert llm_kwargs(parse("--config", path, "--max-seq-len", "40"),
                      defaults={"max_seq_len": block})["max_seq_len"] == 40


def test_model_from_yaml_and_the_command_line_wins(config):
    path = config("model: from-yaml\n")
    assert llm_kwargs(parse("--config", path))["model"] == "from-yaml"
    assert llm_kwargs(parse("--config", path), model="from-flag")["model"] == "from-flag"
    assert llm_kwargs(parse("--config", config("max_batch_size: 2\n")))["model"] == DEFAULT_MODEL


def test_kv_cache_config_merges_file_and_flags(config):
    path = config("kv_cache_config:\n  tokens_per_block: 16\n  max_tokens: 100\n"
                  "  enable_block_reuse: false\n")
    kwargs = llm_kwargs(parse("--config", path, "--kv-cache-tokens", "200",
                              "--kv-cache-free-memory-fraction", "0.25"))
    assert kwargs["kv_cache_config"] == {"tokens_per_block": 16, "max_tokens": 200,
                                         "enable_block_reuse": False,
                                         "free_memory_fraction": 0.25}
    assert llm_kwargs(parse("--config", path))["kv_cache_config"]["max_tokens"] == 100
    assert llm_kwargs(parse("--kv-cache-tokens", "64"))["kv_cache_config"] == {"max_tokens": 64}
    assert "kv_cache_config" not in llm_kwargs(parse("--config", config("kv_cache_config:\n")))


@pytest.mark.parametrize("text, message", [
    ("- a\n- list\n", "expected a mapping of LLM arguments, got list"),
    ("just text\n", "expected a mapping of LLM arguments, got str"),
    ("key: [unclosed\n", "not valid YAML"),
    ("kv_cache_config: 1024\n", "kv_cache_config must be a mapping, got int"),
    ("kv_cache_config: [16]\n", "kv_cache_config must be a mapping, got list")])
@pytest.mark.parametrize("flag", ["--config", "--extra-llm-api-options"])
def test_bad_yaml_is_a_value_error_naming_the_flag(config, text, message, flag):
    path = config(text)
    with pytest.raises(ValueError, match=message) as info:
        llm_kwargs(parse(flag, path))
    assert str(info.value).startswith(f"{flag} {path}: ")


def test_bad_flag_values_exit_2(capsys):
    for argv in (["--max-batch-size", "0"], ["--kv-cache-free-memory-fraction", "1.5"],
                 ["--dtype", "int3"]):
        with pytest.raises(SystemExit) as info:
            parse(*argv)
        assert info.value.code == 2
        assert argv[0] in capsys.readouterr().err


class _Loaded(Exception):
    """Raised by the stand-in LLM: the command got as far as building its engine."""


@pytest.fixture()
def engine_kwargs(monkeypatch):
    """The keyword arguments each command builds its LLM with, instead of building it."""
    seen: list[dict] = []

    def fake_llm(*args, **kwargs):
        assert not args
        seen.append(kwargs)
        raise _Loaded

    import tllm.bench.offline_cli
    import tllm.cli
    import tllm.llmapi.llm
    import tllm.llmapi.process_llm
    for module, name in ((tllm.cli, "LLM"), (tllm.bench.offline_cli, "LLM"),
                         (tllm.llmapi.llm, "LLM"), (tllm.llmapi.process_llm, "ProcessLLM")):
        monkeypatch.setattr(module, name, fake_llm)

    def run(*argv: str) -> dict:
        with pytest.raises(_Loaded):
            main(list(argv))
        return seen.pop()
    return run


COMMANDS = {"generate": ["generate", "-p", "hi"], "chat": ["chat"], "serve": ["serve"],
            "bench throughput": ["bench", "throughput"], "bench latency": ["bench", "latency"]}


@pytest.mark.parametrize("flag", ["--config", "--extra-llm-api-options"])
def test_every_command_takes_the_same_engine_flags(engine_kwargs, config, flag):
    path = config("model: from-yaml\nenable_chunked_prefill: false\nmax_num_tokens: 32\n"
                  "kv_cache_config:\n  tokens_per_block: 16\n")
    for name, command in COMMANDS.items():
        kwargs = engine_kwargs(*command, *ENGINE_FLAGS, flag, path)
        assert kwargs["model"] == "from-yaml", name
        assert {k: kwargs[k] for k in ENGINE_KWARGS} == ENGINE_KWARGS, name
        assert kwargs["enable_chunked_prefill"] is False, name
        assert kwargs["kv_cache_config"] == {"tokens_per_block": 16, "max_tokens": 512,
                                             "free_memory_fraction": 0.5}, name
        LlmArgs(**kwargs)


def test_the_model_flag_wins_over_the_yaml_in_every_command(engine_kwargs, config):
    path = config("model: from-yaml\n")
    for name, command in COMMANDS.items():
        model_flag = ["from-flag"] if command == ["serve"] else ["--model", "from-flag"]
        assert engine_kwargs(*command, *model_flag, "--config", path)["model"] == "from-flag", name
        assert engine_kwargs(*command)["model"] == DEFAULT_MODEL, name


def test_each_command_keeps_its_own_defaults(engine_kwargs, config):
    assert engine_kwargs("generate", "-p", "a", "-p", "b", "--n", "3") == {
        "model": DEFAULT_MODEL, "max_batch_size": 6}
    assert engine_kwargs("chat", "--seed", "5") == {"model": DEFAULT_MODEL, "max_batch_size": 1,
                                                    "seed": 5}
    assert engine_kwargs("serve") == {"model": DEFAULT_MODEL}
    # bench: max_seq_len of ISL + OSL in whole KV blocks (of the YAML's size), and --seed
    assert engine_kwargs("bench", "throughput", "--isl", "20", "--osl", "5") == {
        "model": DEFAULT_MODEL, "max_seq_len": 32, "seed": 0}
    path = config("kv_cache_config:\n  tokens_per_block: 16\nmax_batch_size: 2\n")
    assert engine_kwargs("bench", "latency", "--isl", "20", "--osl", "5", "--batch-size", "4",
                         "--seed", "3", "--extra-llm-api-options", path) == {
        "model": DEFAULT_MODEL, "kv_cache_config": {"tokens_per_block": 16},
        "max_batch_size": 2, "max_seq_len": 32, "seed": 3}
    # the YAML over a command's default, a flag over the YAML
    path = config("max_batch_size: 8\nseed: 9\n")
    assert engine_kwargs("generate", "-p", "a", "--config", path) == {
        "model": DEFAULT_MODEL, "max_batch_size": 8, "seed": 9}
    assert engine_kwargs("generate", "-p", "a", "--config", path, "--seed", "1",
                         "--max-batch-size", "2")["seed"] == 1


@pytest.mark.parametrize("command", list(COMMANDS.values()))
def test_every_command_lists_the_engine_flags_in_its_help(command, capsys):
    with pytest.raises(SystemExit):
        main([*command[:2 if command[0] == "bench" else 1], "--help"])
    out = capsys.readouterr().out
    for flag in ("--config", "--extra-llm-api-options", "--dtype", "--device", "--max-batch-size",
                 "--max-num-tokens", "--max-seq-len", "--tp-size", "--pp-size",
                 "--kv-cache-tokens", "--kv-cache-free-memory-fraction", "--revision",
                 "--download-dir"):
        assert flag in out, (command, flag)


def test_quantization_and_kv_cache_dtype_flags():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--quantization", "fp8", "--kv-cache-dtype", "fp8",
                              "--kv-cache-tokens", "64"])
    kwargs = llm_kwargs(args, model="dummy:smollm2-135m")
    assert kwargs["quantization"] == "fp8"
    assert kwargs["kv_cache_config"] == {"dtype": "fp8", "max_tokens": 64}


def test_multimodal_flags():
    kwargs = llm_kwargs(parse("--limit-mm-per-prompt", '{"image": 3}',
                              "--allowed-local-media-path", "/srv/images",
                              "--allowed-media-domains", "img.example", "http://10.0.0.5"))
    assert kwargs["limit_mm_per_prompt"] == {"image": 3}
    assert LlmArgs(**kwargs).allowed_local_media_path == "/srv/images"
    assert LlmArgs(**kwargs).allowed_media_domains == ["img.example", "http://10.0.0.5"]
    assert LlmArgs(model="m").allowed_media_domains is None   # http(s) off by default
    with pytest.raises(SystemExit):
        parse("--limit-mm-per-prompt", "3")
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        LlmArgs(model="m", limit_mm_per_prompt={"video": 1})


def test_deterministic_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert llm_kwargs(parser.parse_args(["--deterministic"]), "m")["deterministic"] is True
    assert "deterministic" not in llm_kwargs(parser.parse_args([]), "m")


def test_deterministic_refuses_the_triton_attention_backend():
    with pytest.raises(ValueError, match="attn_backend"):
        LlmArgs(model="m", deterministic=True, attn_backend="triton")
    assert LlmArgs(model="m", deterministic=True).deterministic
