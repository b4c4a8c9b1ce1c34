"""Facts read off a checkpoint's text config, by the family interface (on every host-side process: front ends and
preprocessing workers) and by the decoders alike; so it imports no model code."""

from __future__ import annotations

from transformers import PretrainedConfig

# The layer kinds of a decoder with sliding-window and global layers (Gemma 3's and Gemma 4's `layer_types`)
SLIDING, FULL = "sliding_attention", "full_attention"
# Qwen2-style attention: biases on q/k/v, none on o; sliding window only with use_sliding_window.
QWEN2_TEXT_MODEL_TYPES = ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """The attention window the checkpoint uses, or None when attention is full."""
    if config.model_type in (*QWEN2_TEXT_MODEL_TYPES, "qwen3") and not getattr(config, "use_sliding_window", False):
        return None
    return getattr(config, "sliding_window", None)
