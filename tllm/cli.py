"""The `tllm` command line: one-shot generation and an interactive chat over the LLM API.

Each subcommand is an `_add_<name>` (its arguments) and a `_run_<name>` (what it does); `serve`
and `bench` will slot in the same way.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from pydantic import ValidationError

from tllm import __version__
from tllm.llmapi.cli_args import add_engine_args, llm_kwargs
from tllm.llmapi.llm import LLM
from tllm.outputs import RequestOutput
from tllm.sampling_params import SamplingParams
from tllm.bench.offline_cli import add_bench_offline_parsers
from tllm.bench.serve_cli import add_bench_serve_parser
from tllm.loader import DEFAULT_MODEL
from tllm.serve.cli_args import FRONT_COMMANDS, add_serve_parser
from tllm.visual_gen.cli import add_visual_parser
from tllm.cli_parser import FlagParser
from tllm.cli_types import positive_int
from tllm.extras import MissingExtraError

# Errors caused by what the user typed (or did not install): printed as one line, no traceback.
USER_ERRORS = (ValueError, FileNotFoundError, MissingExtraError)
Messages = list[dict[str, Any]]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tllm` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    front = FRONT_COMMANDS.get(tuple(argv[:2]))
    try:
        if front is not None:   # `tllm serve disaggregated | router ...`: their own flags
            return front(argv[2:])
        args = build_parser().parse_args(argv)
        return args.run(args)
    except USER_ERRORS as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    # FlagParser: no prefix matching, peers' spellings, "did you mean" (its subparsers too)
    parser = FlagParser(prog="tllm", description="LLM inference with tllm.")
    parser.add_argument("--version", action="version", version=f"tllm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(commands)
    _add_chat(commands)
    add_serve_parser(commands)
    add_visual_parser(commands)
    bench = commands.add_parser("bench", help="run benchmarks",
                                description="Benchmarks; `tllm bench serve` loads a running "
                                "server.")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True,
                                          metavar="BENCHMARK")
    add_bench_serve_parser(bench_commands)
    add_bench_offline_parsers(bench_commands)
    return parser


# ---- generate ----

def _add_generate(commands) -> None:
    parser = commands.add_parser(
        "generate", help="complete prompts and print the answers",
        description="Complete one or more prompts (batched together) and print the answers; "
                    "timing goes to stderr.")
    parser.add_argument("--prompt", "-p", action="append", required=True,
                        help="a prompt; repeat the option for a batch")
    parser.add_argument("--n", type=positive_int, default=1, help="answers per prompt")
    parser.add_argument("--system", help="a system message (needs the chat template)")
    parser.add_argument("--no-chat-template", dest="use_chat_template", action="store_false",
                        help="send the prompt text as is, not as a chat user message")
    parser.add_argument("--stream", action="store_true",
                        help="print the (single) answer token by token as it is generated")
    _add_model_args(parser)
    _add_sampling_args(parser, max_tokens=128)
    parser.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    if args.stream and (len(args.prompt) > 1 or args.n > 1):
        raise ValueError("--stream prints one answer: give a single --prompt and --n 1")
    with _load_llm(args, max_batch_size=len(args.prompt) * args.n) as llm:
        params = _sampling_params(args, llm, n=args.n)
        prompts = [_prompt_input(llm, text, args.system, args.use_chat_template)
                   for text in args.prompt]
        start = time.perf_counter()
        if args.stream:
            outputs = [asyncio.run(_stream(llm, prompts[0], params))]
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    if not args.stream:
        _print_outputs(outputs)
    _print_stats(outputs, elapsed)
    return 0


def _prompt_input(llm: LLM, text: str, system: str | None, use_chat_template: bool):
    if use_chat_template and _has_chat_template(llm):
        return {"prompt": text, "prompt_token_ids": llm.tokenizer.encode_chat(
            _new_conversation(system) + [{"role": "user", "content": text}])}
    if system is not None:
        raise ValueError("--system needs the model's chat template")
    return text


def _print_outputs(outputs: list[RequestOutput]) -> None:
    is_labelled = len(outputs) > 1 or len(outputs[0].outputs) > 1
    for i, output in enumerate(outputs):
        for sample in output.outputs:
            if is_labelled:
                which = f", sample {sample.index + 1}" if len(output.outputs) > 1 else ""
                print(f"--- prompt {i + 1}{which} ---")
            print(sample.text)


def _print_stats(outputs: list[RequestOutput], elapsed: float) -> None:
    num_tokens = sum(len(sample.token_ids) for output in outputs for sample in output.outputs)
    num_prompts = len(outputs)
    print(f"{num_prompts} prompt{'s' if num_prompts != 1 else ''}, {num_tokens} output tokens "
          f"in {elapsed:.2f} s: {num_tokens / max(elapsed, 1e-9):.1f} tokens/s", file=sys.stderr)


# ---- chat ----

def _add_chat(commands) -> None:
    parser = commands.add_parser(
        "chat", help="chat interactively, one user line at a time",
        description="Chat with a model: each stdin line is a user message, the reply streams "
                    "to stdout. /reset clears the history; /exit, /quit, EOF or Ctrl-C end it.")
    parser.add_argument("--system", help="a system message at the start of the conversation")
    _add_model_args(parser)
    _add_sampling_args(parser, max_tokens=512)
    parser.set_defaults(run=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    with _load_llm(args, max_batch_size=1) as llm:
        params = _sampling_params(args, llm)
        if llm.tokenizer is None:
            raise ValueError(f"model {llm.args.model!r} has no tokenizer, so it cannot chat")
        if not _has_chat_template(llm):
            raise ValueError(f"model {llm.args.model!r} has no chat template; "
                             "try `tllm generate --no-chat-template`")
        _chat_loop(llm, params, args.system)
    return 0


def _chat_loop(llm: LLM, params: SamplingParams, system: str | None) -> None:
    history = _new_conversation(system)
    prompt = "> " if sys.stdin.isatty() else ""
    while True:
        try:
            line = input(prompt).strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            history = _new_conversation(system)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = _chat_turn(llm, history, params)
        except USER_ERRORS as exc:  # e.g. the conversation outgrew max_seq_len: try /reset
            history.pop()
            print(f"error: {_one_line(exc)}", file=sys.stderr)
            continue
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return
        history.append({"role": "assistant", "content": reply})


def _chat_turn(llm: LLM, history: Messages, params: SamplingParams) -> str:
    prompt = {"prompt_token_ids": llm.tokenizer.encode_chat(history)}
    return asyncio.run(_stream(llm, prompt, params)).outputs[0].text


def _new_conversation(system: str | None) -> Messages:
    return [{"role": "system", "content": system}] if system else []


# ---- shared ----

def _add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and engine", "these flags win over --config")
    group.add_argument("--model", "-m",
                       help=f"HF model directory, .gguf file, '{DEFAULT_MODEL}' (default) "
                            "or 'dummy:<preset>'")
    add_engine_args(group, help_text={
        "max_batch_size": "most sequences in flight (default: all the answers asked for)"})


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=positive_int, default=max_tokens,
                       help=f"most tokens per answer (default: {max_tokens})")
    group.add_argument("--temperature", "-t", type=float,
                       help="default: the model's generation_config.json value (see "
                            "--generation-config), else 0: greedy, so answers are "
                            "reproducible")
    group.add_argument("--top-k", type=int, help="default: the model's, else -1 (off)")
    group.add_argument("--top-p", type=float, help="default: the model's, else 1.0 (off)")
    group.add_argument("--seed", type=int, help="seed for sampling and dummy weights")


# The CLI's own sampling defaults, under the model's (LLM.sampling_defaults) and the flags.
_CLI_SAMPLING = {"temperature": 0.0, "top_k": -1, "top_p": 1.0}


def _sampling_params(args: argparse.Namespace, llm: LLM, n: int = 1) -> SamplingParams:
    given = {name: value for name in _CLI_SAMPLING
             if (value := getattr(args, name)) is not None}
    return SamplingParams(max_tokens=args.max_tokens, seed=args.seed, n=n,
                          **{**_CLI_SAMPLING, **llm.sampling_defaults, **given})


def _load_llm(args: argparse.Namespace, max_batch_size: int) -> LLM:
    # A CLI run knows how many sequences it will ever hold; telling the engine keeps the
    # default KV cache from taking all the memory it is allowed.
    kwargs = llm_kwargs(args, model=args.model, defaults={"max_batch_size": max_batch_size})
    if args.seed is not None:  # --seed is a sampling flag that also seeds dummy weights
        kwargs["seed"] = args.seed
    start = time.perf_counter()
    llm = LLM(**kwargs)
    print(f"loaded {kwargs['model']} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return llm


async def _stream(llm: LLM, prompt, params: SamplingParams) -> RequestOutput:
    """Print one answer's new text as it arrives; returns the final output."""
    result = llm.generate_async(prompt, params, streaming=True)
    output = None
    try:
        async for output in result:
            print(output.outputs[0].text_diff, end="", flush=True)
    finally:
        if not result.finished:  # cancelled (Ctrl-C): stop the request in the engine too
            result.abort()
    print(flush=True)
    return output


def _has_chat_template(llm: LLM) -> bool:
    tokenizer = llm.tokenizer
    return tokenizer is not None and tokenizer.has_chat_template




def _one_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
