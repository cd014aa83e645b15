"""The prompts `tllm bench serve` sends: random token ids, the first turns of ShareGPT-format
conversations (JSON), or the prompts of a JSONL file; and the client-side tokenizer that
measures ShareGPT's lengths (and turns random ids into text for the chat endpoint)."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "sharegpt", "jsonl")
DATASET_ALIASES = {"custom": "jsonl"}   # vLLM's name for a JSONL file of prompts
DEFAULT_NUM_PROMPTS = 100               # random and sharegpt; jsonl: every line
DEFAULT_OUTPUT_LEN = 128                # random, and a JSONL line that names none
# ShareGPT conversations kept, as vLLM's benchmarks keep them (tokens): a prompt and an
# answer of at least MIN_LEN (the answer's length is not checked when --output-len is
# given), a prompt of at most MAX_PROMPT_LEN, prompt and answer together at most MAX_TOTAL_LEN.
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: token ids (the random dataset) or text, and its output length."""

    prompt: list[int] | str
    max_tokens: int
    num_prompt_tokens: int | None = None   # None: as the server's usage reports

    def __post_init__(self) -> None:
        if self.num_prompt_tokens is None and isinstance(self.prompt, list):
            object.__setattr__(self, "num_prompt_tokens", len(self.prompt))


def random_prompts(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   vocab_size: int, seed: int) -> list[BenchRequest]:
    """Prompts of random token ids; lengths vary by range_ratio around the given ones
    (exactly those when it is 0)."""
    rng = random.Random(seed)

    def length(target: int) -> int:
        spread = int(target * range_ratio)
        return max(1, rng.randint(target - spread, target + spread))

    return [BenchRequest([rng.randrange(vocab_size) for _ in range(length(input_len))],
                         length(output_len)) for _ in range(num_prompts)]


def as_text(requests: list[BenchRequest], tokenizer) -> list[BenchRequest]:
    """Token-id prompts decoded to text (a chat message holds text); lengths then are as
    the server counts them."""
    return [BenchRequest(tokenizer.decode(r.prompt), r.max_tokens)
            if isinstance(r.prompt, list) else r for r in requests]


def sharegpt_prompts(path: str | Path, num_prompts: int | None, tokenizer,
                     output_len: int | None = None, seed: int = 0) -> list[BenchRequest]:
    """First human turns of ShareGPT conversations, in an order shuffled by `seed`; each
    asks for as many tokens as its first answer has (or `output_len`). Too short or too
    long ones are skipped (MIN_LEN ...). Fewer than `num_prompts` usable is an error; None
    takes up to DEFAULT_NUM_PROMPTS."""
    pairs = _sharegpt_pairs(path)
    random.Random(seed).shuffle(pairs)
    wanted = num_prompts or DEFAULT_NUM_PROMPTS
    requests = []
    for prompt, answer in pairs:
        if len(requests) == wanted:
            break
        num_prompt_tokens = len(tokenizer.encode(prompt))
        num_output = output_len or len(tokenizer.encode(answer))
        if _is_kept(num_prompt_tokens, num_output, check_output=output_len is None):
            requests.append(BenchRequest(prompt, num_output, num_prompt_tokens))
    if num_prompts is not None and len(requests) < num_prompts:
        raise ValueError(f"--dataset-path {path}: {len(requests)} conversations fit the "
                         f"length limits, fewer than --num-prompts {num_prompts}")
    if not requests:
        raise ValueError(f"--dataset-path {path}: no conversation fits the length limits "
                         f"(prompt {MIN_LEN}-{MAX_PROMPT_LEN} tokens, with the answer at "
                         f"most {MAX_TOTAL_LEN})")
    return requests


def _is_kept(num_prompt_tokens: int, num_output: int, check_output: bool) -> bool:
    return (MIN_LEN <= num_prompt_tokens <= MAX_PROMPT_LEN
            and (num_output >= MIN_LEN or not check_output)
            and num_prompt_tokens + num_output <= MAX_TOTAL_LEN)


def _sharegpt_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, the answer after it) of every conversation with both."""
    data = _read_json(path)
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a ShareGPT JSON list of "
                         '{"conversations": [...]} objects')
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if (isinstance(first, dict) and isinstance(second, dict)
                and first.get("from") == "human" and isinstance(first.get("value"), str)
                and isinstance(second.get("value"), str)):
            pairs.append((first["value"], second["value"]))
    return pairs


def _read_json(path: str | Path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"--dataset-path: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--dataset-path {path}: not valid JSON: {exc}") from None


def jsonl_prompts(path: str | Path, num_prompts: int | None,
                  output_len: int | None = None) -> list[BenchRequest]:
    """The first `num_prompts` lines (None: all) of a file of JSON objects, one a line:
    "prompt" (text), and optionally "output_len" or "max_tokens"; `output_len` overrides
    them, DEFAULT_OUTPUT_LEN stands in where a line has neither."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except OSError as exc:
        raise ValueError(f"--dataset-path: cannot read {path}: {exc.strerror}") from None
    if num_prompts is not None and len(lines) < num_prompts:
        raise ValueError(f"--dataset-path {path}: {len(lines)} prompts, fewer than "
                         f"--num-prompts {num_prompts}")
    if not lines:
        raise ValueError(f"--dataset-path {path}: no prompts (expected one JSON object a "
                         'line, like {"prompt": "...", "output_len": 64})')
    return [_jsonl_request(path, n, line, output_len) for n, line in lines[:num_prompts]]


def _jsonl_request(path, line_number: int, line: str, output_len: int | None) -> BenchRequest:
    where = f"--dataset-path {path}, line {line_number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
        raise ValueError(f'{where}: expected an object with a "prompt" string')
    length = output_len or item.get("output_len", item.get("max_tokens", DEFAULT_OUTPUT_LEN))
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"{where}: output_len / max_tokens must be a positive integer, "
                         f"got {length!r}")
    return BenchRequest(item["prompt"], length)


def load_tokenizer(name: str):
    """The tokenizer of a model name as `tllm serve` takes it: 'smollm2', a .gguf file, an
    HF folder or a hub id (its tokenizer files only, not the weights)."""
    from tllm.loader import DEFAULT_MODEL
    from tllm.loader import load_tokenizer as model_tokenizer
    from tllm.loader import resolve_model
    from tllm.loader.hub import looks_like_hub_id
    from tllm.tokenizer import Tokenizer
    local = Path(name).expanduser()
    if name != DEFAULT_MODEL and not local.exists() and not looks_like_hub_id(name):
        raise ValueError(f"--tokenizer {name!r}: no such file or folder, nor a hub id")
    try:
        if name == DEFAULT_MODEL or name.endswith(".gguf"):
            tokenizer = model_tokenizer(resolve_model(name))
        else:
            tokenizer = Tokenizer.from_pretrained(str(local) if local.exists() else name)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer {name!r}: cannot load a tokenizer ({exc}); name "
                         "the served model's folder, .gguf file or hub id") from None
    if tokenizer is None:
        raise ValueError(f"--tokenizer {name!r}: the model has no tokenizer")
    return tokenizer
