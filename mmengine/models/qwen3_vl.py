"""Qwen3-VL (dense): Qwen2-VL's image recipe with 16-pixel patches, a Qwen3 decoder (an RMSNorm on each
head of q and k), interleaved M-RoPE, and DeepStack: the vision tower's intermediate features (one
level per `deepstack_visual_indexes` layer, each through its own merger) are added to the hidden
states of the first decoder layers at the picture's positions.

An item's encoder output is its embeddings with its DeepStack levels concatenated after them
([tokens, hidden * (1 + levels)]), so the encoder cache, its budget, pins, chunked prefill and a
full-hit recompute carry every level without knowing about them; the runner splits them when it
writes a step's embeddings. Image positions follow Qwen2-VL's rule (transformers' get_rope_index).

A video's temporal patches are written into the prompt one by one, each after its timestamp
(`<1.5 seconds><|vision_start|>...<|vision_end|>`), and each is positioned as an image.
"""

from __future__ import annotations

from mmengine.models.family import ModelClass, VideoPlan
from mmengine.models.qwen_vl import Qwen2VLFamily

VISION_START, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"


class Qwen3VLFamily(Qwen2VLFamily):
    architectures = ("Qwen3VLForConditionalGeneration",)
    model_type = "qwen3_vl"
    display_name = "Qwen3-VL (native resolution, DeepStack, interleaved M-RoPE)"
    model_class = ModelClass("mmengine.models.qwen_vl_model", "QwenVLModel")
    processor_names_vision_wrap = True

    @classmethod
    def processor_class(cls) -> type:
        from transformers import Qwen3VLProcessor

        return Qwen3VLProcessor

    @property
    def deepstack_levels(self) -> int:
        return len(self.hf_config.vision_config.deepstack_visual_indexes)

    video_runs_join = False

    def video_prompt_text(self, plan: VideoPlan) -> str | None:
        return "".join(f"<{seconds:.1f} seconds>{VISION_START}{VIDEO_PAD}{VISION_END}" for seconds in plan.timestamps)


class Qwen3VLMoeFamily(Qwen3VLFamily):
    """Qwen3-VL-MoE: Qwen3-VL with routed experts in the decoder's sparse layers (layers/moe.py)."""

    architectures = ("Qwen3VLMoeForConditionalGeneration",)
    model_type = "qwen3_vl_moe"
    display_name = "Qwen3-VL-MoE (routed experts, DeepStack, interleaved M-RoPE)"
