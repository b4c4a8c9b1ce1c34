"""Builders for random-weight checkpoints (tests, the demo, benchmarks) and deterministic test images.

Everything is built locally with transformers' own classes and saved with `save_pretrained`, so
transformers and mmengine's loader read exactly the same files. No network or model hub is needed.

- LLaVA-1.5 (`llava`): `TinyLlavaSpec`, `build_tiny_llava`, `tiny_llava_path`, and `build_llava_checkpoint`
  with `LLAVA_1_5_7B_SPEC` for benchmarks.
- Qwen2-VL / Qwen2.5-VL (`qwen_vl`): `TinyQwenVLSpec`, `build_tiny_qwen_vl`, `tiny_qwen_vl_path`, and
  `build_qwen_vl_checkpoint` with `QWEN2_5_VL_7B_SPEC` or `QWEN3_VL_8B_SPEC` for benchmarks.
- Gemma 3 (`gemma3`): `TinyGemma3Spec`, `build_tiny_gemma3`, `tiny_gemma3_path`, and `build_gemma3_checkpoint`
  with `GEMMA3_4B_SPEC` for benchmarks.
- Gemma 4 (`gemma4`): `TinyGemma4Spec`, `build_tiny_gemma4`, `tiny_gemma4_path`, and `build_gemma4_checkpoint`
  with `GEMMA4_DENSE_SPEC` for benchmarks.
- InternVL, LLaVA-OneVision, Idefics3 / SmolVLM, Mistral 3, Llama 4: their own modules, alike; `families`
  names each family's default tiny checkpoint (`tiny_checkpoint_path`).

Every builder is the same few steps, each in one place: a tokenizer (`tokenizer.tiny_tokenizer`), a config
from the spec (`checkpoint.text_config_args`, `vision_sizes`, `special_token_ids`), seeded random weights with a
generation config (`checkpoint.save_checkpoint` over `weights.save_random_model`), the processor's files
(`checkpoint.save_processor_files`, where transformers' own processor class does not write the published
layout) and the on-disk cache (`cache.cached_build`); the families built only at the tiny settings run them in
`family_builder.FamilyBuilder`. A family's module keeps only what is its own: its spec, special tokens, chat
template and the settings of its processor.
"""

from mmengine.testing.gemma3 import GEMMA3_4B_SPEC, TinyGemma3Spec, build_gemma3_checkpoint, build_tiny_gemma3, tiny_gemma3_path
from mmengine.testing.gemma4 import GEMMA4_DENSE_SPEC, TinyGemma4Spec, build_gemma4_checkpoint, build_tiny_gemma4, tiny_gemma4_path
from mmengine.testing.images import make_test_image
from mmengine.testing.llava import (
    CHAT_TEMPLATE,
    LLAVA_1_5_7B_SPEC,
    TinyLlavaSpec,
    build_llava_checkpoint,
    build_tiny_llava,
    tiny_llava_path,
)
from mmengine.testing.qwen_vl import (
    QWEN2_5_VL_7B_SPEC,
    QWEN3_VL_8B_SPEC,
    QWEN3_5_9B_SPEC,
    QWEN3_VL_30B_A3B_SPEC,
    TINY_QWEN3_5_SPEC,
    QWEN_CHAT_TEMPLATE,
    TinyQwenVLSpec,
    build_qwen_vl_checkpoint,
    build_tiny_qwen_vl,
    load_qwen_vl_processor,
    qwen_vl_prompt,
    tiny_qwen_vl_path,
)
from mmengine.testing.weights import REAL_INITIALIZER_RANGE

__all__ = [
    "TinyGemma3Spec",
    "GEMMA3_4B_SPEC",
    "build_gemma3_checkpoint",
    "build_tiny_gemma3",
    "tiny_gemma3_path",
    "TinyGemma4Spec",
    "GEMMA4_DENSE_SPEC",
    "build_gemma4_checkpoint",
    "build_tiny_gemma4",
    "tiny_gemma4_path",
    "TinyLlavaSpec",
    "LLAVA_1_5_7B_SPEC",
    "build_llava_checkpoint",
    "build_tiny_llava",
    "tiny_llava_path",
    "make_test_image",
    "CHAT_TEMPLATE",
    "REAL_INITIALIZER_RANGE",
    "TinyQwenVLSpec",
    "QWEN2_5_VL_7B_SPEC",
    "QWEN3_VL_8B_SPEC",
    "QWEN3_5_9B_SPEC",
    "QWEN3_VL_30B_A3B_SPEC",
    "TINY_QWEN3_5_SPEC",
    "QWEN_CHAT_TEMPLATE",
    "build_qwen_vl_checkpoint",
    "build_tiny_qwen_vl",
    "tiny_qwen_vl_path",
    "load_qwen_vl_processor",
    "qwen_vl_prompt",
]
