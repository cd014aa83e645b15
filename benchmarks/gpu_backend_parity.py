"""On a GPU: the engine with the Triton attention backend gives the same greedy tokens as
with the torch backend (and as HF transformers in fp32), for a tiny random Llama and for
SmolLM2. Where bf16 rounding parts the two late, the first differing token of each must be
in the other's top-5 (vLLM's check_logprobs_close rule).

    python benchmarks/gpu_backend_parity.py [--gguf PATH] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tllm import LLM, KvCacheConfig, SamplingParams  # noqa: E402

NEW = 32
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):",
                "Once upon a time, in a small village,", "The three primary colors are",
                "Water boils at", "List three animals:", "import numpy as np\n", "Hello!"]


def tiny_model(path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=32 * 2, max_position_embeddings=1024, initializer_range=0.05,
                         architectures=["LlamaForCausalLM"])
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return model


def token_prompts(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"prompt_token_ids": torch.randint(3, vocab, (n,), generator=g).tolist()}
            for n in (5, 17, 64, 130, 300, 33, 1, 90)]


def run(model: str, prompts, backend: str, dtype: str):
    # min_tokens masks EOS exactly as HF min_new_tokens does
    params = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0, logprobs=5)
    with LLM(model, attn_backend=backend, dtype=dtype, max_num_tokens=96, max_batch_size=8,
             kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=32768)) as llm:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return [o.outputs[0] for o in outs], elapsed


def compare(a, b) -> tuple[int, list[int], bool]:
    """(identical count, first-difference positions, top-5 rule holds)"""
    same, diffs, ok = 0, [], True
    for x, y in zip(a, b):
        if x.token_ids == y.token_ids:
            same += 1
            continue
        i = next(k for k, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t)
        diffs.append(i)
        ok &= x.token_ids[i] in y.logprobs[i] and y.token_ids[i] in x.logprobs[i]
        ok &= len(y.logprobs[i]) >= 5 or y.logprobs[i][x.token_ids[i]].rank <= 5
    return same, diffs, ok


def hf_greedy(model, prompts, device="cuda"):
    model = model.to(device).float().eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p["prompt_token_ids"]], device=device)
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = tiny_model(Path(tmp))
        prompts = token_prompts(hf.config.vocab_size)
        cases = [(tmp, "float32", prompts), (tmp, "bfloat16", prompts)]
        if args.gguf:
            cases += [(args.gguf, "float32", TEXT_PROMPTS), (args.gguf, "bfloat16", TEXT_PROMPTS)]
        ref = hf_greedy(hf, prompts)
        for model, dtype, case_prompts in cases:
            torch_out, t_torch = run(model, case_prompts, "torch", dtype)
            triton_out, t_triton = run(model, case_prompts, "triton", dtype)
            same, diffs, ok = compare(torch_out, triton_out)
            row = dict(model="tiny-llama" if model == tmp else "smollm2", dtype=dtype,
                       prompts=len(case_prompts), identical=same, first_diffs=diffs,
                       top5_rule=ok, torch_s=round(t_torch, 2), triton_s=round(t_triton, 2))
            if model == tmp and dtype == "float32":
                row["hf_identical"] = sum(o.token_ids == r for o, r in zip(triton_out, ref))
            rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(f"{'model':12} {'dtype':9} {'same':>6} {'first diffs':14} top5 hf  torch_s triton_s")
    for r in rows:
        print(f"{r['model']:12} {r['dtype']:9} {r['identical']:>3}/{r['prompts']:<2} "
              f"{str(r['first_diffs']):14} {str(r['top5_rule']):5} {r.get('hf_identical', '-')!s:3} "
              f"{r['torch_s']:7} {r['triton_s']:8}")
    sys.exit(0 if all(r["top5_rule"] for r in rows) else 1)


if __name__ == "__main__":
    main()
