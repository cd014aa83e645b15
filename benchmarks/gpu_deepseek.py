"""Issue 33's DeepSeek figures in one device call, on a DeepSeek-shaped dummy model
(dummy:deepseek-v2-lite by default; dummy:moonlight-16b-a3b is the V3-architecture one):

  floor     device-to-device copy bandwidth (the roofline the batch-1 floor divides)
  model     bf16 batch-1 decode (ISL 128 / OSL 256) against the active-weight floor
            (gpu_models.FLOOR_CONVENTION), and 128/128 x 1,000 max-load throughput
  kv        KV bytes per token of the latent cache against multi-head attention of the same
            width (every head's key and value, values padded to the key's head size as one
            cache tensor per layer holds them), and the tokens the engine's cache holds

Results go to $OUT/deepseek.json.

    python benchmarks/gpu_deepseek.py [--model dummy:moonlight-16b-a3b] [--budget 560]
    python benchmarks/gpu_deepseek.py --smoke    # the plumbing on the CPU, a tiny model
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from gpu_models import FLOOR_CONVENTION, part_floor, part_model  # noqa: E402


def kv_bytes(model: str, dtype: torch.dtype) -> dict:
    """Bytes per token (all layers) of the model's latent cache and of MHA of its width."""
    from tllm import loader
    from tllm.attention import get_attention_backend
    from tllm.attention.interface import KVCacheSpec
    config, _ = loader.load_config(loader.resolve_model(model))
    built = loader.build_model(config, get_attention_backend("torch"), dtype,
                               torch.device("meta"), 64)
    spec, size = built.kv_cache_spec, torch.empty((), dtype=dtype).element_size()
    mha = KVCacheSpec(spec.num_layers, config.num_attention_heads,
                      config.qk_nope_head_dim + config.qk_rope_head_dim)
    latent, expanded = (s.num_layers * s.bytes_per_token(size) for s in (spec, mha))
    return {"latent_bytes_per_token": latent, "mha_bytes_per_token": expanded,
            "saving": expanded / latent}


def smoke_model() -> str:
    """A tiny random DeepSeek-V3 saved to a temporary directory."""
    import tempfile
    from tests.models.test_deepseek_parity import make_tiny_deepseek
    path = Path(tempfile.mkdtemp()) / "tiny_deepseek_v3"
    make_tiny_deepseek("DeepseekV3", path)
    return str(path)


def cache_tokens(model: str, smoke: bool) -> int:
    """Tokens of every layer the engine's KV cache holds with the default memory share
    (batch and length limits high enough that memory decides), in a process of its own."""
    import subprocess
    argv = [sys.executable, __file__, "--model", model, "--capacity-child"]
    proc = subprocess.run(argv + (["--smoke"] if smoke else []), capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return int(proc.stdout.strip().splitlines()[-1])


def capacity_child(model: str, smoke: bool) -> None:
    from tllm import LLM
    kwargs = {"dtype": "float32", "device": "cpu"} if smoke else {"dtype": "bfloat16"}
    with LLM(model, max_seq_len=4096 if smoke else 32768, max_batch_size=1024,
             cuda_graph_config=None, **kwargs) as llm:
        print(llm._engine.kv_cache.capacity_tokens, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:deepseek-v2-lite")
    parser.add_argument("--budget", type=float, default=560.0)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--capacity-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.capacity_child:
        capacity_child(args.model, args.smoke)
        return 0
    model = smoke_model() if args.smoke else args.model
    out_dir = Path(os.environ.get("OUT") or "/tmp/gpu_deepseek")
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    results = {"meta": {"date": datetime.date.today().isoformat(), "argv": sys.argv,
                        "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                        else "cpu", "torch": torch.__version__, "model": model,
                        "floor_convention": FLOOR_CONVENTION}}
    results["kv"] = kv_bytes(model, dtype)
    print(f"KV bytes per token: latent {results['kv']['latent_bytes_per_token']}, MHA of the "
          f"same width {results['kv']['mha_bytes_per_token']} "
          f"({results['kv']['saving']:.1f}x)", flush=True)
    results["floor"] = part_floor(20, args.smoke)
    results["model"] = part_model(model, args.budget * 0.8, args.smoke,
                                  results["floor"]["copy_bw_gbs"])
    results["kv"]["cache_tokens"] = cache_tokens(model, args.smoke)
    print(f"the engine's cache holds {results['kv']['cache_tokens']} tokens", flush=True)
    (out_dir / "deepseek.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
