"""Issue 35's sleep / wake / weight-update figures on dummy:llama-3.1-8b (BF16), one engine
in this process:

  sleep1   free GPU memory (torch.cuda.mem_get_info) before the engine, with it loaded and
           asleep at level 1 (KV cache freed, weights parked in host memory): the fraction
           freed of what the engine held; wake_up time (graphs recaptured); greedy tokens
           after sleep -> wake equal those before
  update   update_weights with every tensor of a second random model of the same shape (HF
           names, from transformers' own model of the config built on the meta device; the
           tensors live on the GPU beside the engine, as a colocated trainer's would)
  sleep2   the same at level 2 (weights dropped); wake_up(["weights"]), update_weights with
           the second model again, wake_up(["kv_cache"]): greedy tokens equal those after the
           first update

The second model's tensors are made before the engine, so the engine's memory share leaves
room for them and "held" is only the engine's. Results go to $OUT/rollout.json.

    python benchmarks/gpu_rollout.py [--model dummy:llama-3.1-8b] [--kv-tokens 65536]
    python benchmarks/gpu_rollout.py --tiny      # the plumbing on the CPU, a tiny Llama
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

GIB = 2**30


def hf_config(model: str):
    from transformers import AutoConfig
    from tllm.loader.dummy import dummy_config
    if model.startswith("dummy:"):
        return dummy_config(model.removeprefix("dummy:"))
    return AutoConfig.from_pretrained(model)


def second_model_tensors(model: str, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors under every parameter name (HF's) of the model's architecture."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in
                  AutoModelForCausalLM.from_config(hf_config(model)).named_parameters()}
    generator = torch.Generator(device).manual_seed(1)
    return {name: torch.randn(shape, generator=generator, device=device, dtype=dtype) * 0.02
            for name, shape in shapes.items()}


def free_bytes() -> int | None:
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None


def synced_seconds(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def memory_record(loaded: int | None, held: int | None, asleep: int | None) -> dict:
    if loaded is None:   # the CPU: mem_get_info has nothing to say
        return {"free_loaded": None, "free_asleep": None, "fraction_freed": None}
    freed = asleep - loaded
    return {"held_gib": held / GIB, "free_loaded_gib": loaded / GIB,
            "free_asleep_gib": asleep / GIB, "freed_gib": freed / GIB,
            "fraction_freed": freed / held}


def run(llm, tensors: dict, held: int | None, greedy) -> dict:
    results = {}
    before = greedy()
    loaded = free_bytes()
    results["sleep1"] = {"sleep_s": synced_seconds(lambda: llm.sleep(level=1))}
    results["sleep1"].update(memory_record(loaded, held, free_bytes()))
    results["sleep1"]["wake_s"] = synced_seconds(llm.wake_up)
    results["sleep1"]["same_tokens"] = greedy() == before
    print(f"sleep 1: {results['sleep1']}", flush=True)

    results["update"] = {"tensors": len(tensors),
                         "gib": sum(t.numel() * t.element_size() for t in tensors.values()) / GIB,
                         "update_s": synced_seconds(lambda: llm.update_weights(tensors))}
    updated = greedy()
    results["update"]["tokens_changed"] = updated != before
    print(f"update: {results['update']}", flush=True)

    loaded = free_bytes()
    results["sleep2"] = {"sleep_s": synced_seconds(lambda: llm.sleep(level=2))}
    results["sleep2"].update(memory_record(loaded, held, free_bytes()))
    results["sleep2"]["wake_weights_s"] = synced_seconds(lambda: llm.wake_up(["weights"]))
    results["sleep2"]["update_s"] = synced_seconds(lambda: llm.update_weights(tensors))
    results["sleep2"]["wake_kv_s"] = synced_seconds(lambda: llm.wake_up(["kv_cache"]))
    results["sleep2"]["same_tokens"] = greedy() == updated
    print(f"sleep 2: {results['sleep2']}", flush=True)
    return results


def tiny_model() -> str:
    from tests.conftest import make_tiny_model
    path = Path(tempfile.mkdtemp()) / "tiny_llama"
    make_tiny_model("Llama", path)
    return str(path)


def summary(results: dict) -> str:
    lines = [f"rollout: {results['meta']['model']} on {results['meta']['device']}"]
    for level in ("sleep1", "sleep2"):
        r = results.get(level)
        if r is None:
            continue
        freed = (f"freed {r['freed_gib']:.2f} of {r['held_gib']:.2f} GiB held "
                 f"({100 * r['fraction_freed']:.1f}%)" if r.get("held_gib") else "freed n/a")
        wake = r.get("wake_s", r.get("wake_weights_s", 0) + r.get("wake_kv_s", 0))
        lines.append(f"{level}: {freed}; sleep {r['sleep_s']:.2f} s, wake {wake:.2f} s, "
                     f"same tokens after wake: {r['same_tokens']}")
    if "update" in results:
        u = results["update"]
        lines.append(f"update_weights: {u['tensors']} tensors, {u['gib']:.2f} GiB in "
                     f"{u['update_s']:.2f} s ({u['gib'] / u['update_s']:.1f} GiB/s)")
    if "error" in results:
        lines.append(f"error: {results['error'][:300]}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--kv-tokens", type=int, default=65536,
                        help="the KV cache's size (a fixed one leaves room for the tensors)")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    from tllm import LLM, SamplingParams
    if args.tiny:
        args.kv_tokens = min(args.kv_tokens, 2048)
    model = tiny_model() if args.tiny else args.model
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    out_dir = Path(os.environ.get("OUT") or "/tmp/gpu_rollout")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"meta": {"date": datetime.date.today().isoformat(), "argv": sys.argv,
                        "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                        else "cpu", "torch": torch.__version__, "model": model}}
    tensors = second_model_tensors(model, device, dtype)
    if torch.cuda.is_available():   # the temporaries' cached blocks are not the engine's
        torch.cuda.empty_cache()
    free_before = free_bytes()
    prompts = [[1 + (7 * i + 3 * j) % 250 for j in range(16 + 8 * i)] for i in range(4)]
    greedy_params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    kwargs = {"dtype": "float32", "device": "cpu"} if args.tiny else {"dtype": "bfloat16"}
    try:
        start = time.perf_counter()
        with LLM(model, kv_cache_config={"max_tokens": args.kv_tokens}, max_seq_len=4096,
                 **kwargs) as llm:
            results["meta"]["load_s"] = time.perf_counter() - start
            free_loaded = free_bytes()
            held = None if free_before is None else free_before - free_loaded
            results.update(run(llm, tensors, held, lambda: [
                o.outputs[0].token_ids
                for o in llm.generate(prompts, greedy_params, use_tqdm=False)]))
    except Exception as exc:  # what was measured before still prints
        results["error"] = f"{type(exc).__name__}: {exc}"
    (out_dir / "rollout.json").write_text(json.dumps(results, indent=1, default=str))
    print(summary(results), flush=True)
    return 1 if "error" in results else 0


if __name__ == "__main__":
    sys.exit(main())
