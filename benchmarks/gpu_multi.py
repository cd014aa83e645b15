"""Issue 25 on two GPUs of one host, in one call: every figure of its "What must be shown".

Sections (each in a process of its own, each with its own time limit, within one budget):
  parity        TP=2 vs TP=1 greedy on a tiny HF Llama: fp32 identical (custom all-reduce
                on, and off), bf16 by DESIGN.md's top-5 rule
  allreduce     custom one-shot / two-shot vs NCCL latency per message size (CUDA graphs),
                each checked against the pure-torch reference (benchmarks/allreduce_bench.py)
  8b-tp1, 8b-tp2, 8b-tp2-nccl
                dummy:llama-3.1-8b batch-1 tok/s and 128/128 max-load throughput at TP=1,
                TP=2, and TP=2 with the custom all-reduce off (batch 1 only)
  70b-tp2, 70b-tp2-fp8
                dummy:llama-3.1-70b at TP=2, bf16 and quantization="fp8": batch-1 tok/s
                against its weight-read floor (this rank's weight bytes over the copy
                bandwidth measured in the same process), and max-load throughput (FP8
                against TensorRT-LLM's published TP2 6,823 tok/s)
  moe-tp2, moe-ep2
                dummy:qwen3-30b-a3b, every expert sliced (TP=2) vs whole experts (EP=2)
  disagg        1 context GPU + 1 generation GPU (CUDA IPC KV) vs 2 aggregated replicas
                behind the router at one request rate; KV transfer bandwidth
                (benchmarks/multi_disagg.py)

    python benchmarks/gpu_multi.py --out $OUT/gpu_multi.json          # nvidia-h200-x2
    python benchmarks/gpu_multi.py --smoke --out /tmp/gpu_multi.json  # CPU, gloo, tiny models
    python benchmarks/gpu_multi.py --sections disagg:150,moe-tp2 ...  # some, own limits

Sections run in the order above, the most wanted first; one that would start with under 20 s
of the budget left is recorded as skipped. A table is printed last; every result is in --out
as soon as it exists. NVLink multicast stays off (the variables below are set for every
process this starts)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
for _key, _value in MULTICAST_OFF.items():
    os.environ.setdefault(_key, _value)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_parallel import run_engine, run_stage  # noqa: E402

# name: (GPU seconds, smoke seconds)
SECTIONS = {"parity": (60, 200), "allreduce": (40, 40), "8b-tp1": (65, 70), "8b-tp2": (65, 70),
            "8b-tp2-nccl": (40, 60), "70b-tp2": (80, 70), "disagg": (120, 200),
            "moe-tp2": (45, 90), "moe-ep2": (45, 90), "70b-tp2-fp8": (80, 70)}
BUDGET_S = 570


@dataclass(frozen=True)
class Plan:
    """Models and workload of a run: the real shapes on GPUs, tiny models on the CPU."""
    dense: str
    large: str
    moe: str
    parity_model: str
    engine: dict            # LLM kwargs every engine section gets
    requests: int
    large_requests: int
    isl: int
    osl: int
    osl_latency: int
    latency_iterations: int
    parity_tokens: int
    smoke: bool


def gpu_plan(workdir: str, requests: int) -> Plan:
    return Plan("dummy:llama-3.1-8b", "dummy:llama-3.1-70b", "dummy:qwen3-30b-a3b",
                f"{workdir}/parity", {"dtype": "bfloat16"}, requests, 256, 128, 128, 128, 2,
                24, False)


def smoke_plan(workdir: str) -> Plan:
    return Plan(f"{workdir}/served", f"{workdir}/served", f"{workdir}/moe", f"{workdir}/parity",
                {"dtype": "float32", "device": "cpu", "max_seq_len": 256, "max_batch_size": 16,
                 "max_num_tokens": 256, "kv_cache_config": {"max_tokens": 4096}},
                16, 8, 32, 16, 16, 1, 8, True)


def prepare_models(workdir: str, smoke: bool) -> None:
    """Tiny HF models the run needs, saved once: the parity Llama (both modes); on the CPU
    also a served Llama with a tokenizer and a tiny Qwen3-MoE."""
    import torch
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.05, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(f"{workdir}/parity")
    if not smoke:
        return
    from tests.models.test_moe_parity import make_tiny_moe
    from tllm.visual_gen.models.qwen_image.components import byte_level_tokenizer
    make_tiny_moe("Qwen3Moe", f"{workdir}/moe")
    tokenizer = byte_level_tokenizer("the quick brown fox jumps over the lazy dog 0123456789",
                                     vocab_size=300)
    tokenizer.save_pretrained(f"{workdir}/served")
    served = transformers.LlamaConfig(
        vocab_size=len(tokenizer) + 8, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        architectures=["LlamaForCausalLM"])
    transformers.LlamaForCausalLM(served).save_pretrained(f"{workdir}/served")


# ---- parity ----

def section_parity(plan: Plan, limit_s: float) -> dict:
    from tllm import LLM, SamplingParams
    from tllm.distributed import comm
    prompts = [[1] + list(range(10 + i, 60 + 9 * i)) for i in range(8)]
    params = SamplingParams(max_tokens=plan.parity_tokens, temperature=0.0, logprobs=5)
    device = {"device": "cpu"} if plan.smoke else {}
    runs = {}
    for name, dtype, tp, strategy in (("fp32-tp1", "float32", 1, "auto"),
                                      ("fp32-tp2", "float32", 2, "auto"),
                                      ("fp32-tp2-nccl", "float32", 2, "nccl"),
                                      ("bf16-tp1", "bfloat16", 1, "auto"),
                                      ("bf16-tp2", "bfloat16", 2, "auto")):
        with LLM(plan.parity_model, dtype=dtype, tensor_parallel_size=tp,
                 kv_cache_config={"max_tokens": 8192}, allreduce_config={"strategy": strategy},
                 **device) as llm:
            state = comm.state()
            outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            runs[name] = {"custom_all_reduce": bool(state and state.custom_all_reduce),
                          "tokens": [o.token_ids for o in outputs],
                          "top": [[set(step) for step in o.logprobs] for o in outputs]}
    bf16 = [_top5_rule(a, b, ta, tb) for a, b, ta, tb in zip(
        runs["bf16-tp2"]["tokens"], runs["bf16-tp1"]["tokens"], runs["bf16-tp2"]["top"],
        runs["bf16-tp1"]["top"])]
    return {"config": "parity",
            "fp32_tp2_identical": runs["fp32-tp2"]["tokens"] == runs["fp32-tp1"]["tokens"],
            "fp32_tp2_nccl_identical": (runs["fp32-tp2-nccl"]["tokens"]
                                        == runs["fp32-tp1"]["tokens"]),
            "bf16_top5_rule_holds": all(row["holds"] for row in bf16),
            "bf16_prompts_identical": sum(row["first_difference"] is None for row in bf16),
            "bf16_rows": bf16, "num_prompts": len(prompts),
            "custom_all_reduce": {k: v["custom_all_reduce"] for k, v in runs.items()}}


def _top5_rule(a: list[int], b: list[int], top_a: list[set], top_b: list[set]) -> dict:
    """Identical, or where they first differ each side's token is in the other's top-5."""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    holds = first is None or (a[first] in top_b[first] and b[first] in top_a[first])
    return {"first_difference": first, "holds": holds and len(a) == len(b)}


# ---- engines ----

def engine_specs(plan: Plan) -> dict:
    """name: (LLM kwargs, throughput requests, measure the weight-read floor)."""
    tp2 = {"tensor_parallel_size": 2}
    return {"8b-tp1": ({"model": plan.dense}, plan.requests, False),
            "8b-tp2": ({"model": plan.dense, **tp2}, plan.requests, False),
            "8b-tp2-nccl": ({"model": plan.dense, **tp2,
                             "allreduce_config": {"strategy": "nccl"}}, 0, False),
            "70b-tp2": ({"model": plan.large, **tp2}, plan.large_requests, True),
            "70b-tp2-fp8": ({"model": plan.large, **tp2, "quantization": "fp8"},
                            plan.large_requests, True),
            "moe-tp2": ({"model": plan.moe, **tp2}, plan.large_requests, False),
            "moe-ep2": ({"model": plan.moe, **tp2, "enable_expert_parallel": True},
                        plan.large_requests, False)}


def section_engine(name: str, plan: Plan, limit_s: float) -> dict:
    kwargs, requests, with_floor = engine_specs(plan)[name]
    bandwidth = copy_bandwidth(plan.smoke) if with_floor else None

    def on_built(llm) -> dict:
        from tllm.distributed import comm
        state = comm.state()
        weight_bytes = read_weight_bytes(llm._engine.executor.runner.model)
        info = {"custom_all_reduce": bool(state and state.custom_all_reduce),
                "weight_bytes_per_gpu": weight_bytes}
        if bandwidth:
            info["copy_bytes_per_s"] = bandwidth
            info["floor_tokens_per_s"] = bandwidth / weight_bytes
        return info

    # each timed phase gets a share of the section, the rest is build and teardown
    return run_engine(name, {**plan.engine, **kwargs}, requests, plan.osl_latency,
                      plan.latency_iterations, time_limit_s=max(5.0, 0.3 * limit_s),
                      on_built=on_built, isl=plan.isl, osl=plan.osl)


def read_weight_bytes(model) -> int:
    """Bytes a decode step reads of this rank's weights: every parameter and buffer once,
    but not the input embedding (one row a token, unless tied to the LM head) nor the
    rotary tables."""
    seen, total = set(), 0
    tied = getattr(model, "tied", False)
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in named:
        if tensor.data_ptr() in seen or name.endswith((".cos", ".sin")):
            continue
        if "embed_tokens" in name and not tied:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def copy_bandwidth(smoke: bool, nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth, bytes read + written per second, best of 5 (DESIGN.md's
    4.26 TB/s figure counts the same way)."""
    import torch
    device = "cpu" if smoke else "cuda"
    nbytes = (64 << 20) if smoke else nbytes
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        if not smoke:
            torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src)
        if not smoke:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    del src, dst
    if not smoke:
        torch.cuda.empty_cache()
    return 2 * nbytes / best


# ---- the sections' dispatch, in a child process ----

def run_section(name: str, plan: Plan, limit_s: float, workdir: str) -> dict:
    if name == "parity":
        return section_parity(plan, limit_s)
    if name == "allreduce":
        import allreduce_bench
        return {"config": name, **allreduce_bench.run(plan.smoke)}
    if name == "disagg":
        import multi_disagg
        disagg = (multi_disagg.smoke_plan(f"{workdir}/served") if plan.smoke
                  else multi_disagg.gpu_plan())
        return {"config": name, **multi_disagg.run_disagg(disagg, limit_s - 15)}
    return section_engine(name, plan, limit_s)


def chosen_sections(spec: str | None, smoke: bool) -> list[tuple[str, float]]:
    if not spec:
        return [(name, limits[smoke]) for name, limits in SECTIONS.items()]
    out = []
    for item in spec.split(","):
        name, _, limit = item.partition(":")
        if name not in SECTIONS:
            raise SystemExit(f"--sections: unknown section {name!r}; one of {list(SECTIONS)}")
        out.append((name, float(limit) if limit else SECTIONS[name][smoke]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "gpu_multi.json"))
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny models")
    parser.add_argument("--sections", help="name[:seconds],... (default: all, in order)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds in all")
    parser.add_argument("--requests", type=int, default=1000, help="8B throughput requests")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:
        plan = (smoke_plan(args.workdir) if args.smoke
                else gpu_plan(args.workdir, args.requests))
        result = run_section(args.section, plan, args.limit, args.workdir)
        print("RESULT " + json.dumps(result, default=str), flush=True)
        return
    run_all(args)


def run_all(args) -> None:
    deadline = time.perf_counter() + args.budget
    workdir = tempfile.mkdtemp(prefix="gpu_multi-")
    prepare_models(workdir, args.smoke)
    results = []
    for name, limit in chosen_sections(args.sections, args.smoke):
        left = deadline - time.perf_counter()
        if left < 20:
            results.append({"config": name, "error": "skipped: the budget ran out"})
            continue
        limit = min(limit, left)
        cmd = [sys.executable, __file__, "--section", name, "--limit", str(limit),
               "--workdir", workdir, "--requests", str(args.requests),
               *(["--smoke"] if args.smoke else [])]
        started = time.perf_counter()
        result = run_stage(cmd, name, limit)
        result["section_s"] = time.perf_counter() - started
        print(f"section {name}: {result['section_s']:.0f} s"
              + (f", {result['error'][:300]}" if "error" in result else ""), flush=True)
        results.append(result)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    from multi_summary import summary
    print(summary(results, args.smoke))


if __name__ == "__main__":
    main()
