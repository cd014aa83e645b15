"""Token embedding and LM head, split by vocabulary across the tensor-parallel ranks.

The vocabulary is padded to a multiple of tp_size; each rank holds a contiguous slice of
rows. The embedding looks up the ids in its slice and the ranks sum their (mostly zero)
results; the LM head computes its slice of the logits and the ranks gather them."""
import torch
import torch.nn.functional as F
from torch import nn

from tllm.distributed import comm


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = comm.tp_rank_and_size()
        self.num_embeddings = num_embeddings
        rows = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return comm.tp_all_reduce(out.masked_fill(outside[:, None], 0.0))

    def load_weight(self, param_name: str, tensor: torch.Tensor) -> None:
        if tensor.shape != (self.num_embeddings, self.weight.shape[1]):
            raise ValueError(f"checkpoint tensor {param_name!r} has shape "
                             f"{tuple(tensor.shape)}, the model expects "
                             f"{(self.num_embeddings, self.weight.shape[1])}")
        part = tensor[self.vocab_start:self.vocab_start + self.weight.shape[0]]
        self.weight.data[:part.shape[0]].copy_(part)
        self.weight.data[part.shape[0]:].zero_()  # padding rows: never looked up


class LMHead(Embedding):
    """Vocabulary projection; may share its weight with the input embedding."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        return comm.tp_all_gather(logits, dim=-1)[..., :self.num_embeddings]
