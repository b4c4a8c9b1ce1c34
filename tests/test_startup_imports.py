"""Each process imports what it uses: the family registry imports only the family a checkpoint asks for
(not every family's module, vision towers and processor code), so an engine, a tensor-parallel rank, a
front end and a preprocessing worker each pay for one family at start-up."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError
from mmengine.models.registry import FAMILIES, family_class_for


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_registry_entry_names_its_family_class(model_type):
    entry = FAMILIES[model_type]
    family = entry.load()
    assert family.model_type == model_type and family.architectures == (entry.architecture,)


def test_an_unknown_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="LlavaForConditionalGeneration"):
        family_class_for(PretrainedConfig(architectures=["NoSuchForCausalLM"]))


def _families_imported_by_turns(architectures: list[str]) -> list[tuple[str, list[str]]]:
    """In one fresh interpreter, each architecture resolved in turn: its family class, and the family modules that
    resolving it imported (beyond those before it)."""
    modules = sorted({entry.module for entry in FAMILIES.values()})
    probe = (
        "import sys\n"
        "from transformers import PretrainedConfig\n"
        "from mmengine.models.registry import family_class_for\n"
        f"modules = {modules!r}\n"
        f"for architecture in {architectures!r}:\n"
        "    before = {m for m in modules if m in sys.modules}\n"
        "    family = family_class_for(PretrainedConfig(architectures=[architecture]))\n"
        "    print(family.__name__, sorted(m for m in modules if m in sys.modules and m not in before))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    lines = result.stdout.strip().splitlines()[-len(architectures):]
    return [(name, ast.literal_eval(found)) for name, found in (line.split(" ", 1) for line in lines)]


def test_resolving_a_family_imports_that_family_only():
    # LLaVA's module stands alone; Qwen3.5's builds on Qwen3-VL's, which builds on Qwen2-VL's
    assert _families_imported_by_turns(["LlavaForConditionalGeneration", "Qwen3_5ForConditionalGeneration"]) == [
        ("LlavaFamily", ["mmengine.models.llava"]),
        ("Qwen3_5Family", ["mmengine.models.qwen3_5", "mmengine.models.qwen3_vl", "mmengine.models.qwen_vl"])]


def test_sharing_keys_tokenize_as_the_processor_without_loading_it(checkpoint_dir):
    """Ray's sharing keys need the tokenizer only: the driver loads it alone (not the processor, whose import
    pulls transformers' modeling code), and it tokenizes as the processor's own tokenizer does."""
    from mmengine.models.registry import load_hf_processor
    from mmengine.ray.keys import SharingKeys

    path = checkpoint_dir()
    prompt = "USER: <image>\nWhat is in this picture, and why? ASSISTANT:"
    assert SharingKeys(path).tokenizer(prompt)["input_ids"] == load_hf_processor(path).tokenizer(prompt)["input_ids"]
    probe = (
        "import sys\n"
        "from mmengine.ray.keys import SharingKeys\n"
        f"SharingKeys({str(path)!r}).prefix_chain('hello world')\n"
        "print(sorted(m for m in ('transformers.modeling_utils', 'transformers.processing_utils', 'mmengine.models.family')"
        " if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"
