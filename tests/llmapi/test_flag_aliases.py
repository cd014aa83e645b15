"""vLLM's and TensorRT-LLM's names for our engine flags and LLM(...) arguments: each command
line spelling lands on our argument, --help lists it, the flags we cannot honour are taken and
said so, and LLM(...) maps vLLM's keywords or names the closest one to a typo."""
from __future__ import annotations

import argparse

import pytest

from tllm import LLM, KvCacheConfig
from tllm.cli import build_parser, main
from tllm.llmapi.cli_args import llm_kwargs
from tllm.llmapi.flag_aliases import FLAG_ALIASES, llm_args, resolve_llm_kwargs
from tllm.config import LlmArgs
from tllm.serve.cli_args import llm_arguments

# peer spelling -> (its value, the LLM keyword arguments it must give)
CLI_CASES = {
    "--max-model-len": ("64", {"max_seq_len": 64}),                           # vLLM
    "--max-num-seqs": ("3", {"max_batch_size": 3}),
    "--max-num-batched-tokens": ("96", {"max_num_tokens": 96}),
    "--tensor-parallel-size": ("2", {"tensor_parallel_size": 2}),
    "-tp": ("2", {"tensor_parallel_size": 2}),
    "--pipeline-parallel-size": ("2", {"pipeline_parallel_size": 2}),
    "-pp": ("2", {"pipeline_parallel_size": 2}),
    "-q": ("fp8", {"quantization": "fp8"}),
    "--dtype": ("half", {"dtype": "float16"}),
    "--kv-cache-dtype": ("fp8_e4m3", {"kv_cache_config": {"dtype": "fp8"}}),
    "--gpu-memory-utilization": ("0.5", {"kv_cache_config": {"gpu_memory_utilization": 0.5}}),
    "--enable-prefix-caching": (None, {"kv_cache_config": {"enable_block_reuse": True}}),
    "--no-enable-prefix-caching": (None, {"kv_cache_config": {"enable_block_reuse": False}}),
    "--enforce-eager": (None, {"cuda_graph_config": None}),
    "--trust-remote-code": (None, {}),
    "--tokenizer": ("m", {}),
    "--max_batch_size": ("5", {"max_batch_size": 5}),                        # trtllm-serve
    "--max_num_tokens": ("80", {"max_num_tokens": 80}),
    "--max_seq_len": ("48", {"max_seq_len": 48}),
    "--tp_size": ("2", {"tensor_parallel_size": 2}),
    "--kv_cache_free_gpu_memory_fraction": ("0.25",
                                            {"kv_cache_config": {"free_memory_fraction": 0.25}}),
}
COMMANDS = [["generate", "-p", "hi"], ["chat"], ["bench", "throughput"], ["bench", "latency"]]


def serve_kwargs(*argv: str) -> dict:
    model, kwargs = llm_arguments(build_parser().parse_args(["serve", "m", *argv]))
    assert model == "m"
    return kwargs


@pytest.mark.parametrize("flag", list(CLI_CASES))
def test_each_peer_flag_gives_our_argument(flag):
    value, expected = CLI_CASES[flag]
    argv = [flag] if value is None else [flag, value]
    assert serve_kwargs(*argv) == expected
    for command in COMMANDS:
        args = build_parser().parse_args([*command, "--model", "m", *argv])
        kwargs = llm_kwargs(args, model="m")
        assert {k: kwargs[k] for k in expected} == expected, command
    LlmArgs(model="m", **expected)   # every key is an LLM argument


def test_peer_flags_combine_with_ours_and_the_config_file(tmp_path):
    path = tmp_path / "llm.yml"
    path.write_text("kv_cache_config:\n  tokens_per_block: 16\ncuda_graph_config:\n"
                    "  batch_sizes: [1, 2]\n")
    kwargs = serve_kwargs("--extra_llm_api_options", str(path), "--enforce-eager",
                          "--max-num-seqs", "4", "--gpu-memory-utilization", "0.7",
                          "--no-enable-prefix-caching")
    assert kwargs == {"max_batch_size": 4, "cuda_graph_config": None,
                      "kv_cache_config": {"tokens_per_block": 16, "gpu_memory_utilization": 0.7,
                                          "enable_block_reuse": False}}
    LlmArgs(model="m", **kwargs)


def test_serve_takes_the_seed_and_auto_tool_choice():
    assert serve_kwargs("--seed", "7", "--enable-auto-tool-choice") == {"seed": 7}
    assert build_parser().parse_args(["serve", "--enable-auto-tool-choice"]).run


def test_a_tokenizer_other_than_the_model_is_refused(tmp_path):
    (tmp_path / "model").mkdir()
    assert serve_kwargs("--tokenizer", "m") == {}
    model_dir = str(tmp_path / "model")
    args = build_parser().parse_args(["serve", model_dir, "--tokenizer", model_dir + "/."])
    assert llm_arguments(args)[0] == model_dir
    with pytest.raises(ValueError, match="--tokenizer 'other': tllm reads the tokenizer"):
        serve_kwargs("--tokenizer", "other")


def test_peer_values_outside_our_choices_exit_2(capsys):
    for argv in (["--dtype", "float64"], ["--kv-cache-dtype", "fp8_e5m2"],
                 ["--gpu-memory-utilization", "1.5"]):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["serve", *argv])
        assert info.value.code == 2
        assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("command", [["serve"], ["generate"], ["chat"], ["bench", "latency"]])
def test_help_lists_the_aliases_beside_our_flags(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    for alias, ours in FLAG_ALIASES.items():
        assert f"{ours} " in out and f", {alias} " in out, (command, alias)
    for flag in ("--gpu-memory-utilization", "--enable-prefix-caching", "--enforce-eager",
                 "--trust-remote-code", "--tokenizer", "half = float16"):
        assert flag in out, (command, flag)


def test_serve_help_says_what_it_ignores(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--enable-auto-tool-choice vLLM's: accepted and ignored" in out
    assert "--trust-remote-code vLLM's, trtllm-serve's: accepted and ignored" in out


def test_an_alias_does_not_replace_a_command_flag():
    parser = argparse.ArgumentParser()
    parser.add_argument("-q", dest="quiet", action="store_true")
    from tllm.llmapi.cli_args import add_engine_args
    add_engine_args(parser)
    assert parser.parse_args(["-q"]).quiet is True
    assert parser.parse_args(["--max-model-len", "9"]).max_seq_len == 9


# ---- LLM(...) keyword arguments ----

@pytest.mark.parametrize("given, expected", [
    ({"max_model_len": 64}, {"max_seq_len": 64}),
    ({"max_num_seqs": 3}, {"max_batch_size": 3}),
    ({"max_num_batched_tokens": 96}, {"max_num_tokens": 96}),
    ({"tensor_parallel_size": 2}, {"tensor_parallel_size": 2}),
    ({"gpu_memory_utilization": 0.5}, {"kv_cache_config": {"gpu_memory_utilization": 0.5}}),
    ({"enable_prefix_caching": False}, {"kv_cache_config": {"enable_block_reuse": False}}),
    ({"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_config": {"dtype": "fp8"}}),
    ({"dtype": "half"}, {"dtype": "float16"}),
    ({"enforce_eager": True}, {"cuda_graph_config": None}),
    ({"enforce_eager": False, "trust_remote_code": True, "tokenizer": "m"}, {}),
    ({"gpu_memory_utilization": 0.5, "kv_cache_config": {"tokens_per_block": 16}},
     {"kv_cache_config": {"tokens_per_block": 16, "gpu_memory_utilization": 0.5}}),
    ({"enable_prefix_caching": True, "kv_cache_config": KvCacheConfig(max_tokens=64)},
     {"kv_cache_config": {"max_tokens": 64, "enable_block_reuse": True}})])
def test_llm_takes_vllm_keywords(given, expected):
    assert resolve_llm_kwargs("m", given) == expected
    llm_args("m", given)   # and LlmArgs takes the result


@pytest.mark.parametrize("given, message", [
    ({"max_model_len": 64, "max_seq_len": 32},
     "max_model_len is vLLM's name for max_seq_len; give one of them"),
    ({"max_num_seqs": 2, "max_batch_size": 4}, "max_num_seqs is vLLM's name for max_batch_size"),
    ({"gpu_memory_utilization": 0.5, "kv_cache_config": {"gpu_memory_utilization": 0.4}},
     "gpu_memory_utilization is vLLM's name for kv_cache_config.gpu_memory_utilization"),
    ({"enable_prefix_caching": True,
      "kv_cache_config": KvCacheConfig(enable_block_reuse=False)},
     "enable_prefix_caching is vLLM's name for kv_cache_config.enable_block_reuse"),
    ({"enforce_eager": True, "cuda_graph_config": {"batch_sizes": [1]}}, "enforce_eager"),
    ({"tokenizer": "other"}, "LLM\\(\\): tokenizer 'other': tllm reads the tokenizer")])
def test_an_alias_with_its_own_name_is_a_value_error(given, message):
    with pytest.raises(ValueError, match=message):
        resolve_llm_kwargs("m", given)


@pytest.mark.parametrize("name, suggestion", [
    ("max_num_seq", "max_num_seqs"), ("max_seq_length", "max_seq_len"),
    ("kv_cache_cfg", "kv_cache_config"), ("tensor_parallel", "tensor_parallel_size")])
def test_an_unknown_keyword_names_the_closest(name, suggestion):
    with pytest.raises(ValueError) as info:
        LLM("m", **{name: 1})    # refused before any model is read
    assert type(info.value) is ValueError
    assert str(info.value) == (f"LLM(): unknown argument {name!r}; "
                               f"did you mean {suggestion!r}?")


def test_an_unknown_keyword_with_nothing_near():
    with pytest.raises(ValueError, match="^LLM\\(\\): unknown argument 'zzz'$"):
        llm_args("m", {"zzz": 1})


def test_gpu_memory_utilization_replaces_the_free_fraction():
    assert KvCacheConfig(gpu_memory_utilization=0.5).gpu_memory_utilization == 0.5
    with pytest.raises(ValueError, match="free_memory_fraction or gpu_memory_utilization"):
        KvCacheConfig(gpu_memory_utilization=0.5, free_memory_fraction=0.9)
    with pytest.raises(ValueError):
        KvCacheConfig(gpu_memory_utilization=1.5)


def test_a_tiny_model_built_with_vllm_keywords(tiny_llama):
    path, _ = tiny_llama
    with LLM(str(path), max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
             enable_prefix_caching=False, trust_remote_code=True, enforce_eager=True,
             kv_cache_config={"tokens_per_block": 4, "max_tokens": 256}) as llm:
        args = llm.args
    assert (args.max_seq_len, args.max_batch_size, args.max_num_tokens) == (64, 2, 32)
    assert not args.kv_cache_config.enable_block_reuse and args.cuda_graph_config is None
