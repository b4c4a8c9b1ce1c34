"""Prompts as vLLM users pass them: prompt dicts with multi_modal_data, and token-id prompts with one
placeholder per picture or the processor's expanded runs. Greedy tokens equal transformers' for the
text that tokenizes the same, a token prompt shares KV blocks and encoder outputs with that text, and
bad token prompts are typed errors naming the prompt while the engine serves on."""

from __future__ import annotations

import pytest

from conftest import REPRESENTATIVE_FAMILIES, FamilyCase, hf_greedy
from mmengine import MMEngine, SamplingParams
from mmengine.errors import EmptyPromptError, ImageCountMismatchError, InvalidInputError
from mmengine.testing import make_test_image

PICTURES = [make_test_image(600 + i, size=size) for i, size in enumerate([(64, 48), (100, 60)])]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(family: FamilyCase) -> MMEngine:
    return MMEngine(str(family.path), max_model_len=512, device="cpu", dtype="float32", enable_prefix_grouping=False)


# (the other families' token prompts: their own test files)
@pytest.mark.parametrize("family_name", REPRESENTATIVE_FAMILIES)
def test_token_prompts_and_prompt_dicts_match_transformers(family_checkpoint, family_name):
    family = FamilyCase(family_name, family_checkpoint(family_name))
    engine = _engine(family)
    text = family.prompt("Compare the two pictures.", 2)
    expected = hf_greedy(family.path, text, PICTURES, GREEDY.max_tokens, ignore_eos=True)
    (from_text,) = engine.generate(text, images=PICTURES, sampling_params=GREEDY, use_tqdm=False)
    assert from_text.token_ids == expected
    markers = engine.tokenizer(text)["input_ids"]  # one placeholder per picture
    assert markers.count(engine.input_processor.image_token_id) == 2
    prompts = [
        {"prompt_token_ids": markers, "multi_modal_data": {"image": PICTURES}},
        {"prompt_token_ids": from_text.prompt_token_ids, "multi_modal_data": {"image": PICTURES}},  # already expanded
        {"prompt": text, "multi_modal_data": {"image": PICTURES}},
        text,
    ]
    outs = engine.generate(prompts, images=[None, None, None, PICTURES], sampling_params=GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [expected] * 4
    assert all(o.prompt_token_ids == from_text.prompt_token_ids for o in outs)
    assert outs[0].prompt is None and outs[2].prompt == text


def test_a_token_prompt_shares_blocks_and_encoder_outputs_with_its_text(family_checkpoint):
    family = FamilyCase("qwen2_5_vl", family_checkpoint("qwen2_5_vl"))
    engine = _engine(family)
    text = family.prompt("What is in this picture? Say it in a few words, please.", 1)
    (first,) = engine.generate(text, images=[PICTURES[0]], sampling_params=GREEDY, use_tqdm=False)
    before = engine.stats()
    request_id = engine.add_request({"prompt_token_ids": engine.tokenizer(text)["input_ids"],
                                     "multi_modal_data": {"image": PICTURES[0]}}, sampling_params=GREEDY)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    after = engine.stats()
    assert outputs[request_id].token_ids == first.token_ids
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == 1  # a full prefix hit
    assert after["encoder_runs"] == before["encoder_runs"] == 1
    assert outputs[request_id].num_cached_tokens == len(first.prompt_token_ids) - 1


@pytest.mark.parametrize("prompt,error,match", [
    ({"prompt_token_ids": []}, EmptyPromptError, "prompt 1: prompt_token_ids is empty"),
    ({"prompt_token_ids": [1, 10**9]}, InvalidInputError, r"prompt 1: prompt_token_ids\[1\] = 1000000000 is outside the vocabulary"),
    ({"prompt_token_ids": [1, -3]}, InvalidInputError, r"prompt_token_ids\[1\] = -3 is outside"),
    ({"prompt_token_ids": [1, "2"]}, InvalidInputError, r"prompt_token_ids\[1\] must be an int"),
    ({"prompt_token_ids": [1, 2], "prompt": "x"}, InvalidInputError, "exactly one of 'prompt' and 'prompt_token_ids'"),
    ({"prompt": "x", "mm_processor_kwargs": {}}, InvalidInputError, r"unknown prompt dict key\(s\) \['mm_processor_kwargs'\]"),
    ({"prompt": "x", "multi_modal_data": {"audio": [1], "embeds": [1]}}, InvalidInputError, r"not supported: \['embeds'\]"),
    ("IMAGE_TOKENS x2", ImageCountMismatchError, "prompt 1: the prompt has 2 image placeholder"),
])
def test_bad_prompts_are_typed_errors_and_the_engine_serves_on(checkpoint_dir, prompt, error, match):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    if prompt == "IMAGE_TOKENS x2":  # two placeholders, one picture
        image = engine.input_processor.image_token_id
        prompt = {"prompt_token_ids": [1, image, 5, image, 7], "multi_modal_data": {"image": [PICTURES[0]]}}
    with pytest.raises(error, match=match):
        engine.generate(["USER: hi ASSISTANT:", prompt], sampling_params=GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()  # nothing of the batch was queued
    (ok,) = engine.generate({"prompt": "USER: hi ASSISTANT:"}, sampling_params=GREEDY, use_tqdm=False)
    assert len(ok.token_ids) == GREEDY.max_tokens


def test_pictures_given_twice_are_refused(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    with pytest.raises(InvalidInputError, match="pictures given twice"):
        engine.generate({"prompt": "USER: <image>\nhi ASSISTANT:", "multi_modal_data": {"image": PICTURES[0]}},
                        images=[PICTURES[0]], use_tqdm=False)
