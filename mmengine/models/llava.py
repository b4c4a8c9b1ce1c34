"""LLaVA-1.5-style VLM: a vision tower, a multi-modal projector and a Llama-family decoder.

The vision tower is transformers' own module (CLIP or SigLIP). Feature-layer selection
and the projector follow transformers' LlavaForConditionalGeneration exactly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import AutoModel, LlavaConfig
from transformers.activations import ACT2FN

from mmengine.errors import UnsupportedModelError
from mmengine.layers.attention import AttentionMetadata
from mmengine.models.llama import DecoderModel

SUPPORTED_VISION_MODEL_TYPES = ("clip_vision_model", "siglip_vision_model")
# Tower weights LLaVA never uses (SigLIP's pooling head): absent or extra in a checkpoint is fine.
_UNUSED_VISION_PREFIXES = ("head.",)


class LlavaProjector(nn.Module):
    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        layers = config.vision_feature_layer
        num_feature_layers = 1 if isinstance(layers, int) else len(layers)
        bias = getattr(config, "multimodal_projector_bias", True)
        text_hidden = config.text_config.hidden_size
        self.linear_1 = nn.Linear(config.vision_config.hidden_size * num_feature_layers, text_hidden, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaModel(nn.Module):
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
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaProjector(config)
        self.language_model = DecoderModel(config.text_config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config.text_config, "tie_word_embeddings", False)) or bool(
            getattr(config, "tie_word_embeddings", False)
        )

    # -- encoder ---------------------------------------------------------------

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[num_images, 3, H, W] -> [num_images, tokens_per_image, text_hidden]."""
        layer = self.config.vision_feature_layer
        out = self.vision_tower(pixel_values.to(self.vision_dtype), output_hidden_states=True, return_dict=True)
        layers = [layer] if isinstance(layer, int) else list(layer)
        selected = [out.hidden_states[i] for i in layers]
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

    # -- decoder ---------------------------------------------------------------

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    # -- weights ---------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision_state: dict[str, torch.Tensor] = {}
        loaded: set[str] = set()
        for raw_name, tensor in weights:
            name = normalize_llava_weight_name(raw_name)
            if name.startswith("vision_tower."):
                vision_state[self._vision_tower_key(name.removeprefix("vision_tower."))] = tensor
            elif name.startswith("language_model."):
                if not self.language_model.load_weight(name.removeprefix("language_model."), tensor):
                    raise UnsupportedModelError(f"unexpected checkpoint tensor {raw_name!r}")
            elif name.startswith(("multi_modal_projector.", "lm_head.")):
                self.get_parameter(name).data.copy_(tensor)
            else:
                raise UnsupportedModelError(f"unexpected checkpoint tensor {raw_name!r}")
            loaded.add(name)
        if "lm_head.weight" not in loaded:
            if not self.tie_word_embeddings:
                raise UnsupportedModelError("checkpoint has no lm_head.weight and does not tie word embeddings")
            self.lm_head.weight = self.language_model.embed_tokens.weight
        missing, unexpected = self.vision_tower.load_state_dict(vision_state, strict=False)
        missing = [m for m in missing if not m.startswith(_UNUSED_VISION_PREFIXES) and not m.endswith("position_ids")]
        unexpected = [u for u in unexpected if not u.startswith(_UNUSED_VISION_PREFIXES)]
        if missing or unexpected:
            raise UnsupportedModelError(f"vision tower weights do not match: missing {missing}, unexpected {unexpected}")


def normalize_llava_weight_name(name: str) -> str:
    """Maps both checkpoint layouts (transformers >= 4.52 and the original llava-hf one) onto ours."""
    if name.startswith("model."):
        name = name.removeprefix("model.")
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("language_model.model."):
        return "language_model." + name.removeprefix("language_model.model.")
    return name
