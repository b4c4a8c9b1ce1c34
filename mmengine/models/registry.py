"""Which checkpoint architectures mmengine can run, and how to build them."""

from __future__ import annotations

from pathlib import Path

from torch import nn
from transformers import AutoConfig, PretrainedConfig

from mmengine.errors import UnsupportedModelError
from mmengine.models.llava import LlavaModel

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlavaForConditionalGeneration": LlavaModel,
}


def load_hf_config(model_dir: Path) -> PretrainedConfig:
    if not (model_dir / "config.json").exists():
        raise UnsupportedModelError(f"{model_dir} is not a checkpoint directory (no config.json)")
    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def model_class_for(config: PretrainedConfig) -> type[nn.Module]:
    for arch in getattr(config, "architectures", None) or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    if config.model_type == "llava":
        return LlavaModel
    raise UnsupportedModelError(
        f"architecture {getattr(config, 'architectures', None) or config.model_type} is not supported; "
        f"supported: {', '.join(_ARCHITECTURES)}"
    )
