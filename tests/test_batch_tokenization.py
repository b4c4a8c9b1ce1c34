"""A generate() batch is tokenized in one tokenizer call, with exactly the ids each prompt gets alone;
prompts that are not valid text are left to process(), which rejects them with their index."""

from __future__ import annotations

import pytest

from mmengine import MMEngine, SamplingParams
from mmengine.errors import InvalidInputError
from mmengine.testing import make_test_image

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


class CountingTokenizer:
    """Stands in front of the real tokenizer and counts its calls (and how many texts each got)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.calls: list[int] = []

    def __call__(self, text, *args, **kwargs):
        self.calls.append(len(text) if isinstance(text, list) else 1)
        return self._tokenizer(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_a_batch_is_tokenized_in_one_call_with_the_ids_of_one_by_one(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    processor = engine.input_processor
    pictures = [make_test_image(s, size=(64, 48)) for s in range(2)]
    prompts = ["USER: <image>\nWhat is this? ASSISTANT:", "USER: hello there, how are you? ASSISTANT:",
               "USER: <image>\nand what colour is it ASSISTANT:"]
    images = [[pictures[0]], None, [pictures[1]]]
    alone = [processor.process(p, i, PARAMS) for p, i in zip(prompts, images)]

    counting = processor.tokenizer = CountingTokenizer(processor.tokenizer)
    outputs = engine.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)
    assert counting.calls == [3]  # one call for the three prompts, none per prompt
    assert [o.prompt_token_ids for o in outputs] == [a.prompt_token_ids for a in alone]
    # the placeholder runs sit where the prompt-by-prompt path put them
    batch = processor.tokenize_batch(prompts)
    again = [processor.process(p, i, PARAMS, text_ids=ids) for p, i, ids in zip(prompts, images, batch)]
    assert [[(m.offset, m.length, m.mm_hash) for m in a.mm_items] for a in again] == [
        [(m.offset, m.length, m.mm_hash) for m in a.mm_items] for a in alone
    ]


def test_prompts_that_are_not_text_are_refused_by_the_intake_before_tokenizing(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    processor = engine.input_processor
    counting = processor.tokenizer = CountingTokenizer(processor.tokenizer)
    batch = processor.tokenize_batch(["USER: hi ASSISTANT:", None, "USER: ok ASSISTANT:"])  # None: a token prompt
    assert batch[0] and batch[2] and batch[1] is None and counting.calls == [2]
    for bad in (b"bytes", "lone \ud800 surrogate"):
        with pytest.raises(InvalidInputError) as info:
            engine.generate(["USER: hi ASSISTANT:", bad], sampling_params=PARAMS, use_tqdm=False)
        assert info.value.prompt_index == 1
    assert counting.calls == [2]  # the intake refused them before the batch was tokenized
    with pytest.raises(InvalidInputError, match="lone surrogate") as info:
        engine.generate(["USER: hi ASSISTANT:", "USER: fine ASSISTANT:", "lone \ud800 surrogate"],
                        sampling_params=PARAMS, use_tqdm=False)
    assert info.value.prompt_index == 2
    assert not engine.scheduler.waiting and not engine.scheduler.running  # nothing was queued
