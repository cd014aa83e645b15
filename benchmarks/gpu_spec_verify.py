"""Issue 18's verify-step cost on one H200: one target forward that scores k draft tokens
plus one (a query of k + 1 tokens per request over a 512-token cached context) against one
plain decode step (a query of 1), at batch 1 and 32, on dummy:llama-3.1-8b bf16.

Each shape is the engine's own model forward plus the LM head over every query token,
captured in a CUDA graph (as decode and verify steps are in the engine) and replayed:
median of repeats, CUDA events. Attention goes through the Triton backend: the decode kernel
(which takes up to 8 queries a sequence, so verify steps up to k = 7 run it too); with
--compare-context, verify shapes are timed again on the paged context kernel (what verify
steps ran before). Goal (issue 18): k = 4 costs at most 1.15x a decode step at batch 1.

    python benchmarks/gpu_spec_verify.py [--batches 1,32] [--ks 0,1,2,3,4,5,6,7]
                                         [--context 512] [--compare-context]
    python benchmarks/gpu_spec_verify.py --smoke     # plumbing on the CPU, tiny model, eager
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tllm import LLM  # noqa: E402
from tllm.attention import triton_backend  # noqa: E402
from tllm.attention.interface import AttentionMetadata  # noqa: E402


def verify_metadata(batch: int, query: int, context: int, block: int, device) -> tuple:
    """input ids and metadata of `batch` requests, each scoring `query` new tokens at the end
    of a `context`-token sequence, in disjoint blocks."""
    blocks_per_seq = -(-context // block)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32,
                          device=device).view(batch, blocks_per_seq)
    positions = torch.arange(context - query, context, device=device).repeat(batch)
    seq = torch.arange(batch, device=device).repeat_interleave(query)
    slots = tables[seq, positions // block].long() * block + positions % block
    metadata = AttentionMetadata(
        positions=positions, slot_mapping=slots,
        query_start_loc=torch.arange(0, (batch + 1) * query, query, dtype=torch.int32,
                                     device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_tables=tables, max_query_len=query, max_seq_len=context, tokens_per_block=block,
        query_lens_cpu=[query] * batch, seq_lens_cpu=[context] * batch)
    input_ids = torch.randint(0, 1000, (batch * query,), device=device)
    return input_ids, metadata


def time_step(model, kv_caches, input_ids, metadata, use_graph: bool, repeats: int) -> float:
    """Median seconds of one forward + LM head over every query token."""
    def step():
        return model.compute_logits(model(input_ids, kv_caches, metadata))

    if not use_graph:
        step()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--ks", default="0,1,2,3,4,5,6,7")
    parser.add_argument("--compare-context", action="store_true")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    smoke = args.smoke
    model_name = "dummy:smollm2-135m" if smoke else args.model
    device = "cpu" if smoke else "cuda"
    batches = [int(b) for b in args.batches.split(",")]
    context = 64 if smoke else args.context
    kwargs = dict(dtype="float32" if smoke else "bfloat16", device=device,
                  max_batch_size=max(batches), max_seq_len=context + 32,
                  cuda_graph_config=None)
    results = {"model": model_name, "context": context, "device":
               torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": []}
    with LLM(model_name, **kwargs) as llm:
        engine = llm._engine
        model, kv_caches = engine.executor.runner.model, engine.kv_cache.kv_caches
        block = engine.kv_cache.tokens_per_block
        for k, v in kv_caches:  # finite values in every slot a step reads
            k.normal_(0, 0.1)
            v.normal_(0, 0.1)
        ks = [int(k) for k in args.ks.split(",")]
        kernels = ["decode", "context"] if args.compare_context else ["decode"]
        with torch.inference_mode():
            for batch in batches:
                base = None
                for k in ks:
                    for kernel in kernels if k else kernels[:1]:
                        # the backend sends queries of up to this many tokens to the
                        # decode kernel; 1 sends every verify shape to the context kernel
                        triton_backend.MAX_DECODE_QUERIES = 8 if kernel == "decode" else 1
                        ids, metadata = verify_metadata(batch, k + 1, context, block, device)
                        seconds = time_step(model, kv_caches, ids, metadata, not smoke,
                                            3 if smoke else args.repeats)
                        base = base or seconds
                        row = {"batch": batch, "k": k, "query": k + 1, "kernel": kernel,
                               "ms": seconds * 1e3, "vs_decode": seconds / base}
                        results["rows"].append(row)
                        print(f"batch {batch:3d}  k {k}  ({k + 1} tokens a request, {kernel:7s}"
                              f" kernel): {row['ms']:8.3f} ms  {row['vs_decode']:.3f}x a "
                              "decode step", flush=True)
        triton_backend.MAX_DECODE_QUERIES = 8
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "spec_verify.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
