"""The steps every tiny checkpoint builder shares: a spec's decoder and vision tower sizes as config
arguments, the special token ids, the weights with their generation config, and the processor's files
as the published checkpoints lay them out. A family's module keeps only what is its own."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mmengine.testing.tokenizer import model_vocab_size
from mmengine.testing.weights import save_random_model, torch_dtype

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast
    from transformers.image_processing_utils import ImageProcessingMixin

# The decoder sizes every family's text config takes, under the same names in the specs.
DECODER_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "max_position_embeddings")
# A vision tower config's size arguments and the spec fields they come from.
VISION_SIZES = {"hidden_size": "vision_hidden_size", "intermediate_size": "vision_intermediate_size",
                "num_hidden_layers": "vision_num_layers", "num_attention_heads": "vision_num_heads",
                "image_size": "image_size", "patch_size": "patch_size"}


def text_config_args(
    spec: Any, tokenizer: PreTrainedTokenizerFast, initializer_range: float, *, sizes: Sequence[str] = DECODER_SIZES,
    bos_token: str | None = None,
) -> dict[str, Any]:
    """The text config arguments every family's decoder takes alike: the model's vocabulary (the tokenizer's, or the
    spec's vocab_size), the spec's `sizes` (under their names there), the weight scale and the special token ids
    (`bos_token` as for special_token_ids)."""
    return dict(vocab_size=model_vocab_size(tokenizer, spec.vocab_size), **{name: getattr(spec, name) for name in sizes},
                initializer_range=initializer_range, **special_token_ids(tokenizer, bos_token))


def vision_sizes(spec: object, **overrides: Any) -> dict[str, Any]:
    """The vision tower's VISION_SIZES read off the spec, as config arguments; `overrides` stand for the
    ones a family sizes otherwise (they are not read from the spec)."""
    sizes = {name: getattr(spec, field) for name, field in VISION_SIZES.items() if name not in overrides}
    return sizes | overrides


def special_token_ids(tokenizer: PreTrainedTokenizerFast, bos_token: str | None = None) -> dict[str, int]:
    """bos, eos and pad ids for a config; `bos_token` for a tokenizer without a BOS of its own (Qwen's
    checkpoints name <|endoftext|>)."""
    bos_id = tokenizer.bos_token_id if bos_token is None else tokenizer.convert_tokens_to_ids(bos_token)
    return dict(bos_token_id=bos_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def save_checkpoint(
    path: str | os.PathLike,
    model_class: type[PreTrainedModel],
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerFast,
    save_processor: Callable[[pathlib.Path], None],
    *,
    seed: int,
    device: str,
    dtype: torch.dtype | str,
    eos_tokens: Sequence[str] | None = None,
    bos_token: str | None = None,
    **weights: Any,
) -> pathlib.Path:
    """Saves random weights of `model_class(config)` (weights.save_random_model; `weights` are its
    constant_noise, max_shard_size and tweak) with a generation config that stops at `eos_tokens` (None:
    the tokenizer's eos alone), then `save_processor(path)`; returns the path."""
    from transformers import GenerationConfig

    path = pathlib.Path(path)
    ids = special_token_ids(tokenizer, bos_token)
    if eos_tokens is not None:
        ids["eos_token_id"] = [tokenizer.convert_tokens_to_ids(token) for token in eos_tokens]
    save_random_model(model_class, config, GenerationConfig(**ids), path, seed=seed, device=device, dtype=torch_dtype(dtype),
                      **weights)
    save_processor(path)
    return path


def save_processor_files(
    path: pathlib.Path,
    tokenizer: PreTrainedTokenizerFast,
    *,
    chat_template: str,
    settings: dict[str, Any],
    image_processor: ImageProcessingMixin | dict[str, Any],
    image_processor_type: str | None = None,
    video_settings: dict[str, Any] | None = None,
) -> None:
    """A processor's files as published checkpoints lay them out: preprocessor_config.json (the image
    processor's, or `image_processor` itself when it is a dict of settings; with `image_processor_type`,
    renamed to it and tied to settings' processor_class), the tokenizer files, processor_config.json
    (`settings`), chat_template.json and, with `video_settings`, video_preprocessor_config.json."""
    if isinstance(image_processor, dict):
        write_json(path / "preprocessor_config.json", image_processor)
    else:
        image_processor.save_pretrained(path)
        if image_processor_type is not None:
            update_json(path / "preprocessor_config.json", image_processor_type=image_processor_type,
                        processor_class=settings["processor_class"])
    tokenizer.save_pretrained(path)
    write_json(path / "processor_config.json", settings)
    write_json(path / "chat_template.json", {"chat_template": chat_template})
    if video_settings is not None:
        write_json(path / "video_preprocessor_config.json", video_settings)


def write_json(path: pathlib.Path, data: dict[str, Any], *, sort_keys: bool = False) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=sort_keys) + "\n")


def update_json(path: pathlib.Path, *, sort_keys: bool = False, **values: Any) -> None:
    """Sets `values` in the JSON file at `path` (new keys last, unless `sort_keys`)."""
    write_json(path, json.loads(path.read_text()) | values, sort_keys=sort_keys)
