"""Qwen3.5 (dense): a hybrid decoder under Qwen3-VL's vision tower (without DeepStack); the family here, its model
(qwen3_5_model.py) imported only where the model is built.

Three of every four decoder layers (`layer_types` "linear_attention") are Gated DeltaNet: no KV cache,
a recurrent state per request instead (layers/gated_delta.py); the others are gated full attention.

The KV cache holds the attention layers only; the runner gives the linear layers their states and
each step's `RecurrentStep` (which slot each request continues, which checkpoints it saves).
Images, videos and positions are Qwen3-VL's (transformers uses Qwen3-VL's processor for Qwen3.5).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING


from mmengine.models.family import ModelClass
from mmengine.models.loader import checkpoint_shapes
from mmengine.models.qwen3_vl import Qwen3VLFamily

if TYPE_CHECKING:
    from mmengine.layers.gated_delta import GatedDeltaShape

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


class Qwen3_5Family(Qwen3VLFamily):
    architectures = ("Qwen3_5ForConditionalGeneration",)
    model_type = "qwen3_5"
    display_name = "Qwen3.5 (hybrid Gated DeltaNet / gated attention decoder, native-resolution vision)"
    model_class = ModelClass("mmengine.models.qwen3_5_model", "Qwen3_5Model")

    @property
    def deepstack_levels(self) -> int:
        return 0

    @property
    def layer_types(self) -> list[str]:
        return list(self.text_config.layer_types)

    @property
    def num_attention_layers(self) -> int:
        return self.layer_types.count(FULL_ATTENTION) + self.num_draft_layers

    def draft_layers_in(self, model_dir: Path) -> int:
        """The `mtp.layers.N` of the checkpoint's multi-token-prediction head (read from the headers)."""
        names = checkpoint_shapes(model_dir)
        if "mtp.fc.weight" not in names:
            return 0
        return len({int(name.split(".")[2]) for name in names if name.startswith("mtp.layers.")})

    @property
    def recurrent_shape(self) -> GatedDeltaShape | None:
        from mmengine.layers.gated_delta import GatedDeltaShape

        return GatedDeltaShape.of(self.text_config)

    @property
    def num_recurrent_layers(self) -> int:
        return self.layer_types.count(LINEAR_ATTENTION)


class Qwen3_5MoeFamily(Qwen3_5Family):
    architectures = ("Qwen3_5MoeForConditionalGeneration",)
    model_type = "qwen3_5_moe"
    display_name = "Qwen3.5-MoE (hybrid decoder with routed and shared experts, native-resolution vision)"
