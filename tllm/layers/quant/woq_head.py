"""The LM head as weight-only int8 (W8A16), for `quantization="int4_awq_int8_head"`: the
vocabulary projection is the largest single read of a batch-1 decode step (Llama-3.1-8B:
128256 x 4096 in bf16 = 1.05 GB a token, as much as 8 of its 32 layers at 4 bits); at 8 bits
it moves half of that. Round-to-nearest per row and group of 128 input features (AWQ-style
zero points), quantized from the loaded bf16/fp32 rows of this rank's vocabulary slice. A
tied embedding keeps its own (float) reference to the shared weight."""
from __future__ import annotations

import torch

from tllm.distributed import comm
from tllm.kernels import woq
from tllm.kernels.woq_ops import woq_linear
from tllm.layers.embedding import LMHead

HEAD_GROUP = 128


class WoqLMHead(LMHead):
    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int = 8) -> None:
        super().__init__(num_embeddings, embedding_dim)
        woq.pack_factor(bits)
        if embedding_dim % 16:
            raise ValueError(f"int{bits} LM head: hidden size {embedding_dim} is not a "
                             "multiple of 16")
        self.bits = bits
        self.layout: woq.WoqLayout | None = None

    def process_after_loading(self) -> None:
        weight = self.weight.data
        k = weight.shape[1]
        group = HEAD_GROUP if k % HEAD_GROUP == 0 else k
        q, scales, zeros = woq.quantize_rtn(weight, self.bits, group)
        self.layout = woq.WoqLayout(self.bits, group, woq.interleave_words(k, self.bits))
        dtype = torch.float16 if weight.device.type == "cuda" else torch.float32
        del self.weight  # a tied embedding holds the parameter itself
        self.weight = None
        self.register_buffer("qweight", woq.pack_rows(q.to(torch.int32), self.layout))
        self.register_buffer("scales", scales.to(dtype))
        self.register_buffer("zeros", zeros.to(dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.layout is None:           # not loaded yet (never in a built model)
            return super().forward(hidden)
        logits = woq_linear(hidden, self.qweight, self.scales, self.zeros, self.layout)
        if self.tp_size == 1:
            return logits
        return comm.tp_all_gather(logits, dim=-1)[..., :self.num_embeddings]
