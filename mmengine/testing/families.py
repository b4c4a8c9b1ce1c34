"""Each model family's default tiny checkpoint, by the family's name: what `mmengine demo --family`
runs and what the tests' `family_checkpoint` fixture and the fuzzer load."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable

from mmengine.testing.gemma3 import tiny_gemma3_path
from mmengine.testing.gemma4 import tiny_gemma4_path
from mmengine.testing.internvl import tiny_internvl_path
from mmengine.testing.llama4 import tiny_llama4_path
from mmengine.testing.llava import tiny_llava_path
from mmengine.testing.llava_onevision import tiny_onevision_path
from mmengine.testing.mistral3 import tiny_mistral3_path
from mmengine.testing.qwen_vl import tiny_qwen_vl_path, tiny_spec
from mmengine.testing.smolvlm import IDEFICS3_SPEC, SMOLVLM_SPEC, tiny_smolvlm_path

CacheDir = str | os.PathLike | None

# The families outside Qwen-VL's, each with its builder's default spec
_PATHS: dict[str, Callable[[CacheDir], pathlib.Path]] = {
    "llava": lambda cache_dir: tiny_llava_path(cache_dir=cache_dir),
    "gemma3": lambda cache_dir: tiny_gemma3_path(cache_dir=cache_dir),
    "gemma4": lambda cache_dir: tiny_gemma4_path(cache_dir=cache_dir),
    "llava_onevision": lambda cache_dir: tiny_onevision_path(cache_dir=cache_dir),
    "idefics3": lambda cache_dir: tiny_smolvlm_path(IDEFICS3_SPEC, cache_dir),
    "smolvlm": lambda cache_dir: tiny_smolvlm_path(SMOLVLM_SPEC, cache_dir),
    "internvl": lambda cache_dir: tiny_internvl_path(cache_dir=cache_dir),
    "mistral3": lambda cache_dir: tiny_mistral3_path(cache_dir=cache_dir),
    "llama4": lambda cache_dir: tiny_llama4_path(cache_dir=cache_dir),
}


def tiny_checkpoint_path(family: str, cache_dir: CacheDir = None) -> pathlib.Path:
    """The cached tiny checkpoint of `family`'s default spec, built on first use: one of _PATHS or a
    Qwen-VL family (qwen_vl.FAMILIES; any other name is refused there, with a ValueError naming them)."""
    if family in _PATHS:
        return _PATHS[family](cache_dir)
    return tiny_qwen_vl_path(tiny_spec(family), cache_dir)
