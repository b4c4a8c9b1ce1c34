"""/v1/completions takes OpenAI's four prompt forms (a string, a list of strings, a list of token ids,
a list of lists of token ids): one choice per prompt, indexed in order, streamed or whole, usage summed,
answers equal the offline engine's for the same prompts (text or token ids)."""

from __future__ import annotations

import openai
import pytest
from serve_helpers import MODEL_NAME, running_server

from mmengine import MMEngine, SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings

OPTIONS = {"max_model_len": 256, "device": "cpu", "dtype": "float32"}
TEXTS = ["USER: tell me about boats ASSISTANT:", "USER: and about the sea ASSISTANT:", "USER: hi ASSISTANT:"]


@pytest.fixture(scope="module")
def offline(checkpoint_dir):
    return MMEngine(str(checkpoint_dir()), **OPTIONS)


@pytest.fixture(scope="module")
def client(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), **OPTIONS)
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME)) as running:
        yield openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0)


def _expected(offline, prompts) -> list:
    return offline.generate(prompts, sampling_params=SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)


@pytest.mark.parametrize("form", ["strings", "token lists"])
def test_several_prompts_get_one_choice_each(client, offline, form):
    ids = [offline.tokenizer(text)["input_ids"] for text in TEXTS]
    prompt = {"strings": TEXTS, "token lists": ids}[form]
    answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    expected = _expected(offline, TEXTS)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.text for c in answer.choices] == [e.text for e in expected]
    assert answer.usage.completion_tokens == 15
    assert answer.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)


def test_one_token_list_is_one_prompt(client, offline):
    ids = offline.tokenizer(TEXTS[0])["input_ids"]
    answer = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in answer.choices] == [_expected(offline, TEXTS[:1])[0].text]


def test_streamed_choices_carry_their_index_and_usage_is_summed(client, offline):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=TEXTS, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [e.text for e in _expected(offline, TEXTS)]
    assert chunks[-1].usage.completion_tokens == 15 and not chunks[-1].choices
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2]


def test_use_beam_search_returns_n_choices_best_first(client, offline):
    from mmengine import BeamSearchParams

    answer = client.completions.create(model=MODEL_NAME, prompt=TEXTS[:2], max_tokens=4, n=3,
                                       extra_body={"use_beam_search": True, "ignore_eos": True})
    expected = offline.beam_search(TEXTS[:2], BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))
    assert [c.index for c in answer.choices] == list(range(6))
    assert [c.text for c in answer.choices] == [s.text for result in expected for s in result.sequences]
    assert answer.usage.completion_tokens == 6 * 4
    with pytest.raises(openai.BadRequestError, match="cannot stream"):
        client.completions.create(model=MODEL_NAME, prompt=TEXTS[0], max_tokens=4, n=2, stream=True,
                                  extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match="1..32"):
        client.completions.create(model=MODEL_NAME, prompt=TEXTS[0], max_tokens=4, n=33, extra_body={"use_beam_search": True})


def test_chat_with_use_beam_search(client, offline):
    from mmengine import BeamSearchParams

    messages = [{"role": "user", "content": "Tell me about boats."}]
    answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3, n=2,
                                            extra_body={"use_beam_search": True, "ignore_eos": True})
    prompt = offline.input_processor.apply_chat_template(messages)
    (expected,) = offline.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    assert [c.message.content for c in answer.choices] == [s.text for s in expected.sequences]
