"""Each model family's default tiny checkpoint, built once in the checkpoint cache ($MMENGINE_CACHE_DIR),
for conftest's `family_checkpoint` fixture and the fuzzer."""

from __future__ import annotations

from pathlib import Path

from mmengine.testing import TinyLlavaSpec, tiny_llava_path, tiny_qwen_vl_path
from mmengine.testing.qwen_vl import tiny_spec


def family_checkpoint_path(name: str) -> Path:
    if name == "llava":
        return tiny_llava_path(TinyLlavaSpec())
    if name == "gemma4":
        from mmengine.testing.gemma4 import TinyGemma4Spec, tiny_gemma4_path

        return tiny_gemma4_path(TinyGemma4Spec())
    if name == "gemma3":
        from mmengine.testing.gemma3 import tiny_gemma3_path

        return tiny_gemma3_path()
    if name == "internvl":
        from mmengine.testing.internvl import tiny_internvl_path

        return tiny_internvl_path()
    if name == "mistral3":
        from mmengine.testing.mistral3 import tiny_mistral3_path

        return tiny_mistral3_path()
    if name == "llama4":
        from mmengine.testing.llama4 import tiny_llama4_path

        return tiny_llama4_path()
    if name == "llava_onevision":
        from mmengine.testing.llava_onevision import tiny_onevision_path

        return tiny_onevision_path()
    if name == "smolvlm":
        from mmengine.testing.smolvlm import SMOLVLM_SPEC, tiny_smolvlm_path

        return tiny_smolvlm_path(SMOLVLM_SPEC)
    return tiny_qwen_vl_path(tiny_spec(name))
