"""Each model family's default tiny checkpoint, by the family's name: what `mmengine demo --family`
runs and what the tests' `family_checkpoint` fixture and the fuzzer load."""

from __future__ import annotations

import os
import pathlib


def tiny_checkpoint_path(family: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The cached tiny checkpoint of `family`'s default spec, built on first use: llava, gemma3, gemma4,
    llava_onevision, idefics3, smolvlm, internvl, mistral3, llama4, or a Qwen-VL family (qwen_vl.FAMILIES;
    anything else is refused there with a ValueError naming them)."""
    if family == "llava":
        from mmengine.testing.llava import tiny_llava_path

        return tiny_llava_path(cache_dir=cache_dir)
    if family == "gemma3":
        from mmengine.testing.gemma3 import tiny_gemma3_path

        return tiny_gemma3_path(cache_dir=cache_dir)
    if family == "gemma4":
        from mmengine.testing.gemma4 import tiny_gemma4_path

        return tiny_gemma4_path(cache_dir=cache_dir)
    if family == "llava_onevision":
        from mmengine.testing.llava_onevision import tiny_onevision_path

        return tiny_onevision_path(cache_dir=cache_dir)
    if family in ("idefics3", "smolvlm"):
        from mmengine.testing.smolvlm import IDEFICS3_SPEC, SMOLVLM_SPEC, tiny_smolvlm_path

        return tiny_smolvlm_path(IDEFICS3_SPEC if family == "idefics3" else SMOLVLM_SPEC, cache_dir)
    if family == "internvl":
        from mmengine.testing.internvl import tiny_internvl_path

        return tiny_internvl_path(cache_dir=cache_dir)
    if family == "mistral3":
        from mmengine.testing.mistral3 import tiny_mistral3_path

        return tiny_mistral3_path(cache_dir=cache_dir)
    if family == "llama4":
        from mmengine.testing.llama4 import tiny_llama4_path

        return tiny_llama4_path(cache_dir=cache_dir)
    from mmengine.testing.qwen_vl import tiny_qwen_vl_path, tiny_spec

    return tiny_qwen_vl_path(tiny_spec(family), cache_dir)
