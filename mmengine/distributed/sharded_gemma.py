"""Gemma 3's and Gemma 4's decoders split over the tensor-parallel ranks.

```
q_proj / o_proj                column / row-parallel by heads; the per-head q/k/v norms whole
k_proj, v_proj                 by the KV-head rule of each layer (Gemma 4's global layers have their own KV heads;
                               a KV-shared layer has none and reads its source's cache, split alike)
gate_up / down                 column / row-parallel (Gemma's gated MLP, double-wide ones too)
experts (Gemma 4 MoE block)    on their intermediate size, or whole experts per rank (expert parallelism); the router whole
embed_tokens                   vocabulary-parallel, scaled as Gemma scales it
embed_tokens_per_layer         vocabulary-parallel too (Gemma 4's per-layer inputs: the largest table of the model)
per-layer projections, norms   whole on every rank
```
"""

from __future__ import annotations

import torch
from torch import nn

from mmengine.distributed.parallel_experts import ExpertParallelFusedExperts, ParallelFusedExperts
from mmengine.distributed.parallel_linear import ColumnParallelLinear, MergedColumnParallelLinear, Piece, RowParallelLinear
from mmengine.distributed.process_group import TensorParallelGroup
from mmengine.distributed.sharding import divide, kv_head_split
from mmengine.distributed.vocab_parallel import VocabParallelEmbedding


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """Gemma's ScaledEmbedding split over the vocabulary: the rows times a constant rounded to the weight's dtype."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float, *, tp: TensorParallelGroup, name: str) -> None:
        super().__init__(num_embeddings, embedding_dim, tp=tp, name=name)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * float(torch.tensor(self.scale).to(self.weight.dtype))


def kv_projection(hidden: int, num_kv_heads: int, head_dim: int, bias: bool, tp: TensorParallelGroup, name: str) -> nn.Module:
    """A k or v projection of its own: this rank's KV heads (split, or the one head it replicates)."""
    split = kv_head_split(num_kv_heads, tp.size, name)
    piece = Piece(num_kv_heads * head_dim, split.first_head(tp.rank) * head_dim, split.heads_per_rank * head_dim, 0)
    return MergedColumnParallelLinear(hidden, [piece.full], bias=bias, tp=tp, name=name, pieces=[piece])


def shard_gemma_attention(attn: nn.Module, hidden: int, tp: TensorParallelGroup, prefix: str) -> None:
    d = attn.head_dim
    heads = divide(attn.num_heads, tp.size, f"{prefix}.q_proj", "num_attention_heads")
    bias = attn.q_proj.bias is not None
    attn.q_proj = ColumnParallelLinear(hidden, attn.num_heads * d, bias=bias, tp=tp, name=f"{prefix}.q_proj")
    attn.o_proj = RowParallelLinear(attn.num_heads * d, hidden, bias=attn.o_proj.bias is not None, tp=tp, name=f"{prefix}.o_proj")
    kv_heads = kv_head_split(attn.num_kv_heads, tp.size, f"{prefix}.k_proj").heads_per_rank
    if getattr(attn, "k_proj", None) is not None:
        attn.k_proj = kv_projection(hidden, attn.num_kv_heads, d, bias, tp, f"{prefix}.k_proj")
    if getattr(attn, "v_proj", None) is not None:
        attn.v_proj = kv_projection(hidden, attn.num_kv_heads, d, bias, tp, f"{prefix}.v_proj")
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    attn.attn.num_heads, attn.attn.num_kv_heads = heads, kv_heads


def shard_gemma_mlp(mlp: nn.Module, hidden: int, tp: TensorParallelGroup, prefix: str) -> None:
    inter = mlp.intermediate_size
    mlp.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, tp=tp, name=f"{prefix}.gate_up_proj")
    mlp.down_proj = RowParallelLinear(inter, hidden, bias=False, tp=tp, name=f"{prefix}.down_proj")
    mlp.intermediate_size = inter // tp.size


def shard_gemma_decoder(decoder: nn.Module, tp: TensorParallelGroup, expert_parallel: bool = False) -> None:
    config = decoder.config
    hidden = config.hidden_size
    embed = decoder.embed_tokens
    decoder.embed_tokens = ScaledVocabParallelEmbedding(embed.num_embeddings, hidden, embed.scale, tp=tp,
                                                        name="language_model.embed_tokens")
    per_layer = getattr(decoder, "embed_tokens_per_layer", None)
    if per_layer is not None:
        decoder.embed_tokens_per_layer = ScaledVocabParallelEmbedding(per_layer.num_embeddings, per_layer.embedding_dim,
                                                                      per_layer.scale, tp=tp,
                                                                      name="language_model.embed_tokens_per_layer")
    for index, layer in enumerate(decoder.layers):
        prefix = f"language_model.layers.{index}"
        shard_gemma_attention(layer.self_attn, hidden, tp, f"{prefix}.self_attn")
        shard_gemma_mlp(layer.mlp, hidden, tp, f"{prefix}.mlp")
        if getattr(layer, "has_moe", False):
            experts_class = ExpertParallelFusedExperts if expert_parallel else ParallelFusedExperts
            layer.experts = experts_class(layer.experts, tp, f"{prefix}.experts")
