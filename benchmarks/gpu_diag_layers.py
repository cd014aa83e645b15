"""Where a model's CUDA path leaves its CPU path: one tiny random checkpoint (the parity
tests' own), one prompt's prefill and a few decode steps, fp32 on both devices; every module's
first output (the prefill) recorded by forward hooks and compared, the first modules past
1e-4 printed. Also the greedy tokens: CPU, CUDA eager, CUDA with graphs, HF.

    python benchmarks/gpu_diag_layers.py [DeepseekV2,DeepseekV3]
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tllm.llmapi.engine as engine  # noqa: E402
from tests.models.test_deepseek_parity import make_tiny_deepseek  # noqa: E402
from tests.models.test_hf_parity import hf_greedy, make_prompts  # noqa: E402
from tllm import LLM, KvCacheConfig, SamplingParams  # noqa: E402

_built: dict = {}
_build_rank = engine.build_rank


def _capture(args, device):
    parts = _build_rank(args, device)
    _built["model"] = parts.model
    return parts


engine.build_rank = _capture


def run(path, prompt, device: str, graphs: bool, store: dict | None) -> list[int]:
    kwargs = {} if graphs else {"cuda_graph_config": None}
    with LLM(str(path), device=device, dtype="float32", max_num_tokens=64, max_batch_size=2,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=512),
             **kwargs) as llm:
        hooks = []
        if store is not None:
            for name, module in _built["model"].named_modules():
                if name.count(".") <= 5:
                    hooks.append(module.register_forward_hook(_recorder(name, store)))
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                           use_tqdm=False)
        for hook in hooks:
            hook.remove()
    return list(out[0].outputs[0].token_ids)


def _recorder(name: str, store: dict):
    def hook(module, inputs, output):
        tensor = output[0] if isinstance(output, (tuple, list)) else output
        if name not in store and torch.is_tensor(tensor):
            store[name] = tensor.detach().float().cpu()
    return hook


def compare(cpu: dict, cuda: dict) -> None:
    shown = 0
    for name, ref in cpu.items():
        got = cuda.get(name)
        if got is None or got.shape != ref.shape:
            print(f"  {name}: missing or shape {None if got is None else tuple(got.shape)} "
                  f"vs {tuple(ref.shape)}")
            continue
        rel = ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        if rel > 1e-4 and shown < 25:
            print(f"  {name}: rel {rel:.2e}  shape {tuple(ref.shape)}")
            shown += 1
    print(f"  ({len(cpu)} modules compared; {shown} shown past 1e-4)")


def main() -> None:
    archs = (sys.argv[1] if len(sys.argv) > 1 else "DeepseekV2,DeepseekV3").split(",")
    has_cuda = torch.cuda.is_available()
    for arch in archs:
        with tempfile.TemporaryDirectory() as tmp:
            hf_model = make_tiny_deepseek(arch, tmp)
            prompt = make_prompts(hf_model.config.vocab_size)[0]
            cpu_store, cuda_store = {}, {}
            tokens = {"hf": hf_greedy(hf_model, prompt, 6)[0],
                      "cpu": run(tmp, prompt, "cpu", False, cpu_store)}
            if has_cuda:
                tokens["cuda_eager"] = run(tmp, prompt, "cuda", False, cuda_store)
                tokens["cuda_graphs"] = run(tmp, prompt, "cuda", True, None)
            print(f"== {arch}: prompt of {len(prompt)} tokens")
            for key, value in tokens.items():
                print(f"  {key:12s} {value}")
            compare(cpu_store, cuda_store if has_cuda else cpu_store)


if __name__ == "__main__":
    main()
