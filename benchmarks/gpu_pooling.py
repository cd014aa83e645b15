"""Issue 36's H200 figure: embeddings per second at batch 256 with 512-token inputs, through
LLM.embed, against sentence-transformers' `encode` on the same GPU in the same run, for two
random models saved in-process with a sentence-transformers layout (as tests/pooling does):

  bert    BERT-base-shaped BertModel (12 x 768), CLS pooling, normalised
  qwen3   Qwen3-Embedding-0.6B-shaped Qwen3Model (28 x 1024), last-token pooling, normalised

Both run in bf16; the two sides' embeddings must agree (mean and minimum cosine printed;
`agree` is min cosine > 0.999). sentence-transformers runs first and is freed before the
engine takes its memory share. Results go to $OUT/pooling.json.

    python benchmarks/gpu_pooling.py [--models bert,qwen3] [--budget 280]
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
                              budget_s: float) -> tuple[np.ndarray, dict]:
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(str(path), device=device).to(dtype)
    encode = lambda: model.encode(texts, batch_size=len(texts),  # noqa: E731
                                  convert_to_numpy=False, convert_to_tensor=True)
    out, seconds, repeats = timed(encode, budget_s)
    embeddings = out.float().cpu().numpy()
    del model, out
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return embeddings, {"seconds_per_batch": seconds, "repeats": repeats,
                        "embeddings_per_s": len(texts) / seconds}


def run_engine(path: Path, texts: list[str], args, budget_s: float) -> tuple[np.ndarray, dict]:
    from tllm import LLM
    kwargs = {"dtype": "float32", "device": "cpu"} if args.tiny else {"dtype": "bfloat16"}
    with LLM(str(path), max_batch_size=len(texts), max_num_tokens=args.max_num_tokens,
             max_seq_len=args.tokens, **kwargs) as llm:
        embed = lambda: llm.embed(texts)  # noqa: E731
        outputs, seconds, repeats = timed(embed, budget_s)
    embeddings = np.array([o.embedding for o in outputs], dtype=np.float32)
    return embeddings, {"seconds_per_batch": seconds, "repeats": repeats,
                        "embeddings_per_s": len(texts) / seconds}


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
    st_emb, st = run_sentence_transformers(path, texts, device, dtype, left * 0.3)
    print(f"[{name}] sentence-transformers {st['embeddings_per_s']:.1f} emb/s", flush=True)
    left = budget_s - (time.perf_counter() - t0)
    ours_emb, ours = run_engine(path, texts, args, left * 0.5)
    cos = cosines(ours_emb, st_emb)
    result = {"sentence_transformers": st, "tllm": ours,
              "speedup": ours["embeddings_per_s"] / st["embeddings_per_s"],
              "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
              "agree": bool(cos.min() > AGREE_COSINE)}
    print(f"[{name}] tllm {ours['embeddings_per_s']:.1f} emb/s ({result['speedup']:.2f}x); "
          f"cosine mean {result['cosine_mean']:.6f} min {result['cosine_min']:.6f} "
          f"agree={result['agree']}", flush=True)
    return result


def summary(results: dict) -> str:
    lines = [f"pooling: batch {results['meta']['batch']} x {results['meta']['tokens']} tokens "
             f"on {results['meta']['device']}",
             f"{'model':<7}{'tllm emb/s':>12}{'ST emb/s':>10}{'speedup':>9}{'cos min':>10}"]
    for name, r in results.items():
        if name == "meta":
            continue
        if "error" in r:
            lines.append(f"{name:<7} error: {r['error'][:200]}")
            continue
        lines.append(f"{name:<7}{r['tllm']['embeddings_per_s']:>12.1f}"
                     f"{r['sentence_transformers']['embeddings_per_s']:>10.1f}"
                     f"{r['speedup']:>8.2f}x{r['cosine_min']:>10.5f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert,qwen3")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--max-num-tokens", type=int, default=16384,
                        help="the engine's token budget per step")
    parser.add_argument("--budget", type=float, default=280.0, help="seconds for all models")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.batch, args.tokens, args.max_num_tokens = 8, 64, 128
        args.budget = min(args.budget, 20.0)
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
