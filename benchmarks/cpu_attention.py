"""CPU attention over the paged cache: the per-sequence loop (`paged_attention_ref`, the old
path) against the batched path (`paged_attention_batched`, what TorchAttentionBackend runs),
on SmolLM2's shapes (30 layers, 9 query heads, 3 kv heads, head dim 64, fp32, 32-token
blocks), in the same run, alternating, median of --repeats.

    python benchmarks/cpu_attention.py                 # attention per step, old vs new
    python benchmarks/cpu_attention.py --e2e           # and tllm bench throughput, old vs new

Each figure is one engine step's attention: the step's plan (new path) and 30 layers, each
over its own cache (so the caches do not all sit in the CPU's last-level cache). Both paths
are checked against each other first. The end-to-end run is `tllm bench throughput` in a
fresh process per run, the old path patched into TorchAttentionBackend for "old".
Prints a table last; writes every number to $OUT/cpu_attention.json when OUT is set."""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tllm.attention.testing import make_paged_batch, relative_error  # noqa: E402
from tllm.attention.torch_ref import (GatherBuffers, TorchAttentionBackend,  # noqa: E402
                                      paged_attention_batched, paged_attention_ref,
                                      plan_attention)

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 32
SCALE = HEAD_DIM ** -0.5
E2E = ["bench", "throughput", "--isl", "128", "--osl", "64", "--num-requests", "32",
       "--max-batch-size", "32", "--warmup", "2"]


def cases() -> dict[str, tuple[list[int], list[int], bool]]:
    """name -> (query_lens, prefix_lens, is_mix) of one step; on the mixes of lengths the
    grouping is compared with one padded call and with a call per shape."""
    rng = random.Random(0)
    out = {}
    for batch in (1, 8, 32):
        for context in (128, 512):
            out[f"decode b={batch} ctx={context}"] = ([1] * batch, [context - 1] * batch,
                                                      False)
    mixed_ctx = [rng.randint(64, 512) for _ in range(32)]
    out["decode b=32 ctx 64-512"] = ([1] * 32, [c - 1 for c in mixed_ctx], True)
    # a chunk of 256 after 256 computed prompt tokens
    out["prefill 256 + 31 decodes"] = ([256] + [1] * 31,
                                       [256] + [c - 1 for c in mixed_ctx[1:]], True)
    # 200 prompts of ~300 tokens, an 8192-token step: 27 fresh prefills
    out["prefill 27 x ~300"] = ([rng.randint(280, 320) for _ in range(27)], [0] * 27, True)
    return out


def time_step(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def bench_case(query_lens, prefix_lens, repeats: int, grouping: bool) -> dict:
    """Old and new path on one step; with `grouping`, also the new path as one padded call
    for the whole step and as a call per distinct shape."""
    batch = make_paged_batch(query_lens, prefix_lens, HEADS, KV_HEADS, HEAD_DIM, BLOCK,
                             torch.float32)
    m, q = batch.metadata, batch.q
    caches = [batch.kv_cache] + [tuple(torch.randn_like(c) for c in batch.kv_cache)
                                 for _ in range(LAYERS - 1)]
    kv_bytes = 2 * KV_HEADS * HEAD_DIM * 4
    buffers = GatherBuffers()

    def plan(call_us=None):
        extra = {} if call_us is None else {"call_us": call_us}
        return plan_attention(m, None, q.dtype, kv_bytes, HEADS, HEAD_DIM, **extra)

    def old():
        return [paged_attention_ref(q, c, m, SCALE) for c in caches]

    def new(call_us=None):  # as TorchAttentionBackend runs it: one plan per step, buffers kept
        groups = plan(call_us)
        return [paged_attention_batched(q, c, m, SCALE, groups=groups, buffers=buffers)
                for c in caches]

    paths = {"old": old, "new": new}
    if grouping:
        paths["one_call"] = lambda: new(float("inf"))
        paths["per_shape"] = lambda: new(0.0)
    ref = old()[0]
    errors = {name: relative_error(fn()[0], ref) for name, fn in paths.items() if name != "old"}
    runs = {name: [] for name in paths}
    for i in range(repeats):  # alternate, so drift in the machine's load hits every path
        for name in (list(paths) if i % 2 == 0 else list(reversed(paths))):
            runs[name] += time_step(paths[name], 1)
    groups = {"new": len(plan())}
    if grouping:
        groups.update(one_call=len(plan(float("inf"))), per_shape=len(plan(0.0)))
    return {"rel_error": max(errors.values()), "groups": groups,
            "ms": {name: [t * 1e3 for t in ts] for name, ts in runs.items()},
            "median_ms": {name: statistics.median(ts) * 1e3 for name, ts in runs.items()},
            "min_ms": {name: min(ts) * 1e3 for name, ts in runs.items()}}


def e2e_run(path: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--e2e-child", path, "--", *E2E, "--json", out.name]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def e2e_child(path: str, argv: list[str]) -> int:
    """`tllm ...` in this process, with the old per-sequence loop patched in for "old"."""
    if path == "old":
        from tllm.kernels.paged import write_kv_cache

        def forward(self, q, k, v, kv_cache, metadata, kv_scales=(1.0, 1.0)):
            write_kv_cache(k, v, kv_cache, metadata.slot_mapping, kv_scales)
            return paged_attention_ref(q, kv_cache, metadata, self.scale, self.sliding_window,
                                       kv_scales)
        TorchAttentionBackend.forward = forward
    from tllm.cli import main
    return main(argv)


def tokens_per_s(result: dict) -> float:
    for scope in (result, result.get("results", {}), result.get("summary", {})):
        if isinstance(scope, dict) and "output_tokens_per_s" in scope:
            return scope["output_tokens_per_s"]
    raise KeyError(f"output_tokens_per_s not in {sorted(result)}")


def main() -> None:
    if "--e2e-child" in sys.argv:
        i = sys.argv.index("--e2e-child")
        sys.exit(e2e_child(sys.argv[i + 1], sys.argv[sys.argv.index("--") + 1:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--e2e", action="store_true", help="also tllm bench throughput")
    parser.add_argument("--e2e-repeats", type=int, default=3)
    parser.add_argument("--only", help="cases whose name contains this")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"threads": torch.get_num_threads(), "torch": torch.__version__, "cases": {}}
    for name, (query_lens, prefix_lens, is_mix) in cases().items():
        if args.only and args.only not in name:
            continue
        r = bench_case(query_lens, prefix_lens, args.repeats, grouping=is_mix)
        results["cases"][name] = r
        print(f"{name}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in r["median_ms"].items())
              + f" (error {r['rel_error']:.1e})", file=sys.stderr, flush=True)
        assert r["rel_error"] < 1e-5, r["rel_error"]
    if args.e2e:
        runs = {"old": [], "new": []}
        for i in range(args.e2e_repeats):
            for path in (("old", "new") if i % 2 == 0 else ("new", "old")):
                runs[path].append(tokens_per_s(e2e_run(path)))
                print(f"e2e {path}: {runs[path][-1]:.1f} tok/s", file=sys.stderr, flush=True)
        results["e2e"] = {"command": "tllm " + " ".join(E2E), "tok_s": runs}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "cpu_attention.json").write_text(json.dumps(results, indent=1))
    print(f"attention per step ({LAYERS} layers), {results['threads']} threads, "
          f"median of {args.repeats} (ms):")
    print("| step | old | new | old/new | (min old / new) | groups | new as one padded call "
          "| new, a call per shape | rel. error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results["cases"].items():
        t, lo, g = r["median_ms"], r["min_ms"], r["groups"]
        variants = [f"{t[k]:.1f} ({g[k]} calls)" if k in t else "" for k in ("one_call",
                                                                            "per_shape")]
        print(f"| {name} | {t['old']:.1f} | {t['new']:.1f} | {t['old'] / t['new']:.2f}x | "
              f"{lo['old']:.1f} / {lo['new']:.1f} | {g['new']} | {' | '.join(variants)} | "
              f"{r['rel_error']:.1e} |")
    if args.e2e:
        runs = results["e2e"]["tok_s"]
        old, new = statistics.median(runs["old"]), statistics.median(runs["new"])
        print(f"\n{results['e2e']['command']}: old {old:.1f} tok/s, new {new:.1f} tok/s "
              f"({new / old:.2f}x; runs old {runs['old']}, new {runs['new']})")


if __name__ == "__main__":
    main()
