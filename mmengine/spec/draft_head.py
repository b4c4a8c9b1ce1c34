"""Speculative decoding with a draft head: the checkpoint's own (method "mtp") or an EAGLE-3 head (method
"eagle3"), checked and sized at start-up, before the model is built, so the head is built and loaded with it
and its layers get their KV cache with the target's."""

from __future__ import annotations

from pathlib import Path

from mmengine.config import EngineConfig
from mmengine.errors import ConfigError
from mmengine.models.family import ModelFamily


def enable_draft_head(config: EngineConfig, family: ModelFamily, model_dir: Path) -> None:
    """With a draft head, the family's KV cache holds its layers after the decoder's. A checkpoint without
    the MTP head's tensors, a family without a head of that method, or an EAGLE-3 head that does not fit
    the target (vocabulary, hidden size, its directory) is a ConfigError naming the setting."""
    if config.spec_config.method == "eagle3":
        _enable_eagle3(config, family)
    if config.spec_config.method != "mtp":
        return
    layers = family.draft_layers_in(model_dir)
    if layers == 0:
        raise ConfigError(f"speculative_config['method']='mtp': the checkpoint has no multi-token-prediction layers "
                          f"(mtp.fc and mtp.layers.N tensors) that {family.display_name or type(family).__name__} reads; "
                          "use method 'ngram', or a checkpoint that carries its MTP head")
    family.num_draft_layers = layers


def _enable_eagle3(config: EngineConfig, family: ModelFamily) -> None:
    """With method "eagle3": the head reads a Llama-like decoder's layer inputs (models/llama.py's DecoderModel:
    LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen3-VL and the other families built on it); its layer joins the KV cache."""
    from mmengine.models.eagle3 import aux_layer_ids, check_draft_fits, load_eagle3_config
    from mmengine.models.llama import DecoderModel, head_dim_of

    model_dir = config.spec_config.draft_model
    if getattr(family.model_class, "decoder_class", None) is not DecoderModel:
        raise ConfigError(f"speculative_config['method']='eagle3': an EAGLE-3 head reads a Llama-like decoder's layers; "
                          f"{family.display_name or type(family).__name__} has another decoder (use 'ngram', or on "
                          "Qwen3.5 'mtp')")
    draft = load_eagle3_config(model_dir)
    check_draft_fits(draft, model_dir, family.text_config)
    aux_layer_ids(draft, family.text_config.num_hidden_layers)  # three of the target's layers
    family.draft_kv_shapes = ((draft.num_key_value_heads, head_dim_of(draft)),)
