"""The parser of every `tllm` command line: no prefix matching, TensorRT-LLM's underscore
spellings, and "did you mean" for an unknown flag (exit 2), down the subcommands and in the
fronts (`tllm serve router | disaggregated`) with parsers of their own."""
from __future__ import annotations

import argparse

import pytest

from tllm.cli import build_parser, main
from tllm.cli_parser import FlagParser


def every_parser(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from every_parser(sub)


def errors_of(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_no_parser_matches_prefixes():
    parsers = list(every_parser(build_parser()))
    assert len(parsers) > 8     # tllm, generate, chat, serve, visual, bench and its three
    for parser in parsers:
        assert isinstance(parser, FlagParser) and not parser.allow_abbrev, parser.prog


@pytest.mark.parametrize("argv", [
    ["serve", "--max-num-token", "5"],
    ["generate", "-p", "hi", "--max-num-token", "5"],
    ["bench", "throughput", "--max-num-token=5"],
    ["bench", "latency", "--max_num_token", "5"]])   # respelled, then still unknown
def test_an_abbreviation_is_refused_with_a_suggestion(argv, capsys):
    err = errors_of(capsys, argv)
    assert "unrecognized arguments: --max" in err
    assert "(did you mean --max-num-tokens?)" in err


def test_each_unknown_flag_gets_its_own_suggestion(capsys):
    err = errors_of(capsys, ["serve", "--max-model-length", "9", "--gpu-mem-utilization", "1"])
    assert ("did you mean --max-model-len for --max-model-length, --gpu-memory-utilization "
            "for --gpu-mem-utilization?") in err


def test_nothing_near_means_no_suggestion(capsys):
    err = errors_of(capsys, ["chat", "--zzzzzz"])
    assert "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err


def test_a_suggestion_comes_from_the_subcommand_typed(capsys):
    # --max-concurrency is `bench serve`'s; `bench throughput` has --concurrency
    err = errors_of(capsys, ["bench", "throughput", "--max-concurency", "4"])
    assert "did you mean --concurrency?" in err


def test_underscore_spellings_of_our_flags():
    args = build_parser().parse_args(["bench", "latency", "--max_seq_len", "64", "--batch_size",
                                      "3", "--tp_size=2", "--extra_llm_api_options", "x.yml"])
    assert (args.max_seq_len, args.batch_size, args.tensor_parallel_size) == (64, 3, 2)
    assert (args.config, args.config_flag) == ("x.yml", "--extra-llm-api-options")


def test_values_after_a_double_dash_are_not_respelled():
    parser = FlagParser()
    parser.add_argument("--max-batch-size")
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args(["--max_batch_size", "2", "--", "--max_batch_size"])
    assert args.max_batch_size == "2" and args.rest == ["--max_batch_size"]


def test_parse_known_args_leaves_no_trace_when_all_is_known():
    namespace, extras = build_parser().parse_known_args(["chat", "--max-tokens", "3"])
    assert extras == [] and not hasattr(namespace, "_flag_hints")


def test_help_says_underscores_work(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--flag_name" in capsys.readouterr().out


@pytest.mark.parametrize("argv, hint", [
    (["serve", "router", "--replica", "http://a", "--polcy", "round_robin"], "--policy"),
    (["serve", "disaggregated", "-c", "d.yml", "--prot", "8000"], "--port")])
def test_the_fronts_suggest_too(argv, hint, capsys):
    assert f"did you mean {hint}?" in errors_of(capsys, argv)


def test_the_fronts_refuse_abbreviations(capsys):
    err = errors_of(capsys, ["serve", "router", "--replica", "http://a", "--pol", "x"])
    assert "unrecognized arguments: --pol" in err
