"""testing.families: a family's name gives its default tiny checkpoint (the demo's --family, the
family_checkpoint fixture and the fuzzer all go through it)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from mmengine.testing.families import tiny_checkpoint_path

# Every name `mmengine demo --family` takes, and the model_type its checkpoint must have
MODEL_TYPES = {
    "llava": "llava", "qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl_moe",
    "qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
    "gemma3": "gemma3", "gemma4": "gemma4", "llava_onevision": "llava_onevision", "idefics3": "idefics3",
    "smolvlm": "smolvlm", "internvl": "internvl", "mistral3": "mistral3", "llama4": "llama4",
}


@pytest.mark.parametrize("family", MODEL_TYPES)
def test_a_family_name_gives_its_default_checkpoint(family_checkpoint, family):
    assert AutoConfig.from_pretrained(family_checkpoint(family)).model_type == MODEL_TYPES[family]


def test_the_demo_offers_exactly_these_families():
    from mmengine.cli import build_parser

    demo = build_parser()._subparsers._group_actions[0].choices["demo"]
    (family,) = [action for action in demo._actions if action.dest == "family"]
    assert sorted(family.choices) == sorted(MODEL_TYPES)


def test_an_unknown_family_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="qwen2_5_vl"):
        tiny_checkpoint_path("not_a_family")
