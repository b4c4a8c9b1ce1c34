"""Speculative decoding with the checkpoint's own draft head (method "mtp"): checked and sized at start-up,
before the model is built, so the head's layers are built, loaded and given their KV cache with it."""

from __future__ import annotations

from pathlib import Path

from mmengine.config import EngineConfig
from mmengine.errors import ConfigError
from mmengine.models.family import ModelFamily


def enable_draft_head(config: EngineConfig, family: ModelFamily, model_dir: Path) -> None:
    """With method "mtp": the family's KV cache holds the head's layers after the decoder's. A checkpoint
    without the head's tensors, or a family that has none, is a ConfigError naming the method."""
    if config.spec_config.method != "mtp":
        return
    layers = family.draft_layers_in(model_dir)
    if layers == 0:
        raise ConfigError(f"speculative_config['method']='mtp': the checkpoint has no multi-token-prediction layers "
                          f"(mtp.fc and mtp.layers.N tensors) that {family.display_name or type(family).__name__} reads; "
                          "use method 'ngram', or a checkpoint that carries its MTP head")
    family.num_draft_layers = layers
