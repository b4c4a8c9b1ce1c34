"""The vocabulary split over the tensor-parallel ranks: the token embedding and the LM head.

Rank r holds the rows of tokens [r*V_r, (r+1)*V_r). The vocabulary is padded up to a multiple of
tp_size * `pad_to` (vLLM pads to 64 per rank's share) so that any vocabulary size splits; padding rows are
zero and never looked up, and padding logits are cut off after the gather.

```
VocabParallelEmbedding  ids outside this rank's range look up row 0 and are zeroed; the ranks' rows are all-reduced
ParallelLMHead          each rank computes its vocabulary's logits; they are all-gathered and cut to the vocabulary
```
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmengine.distributed.process_group import TensorParallelGroup, single_rank_group
from mmengine.distributed.sharding import Loaded, copy_into, loaded_shape, read_rows
from mmengine.errors import WeightsMismatchError


def padded_vocab_size(vocab_size: int, tp_size: int, pad_to: int = 1) -> int:
    multiple = tp_size * pad_to
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TensorParallelGroup | None = None,
                 name: str = "", pad_to: int = 1, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.tp = tp or single_rank_group()
        self.name = name or type(self).__name__
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padded_num_embeddings = padded_vocab_size(num_embeddings, self.tp.size, pad_to)
        self.num_embeddings_per_rank = self.padded_num_embeddings // self.tp.size
        self.vocab_start = self.tp.rank * self.num_embeddings_per_rank
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_rank, num_embeddings)  # real rows held
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def extra_repr(self) -> str:
        return f"vocab=[{self.vocab_start}, {self.vocab_end}) of {self.num_embeddings}, dim={self.embedding_dim}"

    def weight_loader(self, param: nn.Parameter, loaded: Loaded) -> None:
        """From the whole [vocab, dim] tensor (this rank's rows are read), or from this rank's padded shard."""
        rows = loaded_shape(loaded)[0]
        held = max(0, self.vocab_end - self.vocab_start)
        if rows == self.num_embeddings or rows == self.padded_num_embeddings:
            shard = read_rows(loaded, 0, self.vocab_start, held)
        elif rows == self.num_embeddings_per_rank:
            shard = read_rows(loaded, 0, 0, held)
        else:
            raise WeightsMismatchError(
                f"{self.name}: a tensor of {rows} rows is neither the vocabulary ({self.num_embeddings}) nor this rank's shard ({self.num_embeddings_per_rank})"
            )
        with torch.no_grad():
            param[held:].zero_()
        copy_into(param.narrow(0, 0, held), shard, self.name)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(rows)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden W^T (+ b) over the whole vocabulary, each rank computing its share."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, bias: bool = False,
                 tp: TensorParallelGroup | None = None, name: str = "", pad_to: int = 1,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, tp=tp, name=name, pad_to=pad_to, dtype=dtype, device=device)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.num_embeddings_per_rank, dtype=dtype, device=device), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Shares the embedding's weight (same split), for checkpoints with tie_word_embeddings."""
        if (embedding.num_embeddings, embedding.padded_num_embeddings) != (self.num_embeddings, self.padded_num_embeddings):
            raise WeightsMismatchError(f"{self.name}: cannot tie to {embedding.name}, whose vocabulary is split differently")
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = F.linear(hidden, self.weight, self.bias)
        return self.tp.all_gather_last_dim(logits)[..., : self.num_embeddings]
