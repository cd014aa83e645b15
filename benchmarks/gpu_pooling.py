"""Issue 36's H200 figure: embeddings per second at batch 256 with 512-token inputs, through
LLM.embed, against sentence-transformers' `encode` on the same GPU in the same run, for two
random models saved in-process with a sentence-transformers layout (as tests/pooling does):

  bert    BERT-base-shaped BertModel (12 x 768), CLS pooling, normalised
  qwen3   Qwen3-Embedding-0.6B-shaped Qwen3Model (28 x 1024), last-token pooling, normalised

Both run in bf16; the two sides' embeddings must agree (mean and minimum cosine printed;
`agree` is min cosine > 0.999). sentence-transformers runs first and is freed before the
engine takes its memory share. tllm runs once per step token budget (--budgets: the
engine's max_num_tokens; the first is the earlier runs' 16,384, the others let one step
take 64 or 128 of the 512-token texts). Unless --no-profile, one `LLM.embed` call at the
first budget (on token ids: no tokenizer) and one sentence-transformers `encode` run under
torch.profiler: wall time against the GPU's busy time, kernels by category, and for tllm the
engine steps and the host time spent launching each (the executor's `_launch`), so the
figures say whether the gap is the host's or the kernels'. Results go to $OUT/pooling.json.

    python benchmarks/gpu_pooling.py [--models bert,qwen3] [--budgets 16384,32768,65536]
        [--budget 280] [--no-profile]
    python benchmarks/gpu_pooling.py --tiny      # the plumbing on the CPU, tiny models
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests" / "pooling"))
sys.path.insert(0, str(HERE))

from gpu_common import profile_call  # noqa: E402
from tiny_models import (WORDS, add_sentence_transformers_layout, save_bert,  # noqa: E402
                         save_qwen3)

# (BERT's vocabulary stays the small tokenizer's: a lookup table, no compute)
BERT_BASE = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, max_position_embeddings=512, initializer_range=0.02)
QWEN3_EMBEDDING_06B = dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072,
                           num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                           head_dim=128, max_position_embeddings=32768, rope_theta=1e6,
                           tie_word_embeddings=True)
MODELS = {"bert": ("cls", BERT_BASE), "qwen3": ("lasttoken", QWEN3_EMBEDDING_06B)}
AGREE_COSINE = 0.999


def save_model(name: str, tiny: bool) -> Path:
    """The random model `name` in a temporary folder with its sentence-transformers layout."""
    pooling, shape = MODELS[name]
    path = Path(tempfile.mkdtemp()) / name
    if name == "bert":
        save_bert(path, "BertModel", **({} if tiny else shape))
    else:
        save_qwen3(path, "Qwen3Model", **({} if tiny else shape))
    add_sentence_transformers_layout(path, pooling, normalize=True)
    return path


def texts_of_length(path: Path, count: int, num_tokens: int) -> list[str]:
    """`count` random texts that tokenize (special tokens included) to exactly `num_tokens`
    tokens: words that are one token alone and after a space (both tokenizers split on
    spaces first, so their counts add up)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    def one_token(text: str) -> bool:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 1
    singles = [w for w in dict.fromkeys(WORDS) if one_token(w) and one_token(" " + w)]
    specials = len(tokenizer("")["input_ids"])
    if not singles or num_tokens <= specials:
        raise ValueError(f"no texts of {num_tokens} tokens from these words")
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(singles, num_tokens - specials)) for _ in range(count)]
    lengths = {len(ids) for ids in tokenizer(texts)["input_ids"]}
    if lengths != {num_tokens}:
        raise ValueError(f"texts of {sorted(lengths)} tokens, not {num_tokens}")
    return texts


def timed(fn, budget_s: float, max_repeats: int = 5) -> tuple[list, float, int]:
    """Run fn() once to warm up, then repeatedly (once at least, up to max_repeats times
    while the budget lasts); returns (the last result, mean seconds per call, repeats)."""
    fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start, repeats = time.perf_counter(), 0
    while True:
        result = fn()
        sync()
        repeats += 1
        elapsed = time.perf_counter() - start
        if repeats >= max_repeats or elapsed + elapsed / repeats > budget_s:
            return result, elapsed / repeats, repeats


def run_sentence_transformers(path: Path, texts: list[str], device: str, dtype: torch.dtype,
                              budget_s: float, profile: bool) -> tuple[np.ndarray, dict]:
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(str(path), device=device).to(dtype)
    encode = lambda: model.encode(texts, batch_size=len(texts),  # noqa: E731
                                  convert_to_numpy=False, convert_to_tensor=True)
    out, seconds, repeats = timed(encode, budget_s)
    embeddings = out.float().cpu().numpy()
    result = {"seconds_per_batch": seconds, "repeats": repeats,
              "embeddings_per_s": len(texts) / seconds}
    if profile:
        result["profile"] = profile_call(encode, torch.device(device))
    del model, out
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return embeddings, result


def run_engine(path: Path, texts: list[str], args, budget_s: float, max_num_tokens: int,
               profile: bool) -> tuple[np.ndarray, dict]:
    from tllm import LLM
    kwargs = {"dtype": "float32", "device": "cpu"} if args.tiny else {"dtype": "bfloat16"}
    with LLM(str(path), max_batch_size=len(texts), max_num_tokens=max_num_tokens,
             max_seq_len=args.tokens, **kwargs) as llm:
        embed = lambda: llm.embed(texts)  # noqa: E731
        outputs, seconds, repeats = timed(embed, budget_s)
        result = {"max_num_tokens": max_num_tokens, "seconds_per_batch": seconds,
                  "repeats": repeats, "embeddings_per_s": len(texts) / seconds}
        if profile:
            result["profile"] = engine_profile(llm, path, texts)
    embeddings = np.array([o.embedding for o in outputs], dtype=np.float32)
    return embeddings, result


def engine_profile(llm, path: Path, texts: list[str]) -> dict:
    """One embed call on token ids under the profiler, the executor's launch of each step
    timed on the host; and the same call unprofiled (its cost without the tokenizer)."""
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(path)(texts)["input_ids"]
    _, ids_seconds, _ = timed(lambda: llm.embed(ids), budget_s=5.0, max_repeats=3)
    executor = llm._engine.executor
    launches: list[float] = []
    real = executor._launch

    def timed_launch(batch) -> None:
        started = time.perf_counter()
        real(batch)
        launches.append(time.perf_counter() - started)
    first_step = executor.num_steps
    executor._launch = timed_launch   # the executor thread looks it up on each step
    try:
        profile = profile_call(lambda: llm.embed(ids), llm._engine.device)
    finally:
        executor._launch = real
    steps = executor.num_steps - first_step
    profile.update({"embed_ids_seconds": ids_seconds, "steps": steps,
                    "launch_host_ms_total": sum(launches) * 1e3,
                    "launch_host_ms_per_step": sum(launches) * 1e3 / max(steps, 1),
                    "gpu_busy_ms_per_step": profile["gpu_busy_ms"] / max(steps, 1)})
    return profile


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def part_model(name: str, args, budget_s: float) -> dict:
    t0 = time.perf_counter()
    path = save_model(name, args.tiny)
    texts = texts_of_length(path, args.batch, args.tokens)
    print(f"[{name}] saved and {len(texts)} texts of {args.tokens} tokens in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    left = budget_s - (time.perf_counter() - t0)
    st_emb, st = run_sentence_transformers(path, texts, device, dtype, left * 0.25,
                                           args.profile)
    print(f"[{name}] sentence-transformers {st['embeddings_per_s']:.1f} emb/s", flush=True)
    result = {"sentence_transformers": st, "tllm": {}}
    for i, max_num_tokens in enumerate(args.budgets):
        left = budget_s - (time.perf_counter() - t0)
        try:
            ours_emb, ours = run_engine(path, texts, args, left * 0.6 / (len(args.budgets) - i),
                                        max_num_tokens, args.profile and i == 0)
        except Exception as exc:  # a larger budget may not fit: the others still count
            result["tllm"][max_num_tokens] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{name}] budget {max_num_tokens} failed: {exc}", flush=True)
            continue
        cos = cosines(ours_emb, st_emb)
        ours.update(speedup=ours["embeddings_per_s"] / st["embeddings_per_s"],
                    cosine_mean=float(cos.mean()), cosine_min=float(cos.min()),
                    agree=bool(cos.min() > AGREE_COSINE))
        result["tllm"][max_num_tokens] = ours
        print(f"[{name}] tllm, max_num_tokens {max_num_tokens}: {ours['embeddings_per_s']:.1f} "
              f"emb/s ({ours['speedup']:.2f}x); cosine mean {ours['cosine_mean']:.6f} min "
              f"{ours['cosine_min']:.6f} agree={ours['agree']}", flush=True)
    return result


def profile_lines(name: str, r: dict) -> list[str]:
    """Where one batch's time goes, tllm (first budget) against sentence-transformers."""
    lines = []
    ours = next((v["profile"] for v in r["tllm"].values() if "profile" in v), None)
    theirs = r["sentence_transformers"].get("profile")
    for side, p in (("tllm", ours), ("ST", theirs)):
        if p is None:
            continue
        cats = ", ".join(f"{k.split(' ')[0]} {v:.1f}" for k, v in p["category_ms"].items())
        line = (f"{name:<7}{side:<5} wall {p['wall_ms']:.1f} ms, GPU busy {p['gpu_busy_ms']:.1f}"
                f" ms ({cats}), {p['num_kernels']} kernels")
        if side == "tllm":
            line += (f"; {p['steps']} steps, host launch {p['launch_host_ms_per_step']:.1f} ms"
                     f" a step, GPU {p['gpu_busy_ms_per_step']:.1f} ms a step; unprofiled on"
                     f" ids {p['embed_ids_seconds'] * 1e3:.1f} ms")
        lines.append(line)
    return lines


def summary(results: dict) -> str:
    lines = [f"pooling: batch {results['meta']['batch']} x {results['meta']['tokens']} tokens "
             f"on {results['meta']['device']}",
             f"{'model':<7}{'budget':>8}{'tllm emb/s':>12}{'ST emb/s':>10}{'speedup':>9}"
             f"{'cos min':>10}"]
    profiles = []
    for name, r in results.items():
        if name == "meta":
            continue
        if "error" in r:
            lines.append(f"{name:<7} error: {r['error'][:200]}")
            continue
        st = r["sentence_transformers"]["embeddings_per_s"]
        for budget, ours in r["tllm"].items():
            if "error" in ours:
                lines.append(f"{name:<7}{budget:>8} error: {ours['error'][:160]}")
                continue
            lines.append(f"{name:<7}{budget:>8}{ours['embeddings_per_s']:>12.1f}{st:>10.1f}"
                         f"{ours['speedup']:>8.2f}x{ours['cosine_min']:>10.5f}")
        profiles += profile_lines(name, r)
    return "\n".join(lines + profiles)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert,qwen3")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--budgets", default="16384,32768,65536",
                        help="the engine's token budgets per step (max_num_tokens), one run each")
    parser.add_argument("--budget", type=float, default=280.0, help="seconds for all models")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    args.budgets = [int(b) for b in args.budgets.split(",")]
    if args.tiny:
        args.batch, args.tokens, args.budgets = 8, 64, [128, 256]
        args.budget = min(args.budget, 30.0)
    out_dir = Path(os.environ.get("OUT") or "/tmp/gpu_pooling")
    out_dir.mkdir(parents=True, exist_ok=True)
    names = args.models.split(",")
    results = {"meta": {"date": datetime.date.today().isoformat(), "argv": sys.argv,
                        "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                        else "cpu", "torch": torch.__version__, "batch": args.batch,
                        "tokens": args.tokens, "dtype": "float32" if args.tiny else "bfloat16"}}
    end = time.perf_counter() + args.budget
    for i, name in enumerate(names):
        share = (end - time.perf_counter()) / (len(names) - i)
        try:
            results[name] = part_model(name, args, share)
        except Exception as exc:  # one model's failure must not cost the other's figure
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{name}] failed: {results[name]['error']}", flush=True)
        (out_dir / "pooling.json").write_text(json.dumps(results, indent=1, default=str))
    print(summary(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
