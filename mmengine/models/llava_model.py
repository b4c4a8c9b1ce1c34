"""LLaVA-1.5's model: a vision tower, a multi-modal projector and a Llama-family decoder (LlavaFamily's model_class).

The vision tower is transformers' own module (CLIP or SigLIP), built with only the encoder layers
the feature selection reads (LLaVA's usual layer -2 leaves the last one unused) and without the
post-layernorm and pooling head, which act on the last output only, never on the selected hidden
states. Feature-layer selection and the projector follow transformers' LlavaForConditionalGeneration
exactly.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn
from transformers import AutoModel, LlavaConfig

from mmengine.errors import UnsupportedModelError
from mmengine.layers.activation import activation_module
from mmengine.models.vlm import VisionLanguageModel

SUPPORTED_VISION_MODEL_TYPES = ("clip_vision_model", "siglip_vision_model")
# Checkpoint tensors the model knows and does not use. The tower's post-layernorm and SigLIP's pooling
# head only act on the tower's last output; position_ids and rotary inv_freq are buffers that
# transformers recomputes (older checkpoints saved them). Encoder layers past the deepest selected one
# are matched by number in `is_ignorable`.
_IGNORABLE_VISION_PREFIXES = ("post_layernorm.", "head.")
_IGNORABLE_VISION_NAMES = ("embeddings.position_ids",)
_VISION_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.")


class LlavaProjector(nn.Module):
    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        layers = config.vision_feature_layer
        num_feature_layers = 1 if isinstance(layers, int) else len(layers)
        bias = getattr(config, "multimodal_projector_bias", True)
        text_hidden = config.text_config.hidden_size
        self.linear_1 = nn.Linear(config.vision_config.hidden_size * num_feature_layers, text_hidden, bias=bias)
        self.act = activation_module(config.projector_hidden_act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaModel(VisionLanguageModel):
    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        vision_type = config.vision_config.model_type
        if vision_type not in SUPPORTED_VISION_MODEL_TYPES:
            raise UnsupportedModelError(
                f"vision tower {vision_type!r} is not supported; supported: {', '.join(SUPPORTED_VISION_MODEL_TYPES)}"
            )
        strategy = config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise UnsupportedModelError(f"vision_feature_select_strategy {strategy!r} is not supported")
        self.config = config
        self.image_token_id = config.image_token_id
        self.num_checkpoint_vision_layers = config.vision_config.num_hidden_layers
        self.feature_layers = vision_feature_indices(config.vision_feature_layer, self.num_checkpoint_vision_layers)
        self.vision_tower = _build_vision_tower(config.vision_config, max(self.feature_layers))
        self.num_vision_layers = self.vision_tower.config.num_hidden_layers
        self.multi_modal_projector = LlavaProjector(config)
        self._build_text(config)

    # -- encoder ---------------------------------------------------------------

    @torch.inference_mode()
    def encode_items(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """A step's images (each {"pixel_values": [3, H, W]}, all the same size) through the tower as one
        batch; one [tokens_per_image, text_hidden] tensor per item, in order."""
        pixel_values = torch.stack([item["pixel_values"] for item in items])
        if self.device.type == "cuda":
            pixel_values = pixel_values.pin_memory()
        return list(self.encode_images(pixel_values.to(self.device, non_blocking=True)))

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[num_images, 3, H, W] -> [num_images, tokens_per_image, text_hidden]."""
        out = self.vision_tower(pixel_values.to(self.vision_dtype), output_hidden_states=True, return_dict=True)
        selected = [out.hidden_states[i] for i in self.feature_layers]
        if self.config.vision_feature_select_strategy == "default":
            selected = [h[:, 1:] for h in selected]  # drop CLS
        return self.multi_modal_projector(torch.cat(selected, dim=-1))

    def _vision_tower_key(self, name: str) -> str:
        """Original llava-hf checkpoints nest the tower under `vision_model.`; transformers 5's
        CLIPVisionModel/SiglipVisionModel no longer have that level."""
        if name.startswith("vision_model.") and not hasattr(self.vision_tower, "vision_model"):
            return name.removeprefix("vision_model.")
        return name

    @property
    def vision_dtype(self) -> torch.dtype:
        return self.multi_modal_projector.linear_1.weight.dtype

    # -- weights ---------------------------------------------------------------

    def checkpoint_name(self, raw_name: str) -> str:
        name = normalize_llava_weight_name(raw_name)
        if name.startswith("vision_tower."):
            return "vision_tower." + self._vision_tower_key(name.removeprefix("vision_tower."))
        return name

    def is_ignorable(self, name: str) -> bool:
        if name.startswith("language_model."):
            return super().is_ignorable(name)
        if not name.startswith("vision_tower."):
            return False
        key = name.removeprefix("vision_tower.").removeprefix("vision_model.")
        if key in _IGNORABLE_VISION_NAMES or key.startswith(_IGNORABLE_VISION_PREFIXES):
            return True
        layer = _VISION_LAYER.match(key)  # a layer the tower was built without (unused by the selection)
        return layer is not None and self.num_vision_layers <= int(layer.group(1)) < self.num_checkpoint_vision_layers


def vision_feature_indices(feature_layer: int | list[int], num_layers: int) -> list[int]:
    """transformers' vision_feature_layer as indices into hidden_states counted from the embeddings
    (0 = the embeddings, i = the output of encoder layer i), so a shorter tower indexes the same way."""
    layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    indices = []
    for layer in layers:
        if not isinstance(layer, int) or not -(num_layers + 1) <= layer <= num_layers:
            raise UnsupportedModelError(
                f"vision_feature_layer {feature_layer!r} is out of range for a vision tower of {num_layers} layers"
            )
        indices.append(layer % (num_layers + 1))
    if not indices:
        raise UnsupportedModelError("vision_feature_layer selects no layer")
    return indices


def _build_vision_tower(vision_config, deepest: int) -> nn.Module:
    """transformers' vision model with only the encoder layers up to `deepest`, and without the
    post-layernorm and pooling head. (A config asking for post-normed hidden states keeps all.)"""
    if getattr(vision_config, "tie_last_hidden_states", False):
        return AutoModel.from_config(vision_config)
    trimmed = copy.deepcopy(vision_config)
    trimmed.num_hidden_layers = max(deepest, 1)
    if hasattr(trimmed, "vision_use_head"):
        trimmed.vision_use_head = False
    tower = AutoModel.from_config(trimmed)
    getattr(tower, "vision_model", tower).post_layernorm = nn.Identity()
    return tower


def normalize_llava_weight_name(name: str) -> str:
    """Maps both checkpoint layouts (transformers >= 4.52 and the original llava-hf one) onto ours."""
    if name.startswith("model."):
        name = name.removeprefix("model.")
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("language_model.model."):
        return "language_model." + name.removeprefix("language_model.model.")
    return name
