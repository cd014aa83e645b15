"""The plain-PyTorch comparator of benchmarks/gpu_latency.py: a Llama-3.1-8B-shaped batch-1
decode step written the way a PyTorch user would (F.rms_norm, matmuls, RoPE, a static KV
cache written with index_copy_, SDPA with GQA, greedy argmax), one torch.compile'd layer
function shared by the 32 layers, and the whole step (the position advanced in place)
captured in one CUDA graph. Random bf16 weights; speed does not depend on them."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _layer(x, pos, cos, sin, mask, k_cache, v_cache, ln1, qkv, o, ln2, gate_up, down,
           num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
    h = F.rms_norm(x, (x.shape[-1],), ln1, eps)
    q, k, v = (h @ qkv).split([num_heads * head_dim, num_kv_heads * head_dim,
                               num_kv_heads * head_dim], dim=-1)
    c, s = cos[pos].view(1, 1, 1, head_dim), sin[pos].view(1, 1, 1, head_dim)
    q = _rotate(q.view(1, num_heads, 1, head_dim), c, s)
    k = _rotate(k.view(1, num_kv_heads, 1, head_dim), c, s)
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v.view(1, num_kv_heads, 1, head_dim))
    attn = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)
    x = x + attn.reshape(1, num_heads * head_dim) @ o
    h = F.rms_norm(x, (x.shape[-1],), ln2, eps)
    gate, up = (h @ gate_up).chunk(2, dim=-1)
    return x + (F.silu(gate) * up) @ down


class PlainLlamaDecode:
    def __init__(self, max_seq_len: int, num_layers: int = 32, hidden: int = 4096,
                 num_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128,
                 intermediate: int = 14336, vocab: int = 128256, theta: float = 500000.0,
                 device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> None:
        def weight(*shape):
            return torch.randn(*shape, device=device, dtype=dtype) * 0.02

        def ones():
            return torch.ones(hidden, device=device, dtype=dtype)

        self.shape = (num_heads, num_kv_heads, head_dim, 1e-5)
        self.embed = weight(vocab, hidden)
        self.layers = [(ones(), weight(hidden, (num_heads + 2 * num_kv_heads) * head_dim),
                        weight(num_heads * head_dim, hidden), ones(),
                        weight(hidden, 2 * intermediate), weight(intermediate, hidden))
                       for _ in range(num_layers)]
        self.norm, self.lm_head = ones(), weight(hidden, vocab)
        cache = (1, num_kv_heads, max_seq_len, head_dim)
        self.caches = [(weight(*cache), weight(*cache)) for _ in range(num_layers)]
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, device=device).float(), inv)
        self.cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
        self.sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
        self.positions = torch.arange(max_seq_len, device=device)
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.layer = torch.compile(_layer)

    def step(self) -> None:
        """One decode step: the next token into self.token, the position advanced."""
        x = self.embed[self.token]
        mask = (self.positions <= self.pos).view(1, 1, 1, -1)
        for weights, (k_cache, v_cache) in zip(self.layers, self.caches):
            x = self.layer(x, self.pos, self.cos, self.sin, mask, k_cache, v_cache, *weights,
                           *self.shape)
        logits = F.rms_norm(x, (x.shape[-1],), self.norm, 1e-5) @ self.lm_head
        self.token.copy_(logits.argmax(dim=-1))
        self.pos.add_(1)

    def time_steps(self, prompt_len: int, num_steps: int) -> float:
        """Milliseconds per decode step, from `prompt_len` to `prompt_len + num_steps`."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(3):  # compile, then settle the allocator
                self.pos.fill_(prompt_len)
                self.step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            self.step()
        self.pos.fill_(prompt_len)
        graph.replay()
        torch.cuda.synchronize()
        self.pos.fill_(prompt_len)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(num_steps):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / num_steps
