"""Gemma 4's decoder layers as its config describes them: each layer's kind, KV heads and head size, and whose
KV cache it reads; what the family (the KV cache's layout, on every process) and the decoder (gemma4_text.py) both
read, so it imports no model code.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError
from mmengine.models.text_config import FULL


@dataclass(frozen=True)
class LayerAttention:
    """One decoder layer's attention shape, and where its K/V live."""

    kind: str  # SLIDING or FULL
    num_kv_heads: int
    head_dim: int
    kv_source: int  # the layer whose cache it reads: itself, or (a KV-shared layer) an earlier one of its kind

    @property
    def stores_kv(self) -> bool:
        return self.kv_source < 0


def layer_attention(config: PretrainedConfig) -> list[LayerAttention]:
    """Each layer's attention, from the config as saved (transformers 5.2x writes the global layers'
    head size and KV heads in `per_layer_config`; older releases in `global_head_dim` and, with
    attention_k_eq_v, `num_global_key_value_heads`)."""
    raw = config.to_dict()
    overrides = {int(k): v for k, v in (raw.get("per_layer_config") or {}).items()}
    kinds = list(config.layer_types)
    first_shared = len(kinds) - (raw.get("num_kv_shared_layers") or 0)
    layers = []
    for index, kind in enumerate(kinds):
        kv_heads, head_dim = raw["num_key_value_heads"], raw["head_dim"]
        if index in overrides:
            kv_heads = overrides[index].get("num_key_value_heads", kv_heads)
            head_dim = overrides[index].get("head_dim", head_dim)
        elif kind == FULL:
            head_dim = raw.get("global_head_dim") or head_dim
            if raw.get("attention_k_eq_v") and raw.get("num_global_key_value_heads"):
                kv_heads = raw["num_global_key_value_heads"]
        source = -1
        if index >= first_shared:
            earlier = [j for j in range(first_shared) if kinds[j] == kind]
            if not earlier:
                raise UnsupportedModelError(f"KV-shared layer {index} ({kind}) has no earlier {kind} layer to read")
            source = earlier[-1]
        layers.append(LayerAttention(kind, kv_heads, head_dim, source))
    return layers
