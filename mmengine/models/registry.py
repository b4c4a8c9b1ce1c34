"""Which checkpoint architectures mmengine can run, and how to build them."""

from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoConfig, PretrainedConfig

from mmengine.errors import CheckpointError, UnsupportedModelError
from mmengine.models.config_import import import_config_code

if TYPE_CHECKING:
    from mmengine.models.family import ModelFamily

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FamilyEntry:
    """Where a supported family lives: it is imported only when a checkpoint needs it, so a process pays
    for one family's module (its vision tower, its processor code), not for every family's."""

    architecture: str
    module: str
    class_name: str

    def load(self) -> type[ModelFamily]:
        return getattr(importlib.import_module(self.module), self.class_name)


# Every supported family, by model_type; adding one is a new file under models/ and an entry here.
FAMILIES: dict[str, FamilyEntry] = {
    "llava": FamilyEntry("LlavaForConditionalGeneration", "mmengine.models.llava", "LlavaFamily"),
    "qwen2_vl": FamilyEntry("Qwen2VLForConditionalGeneration", "mmengine.models.qwen_vl", "Qwen2VLFamily"),
    "qwen2_5_vl": FamilyEntry("Qwen2_5_VLForConditionalGeneration", "mmengine.models.qwen_vl", "Qwen2_5_VLFamily"),
    "qwen3_vl": FamilyEntry("Qwen3VLForConditionalGeneration", "mmengine.models.qwen3_vl", "Qwen3VLFamily"),
    "qwen3_vl_moe": FamilyEntry("Qwen3VLMoeForConditionalGeneration", "mmengine.models.qwen3_vl", "Qwen3VLMoeFamily"),
    "qwen3_5": FamilyEntry("Qwen3_5ForConditionalGeneration", "mmengine.models.qwen3_5", "Qwen3_5Family"),
    "qwen3_5_moe": FamilyEntry("Qwen3_5MoeForConditionalGeneration", "mmengine.models.qwen3_5", "Qwen3_5MoeFamily"),
    "gemma3": FamilyEntry("Gemma3ForConditionalGeneration", "mmengine.models.gemma3", "Gemma3Family"),
    "gemma4": FamilyEntry("Gemma4ForConditionalGeneration", "mmengine.models.gemma4", "Gemma4Family"),
    "llava_onevision": FamilyEntry("LlavaOnevisionForConditionalGeneration", "mmengine.models.llava_onevision",
                                   "LlavaOnevisionFamily"),
    "idefics3": FamilyEntry("Idefics3ForConditionalGeneration", "mmengine.models.idefics3", "Idefics3Family"),
    "smolvlm": FamilyEntry("SmolVLMForConditionalGeneration", "mmengine.models.idefics3", "SmolVLMFamily"),
    "internvl": FamilyEntry("InternVLForConditionalGeneration", "mmengine.models.internvl", "InternVLFamily"),
    "mistral3": FamilyEntry("Mistral3ForConditionalGeneration", "mmengine.models.mistral3", "Mistral3Family"),
    "llama4": FamilyEntry("Llama4ForConditionalGeneration", "mmengine.models.llama4", "Llama4Family"),
}
_BY_ARCHITECTURE = {entry.architecture: entry for entry in FAMILIES.values()}


def load_hf_config(model_dir: Path) -> PretrainedConfig:
    """The checkpoint's config; an absent, unparsable or rejected config.json is a CheckpointError naming it."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} is not a checkpoint directory (no config.json)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"not valid JSON ({err})", path) from err
    if not isinstance(raw, dict):
        raise CheckpointError(f"must hold a JSON object, not {type(raw).__name__}", path)
    import_config_code()  # (before AutoConfig imports a config class: without transformers' model loading code)
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as err:  # transformers rejects a config with any of several exception types
        raise CheckpointError(f"transformers rejects this config: {_first_line(err)}", path) from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return " ".join(line.strip() for line in text.splitlines() if line.strip())[:300]


def family_class_for(config: PretrainedConfig) -> type[ModelFamily]:
    """The family of a checkpoint's config, by architecture name (or model_type when none is given)."""
    for arch in getattr(config, "architectures", None) or []:
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch].load()
    if config.model_type in FAMILIES:
        return FAMILIES[config.model_type].load()
    raise UnsupportedModelError(
        f"architecture {getattr(config, 'architectures', None) or config.model_type} is not supported; "
        f"supported: {', '.join(_BY_ARCHITECTURE)}"
    )


def load_family(config: PretrainedConfig, hf_processor: Any, model_dir: str | Path | None = None) -> ModelFamily:
    """The checkpoint's family, told the settings its loaded image processor really uses (and where the
    checkpoint is, for its other processor files)."""
    return family_class_for(config)(config, image_processor_settings(hf_processor.image_processor), model_dir)


def image_processor_settings(image_processor: Any) -> dict[str, Any]:
    """The settings a family may read from an image processor (the sizes its resize and patching use)."""
    settings: dict[str, Any] = {}
    for name in ("size", "patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels", "max_soft_tokens",
                 "pooling_kernel_size", "max_image_size", "do_image_splitting", "do_resize", "crop_to_patches", "min_patches",
                 "max_patches", "resize_to_max_canvas"):
        value = getattr(image_processor, name, None)
        if value is None:
            continue
        if name == "size" and not isinstance(value, dict):
            value = {key: getattr(value, key) for key in ("shortest_edge", "longest_edge", "height", "width") if getattr(value, key, None)}
        settings[name] = value
    return settings


# The files a tokenizer can be read from (any one suffices), and the processor's image settings.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
_JSON_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "preprocessor_config.json", "processor_config.json", "chat_template.json", "generation_config.json",
)


def load_hf_processor(model_dir: Path, mm_processor_kwargs: dict[str, Any] | None = None, light: bool = False) -> Any:
    """The checkpoint's HF processor (tokenizer + image processor), loaded the way its family needs,
    with `mm_processor_kwargs` overriding its saved settings. A missing or broken file is a
    CheckpointError naming it, rather than whatever transformers raises. `light`: a front end's, its family's
    LightProcessor (the same parts without transformers' processor class and modeling code) where it has one,
    else the full processor (logged once per family, with why)."""
    _check_processor_files(model_dir)
    family = family_class_for(load_hf_config(model_dir))
    overrides = dict(mm_processor_kwargs or {})
    try:
        processor = family.load_light_processor(str(model_dir), overrides) if light else None
        if light and processor is None:
            _log_full_processor(family)
        return processor if processor is not None else family.load_processor(str(model_dir), overrides)
    except Exception as err:  # transformers raises OSError, ValueError, TypeError, KeyError, ... here
        raise CheckpointError(f"cannot load the tokenizer and processor: {_first_line(err)}", model_dir) from err


_FULL_PROCESSOR_LOGGED: set[str] = set()


def _log_full_processor(family: type[ModelFamily]) -> None:
    if family.__name__ not in _FULL_PROCESSOR_LOGGED:
        _FULL_PROCESSOR_LOGGED.add(family.__name__)
        logger.info("%s: the front end loads transformers' full processor (and its modeling code): %s",
                    family.display_name or family.__name__, family.full_processor_reason)


def load_hf_tokenizer(model_dir: Path) -> Any:
    """The checkpoint's tokenizer alone, as every family's processor loads it (AutoTokenizer on the checkpoint's
    directory), for a process that only tokenizes: no image processor, no family, no modeling code imported."""
    _check_tokenizer_files(model_dir)
    from transformers import AutoTokenizer

    import_config_code()  # (AutoTokenizer reads the checkpoint's config to find its tokenizer class)
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError, TypeError, KeyError, ... here
        raise CheckpointError(f"cannot load the tokenizer: {_first_line(err)}", model_dir) from err


def _check_processor_files(model_dir: Path) -> None:
    _check_tokenizer_files(model_dir)
    if not any((model_dir / name).is_file() for name in _PROCESSOR_FILES):
        raise CheckpointError(
            f"no image processor settings: expected {' or '.join(_PROCESSOR_FILES)}", model_dir / _PROCESSOR_FILES[0]
        )


def _check_tokenizer_files(model_dir: Path) -> None:
    """Every JSON file the checkpoint has parses, and it has a tokenizer file."""
    for name in _JSON_FILES:
        path = model_dir / name
        if path.is_file():
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError) as err:
                raise CheckpointError(f"not valid JSON ({err})", path) from err
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise CheckpointError(f"no tokenizer file: expected one of {', '.join(_TOKENIZER_FILES)}", model_dir / _TOKENIZER_FILES[0])
