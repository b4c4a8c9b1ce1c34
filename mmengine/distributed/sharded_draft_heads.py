"""Draft heads split over the tensor-parallel ranks as the decoder's layers are, and read shard by shard.

```
Qwen3.5's MTP head (mtp.*)     fc                      ColumnParallelLinear, gathered (every rank reads the whole row)
                               layers.N.self_attn      gated attention: heads split (sharded_hybrid.py)
                               layers.N.mlp            gate/up column-, down row-parallel; MoE: the experts' split
                               norms                   replicated
                               embeddings, LM head     the target's (already split by vocabulary)
EAGLE-3 head                   fc                      ColumnParallelLinear, gathered
                               midlayer.self_attn      q heads split; KV heads split or replicated; o row-parallel
                               midlayer.mlp            gate/up column-, down row-parallel
                               embed_tokens, lm_head   split by vocabulary (its own draft vocabulary)
                               norms, d2t, rotary      replicated
```

Each head's attention layer keeps its K/V in the rank's paged KV cache after the target's layers, with this
rank's KV heads (the ranked family's `kv_cache_layout`). `check_draft_head_shapes` refuses, before any process
starts, a head whose sizes the ranks do not divide, naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmengine.config import EngineConfig
from mmengine.distributed.checkpoint_slices import CheckpointSlices, load_parameter
from mmengine.distributed.parallel_linear import ColumnParallelLinear, MergedColumnParallelLinear, Piece, RowParallelLinear
from mmengine.distributed.process_group import TensorParallelGroup
from mmengine.distributed.sharding import divide, kv_head_split
from mmengine.distributed.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from mmengine.models.family import ModelFamily
from mmengine.models.loader import WeightCheck, materialize_parameters, parameters_on_meta


def check_draft_head_shapes(config: EngineConfig, family: ModelFamily, tp_size: int) -> None:
    """A ConfigError naming the field when the ranks cannot split the draft head (the MTP head's layers have the
    target's shapes, which `check_tensor_parallel_shapes` checks; its fc splits the hidden size)."""
    method = config.spec_config.method
    if tp_size == 1 or not config.spec_config.num_speculative_tokens or method not in ("mtp", "eagle3"):
        return
    if method == "mtp":
        divide(family.text_config.hidden_size, tp_size, "speculative_config['method']='mtp': mtp.fc", "hidden_size")
        return
    from mmengine.models.eagle3 import load_eagle3_config

    model_dir = config.spec_config.draft_model
    draft = load_eagle3_config(model_dir)
    head = f"speculative_config['model']={model_dir!r}"
    divide(draft.hidden_size, tp_size, head, "hidden_size")
    divide(draft.num_attention_heads, tp_size, head, "num_attention_heads")
    kv_head_split(draft.num_key_value_heads, tp_size, head)
    divide(draft.intermediate_size, tp_size, head, "intermediate_size")


def shard_mtp_head(model: nn.Module, tp: TensorParallelGroup, expert_parallel: bool = False) -> None:
    """Swaps the MTP head's fc and layers for this rank's parallel ones (its MLP or MoE block by the decoder's rule)."""
    from mmengine.distributed.sharded_hybrid import shard_gated_attention
    from mmengine.distributed.sharded_layers import shard_layer_mlp

    mtp = model.mtp
    hidden = model.language_model.config.hidden_size
    mtp.fc = ColumnParallelLinear(2 * hidden, hidden, bias=False, gather_output=True, tp=tp, name="mtp.fc")
    for index, layer in enumerate(mtp.layers):
        shard_gated_attention(layer.self_attn, tp, f"mtp.layers.{index}.self_attn")
        shard_layer_mlp(layer.mlp, hidden, tp, f"mtp.layers.{index}.mlp", expert_parallel)


def build_eagle3_head(config: Any, target_hidden: int, own_embeddings: bool, model_dir: str, tp: TensorParallelGroup,
                      device: torch.device, dtype: torch.dtype) -> nn.Module:
    """This rank's EAGLE-3 head: built on meta, split, given storage, and loaded with this rank's slices."""
    from mmengine.models.eagle3 import Eagle3Head

    with torch.device(device), parameters_on_meta():
        head = Eagle3Head(config, target_hidden, own_embeddings)
    expected = head.checkpoint_shapes()  # the checkpoint's whole shapes, before the split
    shard_eagle3_head(head, tp)
    materialize_parameters(head, device)
    head.to(dtype)
    load_eagle3_shards(head, Path(model_dir), expected)
    return head.eval()


def shard_eagle3_head(head: nn.Module, tp: TensorParallelGroup) -> None:
    from mmengine.distributed.sharded_layers import split_mlp

    hidden = head.config.hidden_size
    head.fc = ColumnParallelLinear(head.fc.in_features, hidden, bias=False, gather_output=True, tp=tp, name="fc")
    if head.embed_tokens is not None:
        head.embed_tokens = VocabParallelEmbedding(head.config.vocab_size, hidden, tp=tp, name="embed_tokens")
    attn = head.midlayer.self_attn
    d, width = attn.head_dim, attn.q_proj.in_features
    bias = attn.q_proj.bias is not None
    split = kv_head_split(attn.num_kv_heads, tp.size, "midlayer.self_attn.k_proj")
    heads = divide(attn.num_heads, tp.size, "midlayer.self_attn.q_proj", "num_attention_heads")
    attn.q_proj = ColumnParallelLinear(width, attn.num_heads * d, bias=bias, tp=tp, name="midlayer.self_attn.q_proj")
    for name in ("k_proj", "v_proj"):
        piece = Piece(attn.num_kv_heads * d, split.first_head(tp.rank) * d, split.heads_per_rank * d, 0)
        setattr(attn, name, MergedColumnParallelLinear(width, [piece.full], bias=bias, tp=tp, name=f"midlayer.self_attn.{name}",
                                                       pieces=[piece]))
    attn.o_proj = RowParallelLinear(attn.num_heads * d, hidden, bias=attn.o_proj.bias is not None, tp=tp,
                                    name="midlayer.self_attn.o_proj")
    attn.num_heads, attn.num_kv_heads = heads, split.heads_per_rank
    attn.attn.num_heads, attn.attn.num_kv_heads = heads, split.heads_per_rank
    split_mlp(head.midlayer.mlp, hidden, tp, "midlayer.mlp")
    head.lm_head = ParallelLMHead(head.draft_vocab_size, hidden, tp=tp, name="lm_head")


def load_eagle3_shards(head: nn.Module, model_dir: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Every tensor of the head's checkpoint checked against its whole shape (as `Eagle3Head.load` does) and this
    rank's part of it read."""
    from mmengine.models.eagle3 import head_parameter_name

    slices = CheckpointSlices(model_dir)
    optional = ["d2t"] if head.draft_vocab_size == head.config.vocab_size else []
    check = WeightCheck(expected, slices, optional=optional)
    mlp = head.midlayer.mlp
    for raw_name, tensor in slices:
        name = head_parameter_name(raw_name)
        if name == "t2d":
            continue
        check.accept(name, raw_name, tensor)
        parts = name.split(".")
        if name == "d2t":
            with torch.no_grad():
                head.d2t.copy_(tensor[...].to(torch.long))
        elif parts[-2] in ("gate_proj", "up_proj"):
            load_parameter(getattr(mlp.gate_up_proj, parts[-1]), tensor, ("gate_proj", "up_proj").index(parts[-2]), name)
        else:
            load_parameter(head.get_parameter(name), tensor, None, name)
    check.finish()
