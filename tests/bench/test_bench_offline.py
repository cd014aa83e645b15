"""`tllm bench throughput | latency` run in-process on a tiny random Llama on the CPU: exit
status, the printed table, the JSON figures, engine options, concurrency and time limits."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from tllm.bench.offline import synthetic_prompts
from tllm.bench.offline_cli import add_bench_offline_parsers

ISL, OSL = 8, 4


def bench(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tllm bench")
    add_bench_offline_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.run(args)


@pytest.fixture()
def model(tiny_llama) -> str:
    return str(tiny_llama[0])


def sizes(model: str) -> list[str]:
    return ["--model", model, "--isl", str(ISL), "--osl", str(OSL)]


@pytest.fixture()
def bars_allowed(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)


def test_throughput_prints_table_and_writes_json(model, tmp_path, capsys, bars_allowed):
    out = tmp_path / "throughput.json"
    assert bench("throughput", *sizes(model), "--num-requests", "6", "--json", str(out)) == 0
    printed, err = capsys.readouterr()
    # progress on stderr: loading, warm-up, the timed requests
    assert "Loading weights: 100%" in err
    assert "Warm-up: 100%" in err and "2/2" in err
    assert "Requests: 100%" in err and "6/6" in err
    for label in ("tllm bench throughput", "Output tokens/s", "Total tokens/s", "Requests/s",
                  "TTFT", "TPOT", "ITL", "max load"):
        assert label in printed
    result = json.loads(out.read_text())
    assert result["num_completed"] == 6 and result["num_incomplete"] == 0
    assert not result["is_truncated"] and result["num_wrong_length"] == 0
    assert result["total_input_tokens"] == 6 * ISL
    assert result["total_output_tokens"] == 6 * OSL
    assert result["output_tokens_per_s"] == pytest.approx(6 * OSL / result["duration_s"])
    assert result["max_in_flight"] == 6
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(result[name]) == {"mean", "p50", "p90", "p99"}
        # ITL is timed where the tokens arrive: on a loaded machine a request's 4 tokens can
        # come in one merged delta, leaving no gap to measure (p50 None) in a short run
        p50 = result[name]["p50"]
        assert (p50 is None and name == "itl_ms") or (p50 is not None and p50 > 0), \
            (name, result[name])
    assert result["peak_gpu_memory_gib"] is None
    assert result["engine"]["resolved"]["device"] == "cpu"
    assert result["engine"]["max_seq_len"] >= ISL + OSL


def test_throughput_keeps_at_most_concurrency_in_flight(model, tmp_path):
    out = tmp_path / "throughput.json"
    assert bench("throughput", *sizes(model), "--num-requests", "6", "--concurrency", "2",
                 "--warmup", "0", "--json", str(out)) == 0
    result = json.loads(out.read_text())
    assert result["max_in_flight"] == 2
    assert result["total_output_tokens"] == 6 * OSL


def test_throughput_time_limit_aborts_and_says_so(model, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert bench("throughput", *sizes(model), "--osl", "24", "--num-requests", "300",
                 "--concurrency", "4", "--time-limit", "0.05", "--json", str(out)) == 0
    assert "time limit 0.05 s hit" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["is_truncated"]
    assert result["num_completed"] < 300
    assert result["num_incomplete"] == 300 - result["num_completed"]


def test_latency_prints_table_and_writes_json(model, tmp_path, capsys, bars_allowed):
    out = tmp_path / "latency.json"
    assert bench("latency", *sizes(model), "--batch-size", "3", "--iterations", "2",
                 "--json", str(out)) == 0
    printed, err = capsys.readouterr()
    assert "Iterations: 100%" in err and "3/3" in err   # 1 warm-up + 2 timed
    for label in ("tllm bench latency", "Latency (s), median", "Output tokens/s, median",
                  "TTFT (ms), median", "TPOT (ms), median"):
        assert label in printed
    result = json.loads(out.read_text())
    assert result["num_iterations"] == 2 and len(result["per_iteration"]) == 2
    assert all(it["num_output_tokens"] == 3 * OSL for it in result["per_iteration"])
    assert result["num_wrong_length"] == 0
    assert result["engine"]["max_batch_size"] == 3
    for key in ("latency_s", "output_tokens_per_s", "ttft_ms", "tpot_ms"):
        assert result[key] > 0


def test_disable_tqdm_turns_the_bars_off(model, capsys, bars_allowed):
    assert bench("throughput", *sizes(model), "--num-requests", "2", "--warmup", "0",
                 "--disable-tqdm") == 0
    err = capsys.readouterr().err
    assert "Requests" not in err and "Loading weights" in err   # the engine's own bar


def test_extra_llm_api_options_reach_the_engine_and_flags_win(model, tmp_path):
    options = tmp_path / "extra.yml"
    options.write_text("max_batch_size: 2\nenable_chunked_prefill: false\n"
                       "kv_cache_config:\n  tokens_per_block: 16\n")
    out = tmp_path / "latency.json"
    assert bench("latency", *sizes(model), "--iterations", "1", "--warmup", "0",
                 "--extra-llm-api-options", str(options), "--max-batch-size", "4",
                 "--kv-cache-free-memory-fraction", "0.5", "--json", str(out)) == 0
    engine = json.loads(out.read_text())["engine"]
    assert engine["max_batch_size"] == 4
    assert engine["enable_chunked_prefill"] is False
    assert engine["kv_cache_config"]["tokens_per_block"] == 16
    assert engine["kv_cache_config"]["free_memory_fraction"] == 0.5
    assert engine["max_seq_len"] == 16  # ISL + OSL, rounded up to whole blocks


@pytest.mark.parametrize("text, message", [("- 1\n- 2\n", "mapping"),
                                           ("no_such_option: 1\n", "no_such_option")])
def test_bad_extra_llm_api_options_are_user_errors(model, tmp_path, text, message):
    options = tmp_path / "extra.yml"
    options.write_text(text)
    with pytest.raises(ValueError, match=message):
        bench("latency", *sizes(model), "--extra-llm-api-options", str(options))


def test_the_model_may_come_from_the_yaml_and_the_flag_wins(model, tmp_path):
    options = tmp_path / "extra.yml"
    out = tmp_path / "latency.json"
    options.write_text(f"model: {model}\n")
    assert bench("latency", "--isl", str(ISL), "--osl", str(OSL), "--iterations", "1",
                 "--warmup", "0", "--extra-llm-api-options", str(options),
                 "--json", str(out)) == 0
    assert json.loads(out.read_text())["model"] == model
    options.write_text("model: /no/such/model\n")
    assert bench("latency", *sizes(model), "--iterations", "1", "--warmup", "0",
                 "--config", str(options)) == 0


@pytest.mark.parametrize("argv, message", [
    (["--max-seq-len", "10"], "max_seq_len"),
    (["--batch-size", "4", "--max-batch-size", "2"], "max_batch_size")])
def test_shapes_the_engine_cannot_run_are_user_errors(model, argv, message):
    with pytest.raises(ValueError, match=message):
        bench("latency", *sizes(model), *argv)


def test_synthetic_prompts_have_exact_lengths_within_the_vocabulary():
    prompts = synthetic_prompts(5, 7, 11, torch.Generator().manual_seed(0))
    assert len(prompts) == 5
    for prompt in prompts:
        ids = prompt["prompt_token_ids"]
        assert len(ids) == 7 and all(0 <= t < 11 for t in ids)
