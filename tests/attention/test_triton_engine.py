"""The engine on a tiny random Llama gives the same greedy tokens with the Triton attention
backend as with the torch backend (fp32; interpreted on the CPU, compiled on a GPU)."""
import pytest

pytest.importorskip("triton")

from tllm import LLM, KvCacheConfig, SamplingParams  # noqa: E402
from tllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402

# a shared 9-token prefix (reused from the cache by the second prompt), then chunked prefill
PROMPTS = [[5, 17, 33, 2, 90, 41, 7, 11, 64, 3, 8], [5, 17, 33, 2, 90, 41, 7, 11, 64, 99],
           [42] * 19]


def greedy_tokens(path, backend: str, device) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0)
    with LLM(str(path), attn_backend=backend, dtype="float32", device=str(device),
             max_num_tokens=16, max_batch_size=4, max_seq_len=64,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=512)) as llm:
        first = llm.generate(PROMPTS[:1], params, use_tqdm=False)
        rest = llm.generate(PROMPTS[1:], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in first + rest]


def test_greedy_tokens_match_torch_backend(tiny_llama, device, monkeypatch):
    path, _ = tiny_llama
    steps = {"decode": 0, "context": 0}
    attend = TritonAttentionBackend._attend

    def counting_attend(self, q, kv_cache, metadata, *args):
        steps["decode" if metadata.is_decode_only else "context"] += 1
        return attend(self, q, kv_cache, metadata, *args)
    monkeypatch.setattr(TritonAttentionBackend, "_attend", counting_attend)
    assert greedy_tokens(path, "triton", device) == greedy_tokens(path, "torch", device)
    assert steps["decode"] and steps["context"]  # both kernels ran


def test_gemma2_soft_cap_and_window_match_torch_backend(device, tmp_path):
    # soft-capped, windowed and global layers through both kernels (window 8 < prompts)
    from tests.models.test_gemma_parity import make_tiny_gemma
    make_tiny_gemma("Gemma2", tmp_path, num_hidden_layers=2)  # one of each kind
    assert greedy_tokens(tmp_path, "triton", device) == greedy_tokens(tmp_path, "torch", device)


@pytest.mark.parametrize("arch", ["Qwen3", "Gemma3"])
def test_fused_qk_norms_match_torch_backend(arch, device, tmp_path, monkeypatch):
    """Qwen3's RMSNorm and Gemma 3's GemmaRMSNorm q/k norms run inside the rotation kernel
    (no norm module is called) and give the torch backend's tokens."""
    from tests.models.test_dense_parity import save_tiny
    from tests.models.test_gemma_parity import make_tiny_gemma
    from tllm.layers import norm
    if arch == "Qwen3":
        save_tiny(arch, tmp_path, num_hidden_layers=2)
    else:
        make_tiny_gemma(arch, tmp_path, num_hidden_layers=2)
    want = greedy_tokens(tmp_path, "torch", device)
    calls = {"norms on heads": 0}
    for cls in (norm.RMSNorm, norm.GemmaRMSNorm):
        def counting(self, x, *args, _forward=cls.forward, **kwargs):
            calls["norms on heads"] += x.dim() == 3
            return _forward(self, x, *args, **kwargs)
        monkeypatch.setattr(cls, "forward", counting)
    assert greedy_tokens(tmp_path, "triton", device) == want
    assert calls["norms on heads"] == 0
