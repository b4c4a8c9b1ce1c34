"""The Qwen-VL families' model (Qwen2VLFamily's model_class and its successors'): transformers' vision tower, whose
attention runs through layers/packed_vision_attention, over the Qwen2/Qwen3 decoder; the families themselves
(resize, items, M-RoPE positions) are in qwen_vl.py and qwen3_vl.py.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError
from mmengine.layers.packed_vision_attention import use_packed_attention
from mmengine.models.vlm import VisionLanguageModel


def _vision_tower_class(model_type: str) -> type[torch.nn.Module]:
    if model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return Qwen2_5_VisionTransformerPretrainedModel
    if model_type == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel
    if model_type == "qwen3_vl_moe":
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

        return Qwen3VLMoeVisionModel
    if model_type == "qwen3_5":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        return Qwen3_5VisionModel
    if model_type == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

        return Qwen3_5MoeVisionModel
    raise UnsupportedModelError(f"no Qwen vision tower for model_type {model_type!r}")


class QwenVLModel(VisionLanguageModel):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = _vision_tower_class(config.model_type)._from_config(config.vision_config)
        use_packed_attention(self.visual)
        self.merge_size = config.vision_config.spatial_merge_size
        self._build_text(config)

    @torch.inference_mode()
    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """All patches of the step's images as one sequence; the tower keeps images apart by their grids."""
        grids = torch.cat([item["image_grid_thw"] for item in items])
        # one item: its own tensor (a photo's patches are tens of MB, which a cat of one would copy)
        pixel_values = items[0]["pixel_values"] if len(items) == 1 else torch.cat([item["pixel_values"] for item in items])
        if self.device.type == "cuda":
            pixel_values = pixel_values.pin_memory()
        dtype = self.visual.patch_embed.proj.weight.dtype
        out = self.visual(pixel_values.to(self.device, dtype, non_blocking=True), grid_thw=grids.to(self.device))
        merged = out.pooler_output if hasattr(out, "pooler_output") else out
        levels = getattr(out, "deepstack_features", None)
        if levels:  # Qwen3-VL: an item's DeepStack levels travel with its embeddings, [tokens, hidden * (1 + levels)]
            merged = torch.cat([merged, *levels], dim=-1)
        sizes = (grids.prod(-1) // self.merge_size**2).tolist()
        return list(torch.split(merged, sizes))

    def encoder_rows(self, item: dict[str, torch.Tensor]) -> int:
        """Patches are packed: an item's rows are its patches (t * h * w)."""
        return int(item["image_grid_thw"].prod())

    def checkpoint_name(self, raw_name: str) -> str:
        """transformers >= 4.52 saves `model.visual.*` and `model.language_model.*`; the original
        checkpoints saved `visual.*` and the decoder as `model.*`."""
        if raw_name.startswith("model.visual."):
            return raw_name.removeprefix("model.")
        if raw_name.startswith("model.language_model."):
            return "language_model." + raw_name.removeprefix("model.language_model.")
        if raw_name.startswith(("visual.", "lm_head.")):
            return raw_name
        if raw_name.startswith("model."):
            return "language_model." + raw_name.removeprefix("model.")
        return raw_name
