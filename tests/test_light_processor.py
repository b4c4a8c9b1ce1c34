"""A front end's processor (multimodal/light_processor.py's LightProcessor, or a family's own) against transformers'
processor, for each family's tiny checkpoint: the same chat-template text, and the engine's intake over it gives the
token ids, items and pixel values transformers' processor gives for a text+image chat; a family without one would
keep the full processor, and say so once."""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from mmengine.encoder_cache.hashing import processor_settings_key
from mmengine.models import registry
from mmengine.models.family import ModelFamily
from mmengine.models.registry import FAMILIES, load_family, load_hf_config, load_hf_processor
from mmengine.multimodal.light_processor import LightProcessor
from mmengine.multimodal.processor import InputProcessor
from mmengine.sample.params import SamplingParams

QWEN = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]
LIGHT = ["llava", *QWEN, "gemma3", "gemma4", "llava_onevision", "internvl", "idefics3", "smolvlm"]
# families whose load_processor builds the engine's own processor (not transformers' processor class): a front end's is it
OWN = ["mistral3", "llama4"]
# mm_processor_kwargs a family is checked with: the overrides must reach the image processor alike
OVERRIDES = {name: {"max_pixels": 40_000} for name in QWEN}

CHAT = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A cat on a mat."}]},
    {"role": "user", "content": [{"type": "text", "text": "And in this one?"}, {"type": "image", "tool": None}]},
]
# the marker tokens of every family's processor, in a user's text
MARKERS = "a <image> b <video> <|video|> <fake_token_around_image><end_of_utterance> <global-img> <|image_pad|> [IMG] c"
# (a template of the request's own, reading the tokenizer's special tokens and a variable of its own)
OWN_TEMPLATE = "{{ eos_token }}{% for m in messages %}[{{ m['role'] }}]{% endfor %}{{ suffix }}{{ pad_token }}"


def picture(seed: int, width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _input_processor(path, processor) -> InputProcessor:
    family = load_family(load_hf_config(path), processor, path)
    return InputProcessor(path, family, 4096, {"image": 4, "video": 1}, 10_000_000, hf_processor=processor)


@pytest.mark.parametrize("name", LIGHT + OWN)
def test_the_light_processor_renders_tokenizes_and_preprocesses_as_transformers(name, family_checkpoint):
    path = family_checkpoint(name)
    light = load_hf_processor(path, OVERRIDES.get(name), light=True)
    full = load_hf_processor(path, OVERRIDES.get(name))
    assert not isinstance(full, LightProcessor)
    assert isinstance(light, LightProcessor) if name in LIGHT else type(light) is type(full)
    # the chat template's text: the checkpoint's own template, a continued final message, a request's own template
    prompt = full.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert light.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == prompt
    assert prompt.count(full.image_token) == 2
    assert (light.apply_chat_template(CHAT[:2], continue_final_message=True, tokenize=False)
            == full.apply_chat_template(CHAT[:2], continue_final_message=True, tokenize=False))
    openai = [{**CHAT[0], "content": [{"type": "image_url", "image_url": {"url": "a.png"}}, CHAT[0]["content"][1]]}]
    assert light.apply_chat_template(openai, tokenize=False) == full.apply_chat_template(openai, tokenize=False)
    if name in LIGHT:  # (an OpenAI part is an image part, as transformers' processor class has it)
        assert light.apply_chat_template(openai, tokenize=False).count(full.image_token) == 1
    own = light.apply_chat_template(CHAT, chat_template=OWN_TEMPLATE, suffix="!", tokenize=False)
    assert own == full.apply_chat_template(CHAT, chat_template=OWN_TEMPLATE, suffix="!", tokenize=False) and own.count("[user]") == 2
    # the engine's intake over each: token ids and pixel values as transformers' processor makes them
    pictures = [picture(1, 53, 37), picture(2, 90, 200)]
    reference = full(text=prompt, images=pictures, return_tensors="pt")
    params = SamplingParams(max_tokens=1)
    light_intake, full_intake = _input_processor(path, light), _input_processor(path, full)
    assert light_intake.settings_key == full_intake.settings_key == processor_settings_key(full.image_processor)
    from_light, from_full = light_intake.process(prompt, pictures, params), full_intake.process(prompt, pictures, params)
    assert from_light.prompt_token_ids == from_full.prompt_token_ids == reference["input_ids"][0].tolist()
    assert [(i.mm_hash, i.offset, i.length) for i in from_light.mm_items] == [(i.mm_hash, i.offset, i.length) for i in from_full.mm_items]
    for ours, theirs in zip(from_light.mm_items, from_full.mm_items, strict=True):
        assert ours.encoder_inputs.keys() == theirs.encoder_inputs.keys()
        assert all(torch.equal(ours.encoder_inputs[k], theirs.encoder_inputs[k]) for k in ours.encoder_inputs), name
    # each picture alone (a batch of pictures of several sizes is padded to one, where the items are not)
    one = full.apply_chat_template(CHAT[:1], add_generation_prompt=True, tokenize=False)
    for alone in pictures:
        reference = full(text=one, images=[alone], return_tensors="pt")
        processed = light_intake.process(one, [alone], params)
        assert processed.prompt_token_ids == reference["input_ids"][0].tolist()
        pixels = torch.cat([item.encoder_inputs["pixel_values"].reshape(-1) for item in processed.mm_items])
        assert torch.equal(pixels, reference["pixel_values"].reshape(-1)), name
    assert light.chat_template == full.chat_template
    # the tokenizer as the processor class leaves it (Idefics3's and Gemma 4's add special tokens to it)
    assert light.tokenizer.all_special_tokens == full.tokenizer.all_special_tokens and len(light.tokenizer) == len(full.tokenizer)
    assert light.tokenizer(MARKERS)["input_ids"] == full.tokenizer(MARKERS)["input_ids"]
    for token in ("image_token", "video_token", "audio_token", "vision_start_token", "vision_end_token"):
        assert (getattr(light, token, None) or None) == (getattr(full, token, None) or None), token
    extractor = getattr(full, "feature_extractor", None)  # (Gemma 4's audio settings key the clips' hashes)
    assert (extractor is None) == (getattr(light, "feature_extractor", None) is None)
    if extractor is not None:
        assert processor_settings_key(light.feature_extractor) == processor_settings_key(extractor)
        assert light_intake.audios.settings_key == full_intake.audios.settings_key


@pytest.mark.parametrize("name", ["llava", "qwen2_5_vl"])
def test_the_light_image_processor_unpickles_to_the_same_settings(name, family_checkpoint):
    """A preprocessing worker gets the image processor pickled: it comes back with the same settings (its
    pickle now goes through light_processor, which imports transformers' processing code first)."""
    image_processor = load_hf_processor(family_checkpoint(name), light=True).image_processor
    data = pickle.dumps(image_processor)
    assert b"mmengine.multimodal.light_processor" in data
    again = pickle.loads(data)
    assert type(again) is type(image_processor)
    assert processor_settings_key(again) == processor_settings_key(image_processor)
    pictures = [picture(3, 70, 41)]
    assert torch.equal(again(images=pictures, return_tensors="pt")["pixel_values"],
                       image_processor(images=pictures, return_tensors="pt")["pixel_values"])


def test_every_family_has_a_light_processor():
    for model_type, entry in FAMILIES.items():
        family = entry.load()
        assert family.load_light_processor.__func__ is not ModelFamily.load_light_processor.__func__, model_type
        assert family.full_processor_reason == "", model_type
    assert sorted(LIGHT + OWN) == sorted(FAMILIES)  # (each is checked against transformers' above)


def test_a_family_without_one_keeps_the_full_processor_and_logs_it_once(checkpoint_dir, caplog, monkeypatch):
    """A family that has no light processor (a new one: LLaVA's stands for it here) gives the front end
    transformers' processor, and the log says so once, with why."""
    from mmengine.models.llava import LlavaFamily

    monkeypatch.setattr(registry, "_FULL_PROCESSOR_LOGGED", set())
    monkeypatch.setattr(LlavaFamily, "load_light_processor", ModelFamily.load_light_processor)
    monkeypatch.setattr(LlavaFamily, "full_processor_reason", "its markers need the processor class")
    with caplog.at_level(logging.INFO, logger="mmengine.models.registry"):
        processors = [load_hf_processor(checkpoint_dir(), light=True) for _ in range(2)]
    assert [type(p).__name__ for p in processors] == ["LlavaProcessor", "LlavaProcessor"]
    records = [r.getMessage() for r in caplog.records if "full processor" in r.getMessage()]
    assert records == [f"{LlavaFamily.display_name}: the front end loads transformers' full processor (and its modeling "
                       "code): its markers need the processor class"]


def test_the_stand_in_for_modeling_code_defers_to_transformers_class_once_it_is_loaded():
    """In a fresh interpreter: transformers' processing code imported without modeling_utils; once that is imported
    after all, processing_utils' audio-tokenizer check recognizes its class's instances (and nothing else)."""
    probe = (
        "import sys\n"
        "from mmengine.multimodal.light_processor import import_processing_code\n"
        "import_processing_code()\n"
        "import transformers.processing_utils as processing\n"
        "without = 'transformers.modeling_utils' not in sys.modules\n"
        "import transformers.modeling_utils as modeling\n"
        "class Tokenizer(modeling.PreTrainedAudioTokenizerBase): pass\n"
        "check = processing.PreTrainedAudioTokenizerBase\n"
        "print(without, check is not modeling.PreTrainedAudioTokenizerBase, isinstance(object.__new__(Tokenizer), check),"
        " isinstance(object(), check))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["True", "True", "True", "False"]
