"""Reasoning parsers: `<think>...</think>` apart from the answer, in the engine's outputs and the
server's messages (whole and streamed), with the split only ever growing while a request runs; only
the template's generation prompt and the model's output open or close the reasoning (never the user's
text), and a stop string that begins in the reasoning is cut from it, streamed or not."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serve_helpers import MODEL_NAME, running_server

from mmengine import MMEngine, SamplingParams, StructuredOutputParams
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.errors import ConfigError
from mmengine.sample.reasoning import prompt_closes_reasoning, prompt_opens_reasoning, split_reasoning

OPENS = "{% for m in messages %}USER: {{ m['content'] }} {% endfor %}ASSISTANT: <think>\n"  # as Qwen3-2507 / R1 templates
CLOSES = "{% for m in messages %}USER: {{ m['content'] }} {% endfor %}ASSISTANT: <think>\n\n</think>\n\n"  # enable_thinking=False
NEUTRAL = "{% for m in messages %}USER: {{ m['content'] }} {% endfor %}ASSISTANT:"  # the model may write <think> itself
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
DIGIT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
         "additionalProperties": False}
# the user's own tags: text to answer, never the reasoning's start or end
QUESTIONS = ["What is the <think> tag?", "What do <think> and </think> mean?", "Say </think> and then <think>"]


@pytest.mark.parametrize("text,opened,reasoning,content", [
    ("<think>why</think>answer", False, "why", "answer"),
    ("why</think>answer", True, "why", "answer"),
    ("no tags at all", False, None, "no tags at all"),
    ("still thinking", True, "still thinking", ""),
    ("<think>a</think>b</think>c", False, "a", "b</think>c"),
    ("", True, "", ""),
])
def test_the_split(text, opened, reasoning, content):
    split = split_reasoning(text, opened, final=True)
    assert (split.reasoning, split.content) == (reasoning, content)


def test_the_prompt_says_whether_the_answer_starts_inside_the_reasoning():
    assert prompt_opens_reasoning("ASSISTANT: <think>\n") and not prompt_opens_reasoning("ASSISTANT: <think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("USER: hi ASSISTANT:") and not prompt_opens_reasoning(None)
    assert not prompt_opens_reasoning("USER: What is the <think> tag? ASSISTANT:")
    assert not prompt_closes_reasoning("USER: What do <think> and </think> mean? ASSISTANT:")
    assert prompt_opens_reasoning("USER: What does </think> mean? ASSISTANT: <think>\n")
    assert prompt_closes_reasoning("USER: What does <think> mean? ASSISTANT: <think>\n\n</think>\n\n")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="<>/thinkab \n", max_size=40), st.booleans())
def test_a_running_split_only_grows(text, opened):
    """Each prefix's split (a running request's) is a prefix of the final one, part by part, so streamed
    deltas of reasoning and content concatenate to the whole."""
    final = split_reasoning(text, opened, final=True)
    for end in range(len(text) + 1):
        running = split_reasoning(text[:end], opened, final=False)
        assert final.content.startswith(running.content)
        assert (final.reasoning or "").startswith(running.reasoning or "")


@pytest.fixture(scope="module")
def engines(checkpoint_dir):
    path = str(checkpoint_dir())
    plain = MMEngine(path, max_model_len=256, device="cpu", dtype="float32")
    thinking = MMEngine(path, max_model_len=256, device="cpu", dtype="float32", reasoning_parser="qwen3")
    return plain, thinking


def test_the_engine_splits_what_the_model_wrote(engines):
    plain, thinking = engines
    hello = [{"role": "user", "content": "hi"}]
    (reference,) = plain.chat(hello, sampling_params=GREEDY, use_tqdm=False, chat_template=OPENS)
    (opened,) = thinking.chat(hello, sampling_params=GREEDY, use_tqdm=False, chat_template=OPENS)
    expected = split_reasoning(reference.text, opened=True, final=True)
    assert opened.token_ids == reference.token_ids
    assert (opened.reasoning_content, opened.text) == (expected.reasoning, expected.content)
    assert opened.reasoning_content  # the template opened <think>: the answer starts inside it
    (closed,) = thinking.chat(hello, sampling_params=GREEDY, use_tqdm=False, chat_template=CLOSES)
    (closed_reference,) = plain.chat(hello, sampling_params=GREEDY, use_tqdm=False, chat_template=CLOSES)
    assert closed.reasoning_content is None and closed.text == closed_reference.text
    with pytest.raises(ConfigError, match="reasoning_parser"):
        MMEngine("unused", reasoning_parser="granite")


@pytest.fixture(scope="module")
def client(engines):
    """The thinking engine's server: OPENS by default, a request's own chat_template trusted."""
    _, thinking = engines
    settings = ServerSettings(MODEL_NAME, chat_template=OPENS, trust_request_chat_template=True)
    with running_server(AsyncMMEngine(thinking), settings) as running:
        yield openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0)


def _whole_and_streamed(client, ask):
    """(reasoning_content, content) of the whole answer and of the streamed deltas joined."""
    message = client.chat.completions.create(**ask).choices[0].message
    reasoning, content = [], []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    return (message.reasoning_content, message.content or ""), ("".join(reasoning) or None, "".join(content))


def test_the_server_gives_reasoning_content_whole_and_streamed(engines, client):
    _, thinking = engines
    ask = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
           "extra_body": {"ignore_eos": True}}
    (offline,) = thinking.chat(ask["messages"], sampling_params=GREEDY, use_tqdm=False, chat_template=OPENS)
    whole, streamed = _whole_and_streamed(client, ask)
    assert whole == streamed == (offline.reasoning_content, offline.text)
    response = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=8, temperature=0)
    (stops_at_eos,) = thinking.chat(ask["messages"], sampling_params=SamplingParams(max_tokens=8, temperature=0),
                                    use_tqdm=False, chat_template=OPENS)
    kinds = [item.type for item in response.output]
    assert kinds[0] == "reasoning" and response.output[0].content[0].text == stops_at_eos.reasoning_content
    assert response.usage.output_tokens_details.reasoning_tokens > 0


def _stop_across_tokens(tokenizer, output) -> str:
    """A 4-character stop string inside the reasoning whose first two characters end one token's text
    and whose last two begin the next's: they reach the reasoning a token before the stop string matches."""
    reasoning = output.reasoning_content
    for count in range(1, len(output.token_ids)):
        before = tokenizer.decode(output.token_ids[:count])
        stop = reasoning[len(before) - 2 : len(before) + 2]
        if (len(before) > 2 and len(stop) == 4 and "\ufffd" not in stop and reasoning.startswith(before)
                and reasoning.find(stop) == len(before) - 2):
            return stop
    raise AssertionError(f"no stop string spans two tokens of {reasoning!r}")


def test_a_stop_string_that_begins_in_the_reasoning_is_cut_from_it(engines, client):
    """Characters that may begin a stop string are held back in the reasoning as in the content: once the
    stop string matches, none of it has reached the reasoning, whole or streamed (as offline)."""
    _, thinking = engines
    hello = [{"role": "user", "content": "hi"}]
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (unstopped,) = thinking.chat(hello, sampling_params=free, use_tqdm=False, chat_template=OPENS)
    stop = _stop_across_tokens(thinking.tokenizer, unstopped)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])
    (offline,) = thinking.chat(hello, sampling_params=params, use_tqdm=False, chat_template=OPENS)
    cut = unstopped.reasoning_content[: unstopped.reasoning_content.find(stop)]
    assert offline.finish_reason == "stop" and (offline.reasoning_content, offline.text) == (cut, "")
    ask = {"model": MODEL_NAME, "messages": hello, "max_tokens": 12, "temperature": 0, "stop": [stop],
           "extra_body": {"ignore_eos": True}}
    whole, streamed = _whole_and_streamed(client, ask)
    assert whole == streamed == (cut, "")


@pytest.mark.parametrize("question", QUESTIONS)
def test_the_users_tags_neither_open_nor_close_the_reasoning(engines, question):
    plain, thinking = engines
    asked = [{"role": "user", "content": question}]
    for template, opened in ((NEUTRAL, False), (OPENS, True), (CLOSES, False)):
        (reference,) = plain.chat(asked, sampling_params=GREEDY, use_tqdm=False, chat_template=template)
        (split,) = thinking.chat(asked, sampling_params=GREEDY, use_tqdm=False, chat_template=template)
        expected = split_reasoning(reference.text, opened=opened, final=True)
        assert (split.reasoning_content, split.text) == (expected.reasoning, expected.content), template


@pytest.mark.parametrize("question", QUESTIONS)
def test_the_server_splits_past_the_users_tags(engines, client, question):
    plain, _ = engines
    asked = [{"role": "user", "content": question}]
    (reference,) = plain.chat(asked, sampling_params=GREEDY, use_tqdm=False, chat_template=NEUTRAL)
    ask = {"model": MODEL_NAME, "messages": asked, "max_tokens": 8, "temperature": 0,
           "extra_body": {"ignore_eos": True, "chat_template": NEUTRAL}}
    whole, streamed = _whole_and_streamed(client, ask)
    expected = split_reasoning(reference.text, opened=False, final=True)
    assert whole == streamed == (expected.reasoning, expected.content)


def test_a_grammar_is_not_held_back_by_the_users_think_tag(engines, client):
    """The user's <think> opens no reasoning, so the grammar rules the answer from its first token (the
    model writes no <think> of its own) and the answer is the schema's JSON."""
    _, thinking = engines
    asked = [{"role": "user", "content": QUESTIONS[0]}]
    params = SamplingParams(max_tokens=40, temperature=0, structured_output=StructuredOutputParams(json=DIGIT))
    (offline,) = thinking.chat(asked, sampling_params=params, use_tqdm=False, chat_template=NEUTRAL)
    assert offline.finish_reason == "stop" and offline.reasoning_content is None
    jsonschema.validate(json.loads(offline.text), DIGIT)
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=asked, max_tokens=40, temperature=0, extra_body={"chat_template": NEUTRAL},
        response_format={"type": "json_schema", "json_schema": {"name": "digit", "schema": DIGIT}})
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.content == offline.text


@pytest.fixture(scope="module")
def think_tokens_checkpoint(tmp_path_factory):
    """The tiny LLaVA with <think> and </think> as tokens of their own (as Qwen3's tokenizer has them),
    in rows of the model's vocabulary the tokenizer did not use."""
    import shutil

    from transformers import AutoTokenizer

    from mmengine.testing import TinyLlavaSpec, tiny_llava_path

    source = tiny_llava_path(TinyLlavaSpec(vocab_size=416))
    path = tmp_path_factory.mktemp("think-tokens") / "model"
    shutil.copytree(source, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=False)
    tokenizer.save_pretrained(path)
    return path


def test_a_grammar_applies_after_the_reasoning_ends(think_tokens_checkpoint):
    """With a reasoning parser the grammar waits for </think> (the reasoning is free text); the answer
    after it follows the schema. The model is steered to close the reasoning at once by logit_bias,
    which the grammar then overrides."""
    engine = MMEngine(str(think_tokens_checkpoint), max_model_len=256, device="cpu", dtype="float32", reasoning_parser="qwen3")
    start, end = engine.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    params = SamplingParams(max_tokens=40, temperature=0, logit_bias={end: 100.0},
                            structured_output=StructuredOutputParams(json=DIGIT))
    (answer,) = engine.chat([{"role": "user", "content": "hi"}], sampling_params=params, use_tqdm=False, chat_template=OPENS)
    assert answer.token_ids[0] == end and answer.token_ids.count(end) == 1  # the grammar forbids it after
    assert answer.reasoning_content == "" and answer.finish_reason == "stop"
    jsonschema.validate(json.loads(answer.text), DIGIT)
    # a prompt that closed the reasoning itself: the grammar rules from the first token
    (closed,) = engine.chat([{"role": "user", "content": "hi"}], sampling_params=params, use_tqdm=False, chat_template=CLOSES)
    assert end not in closed.token_ids and closed.reasoning_content is None
    jsonschema.validate(json.loads(closed.text), DIGIT)
    # a prompt that neither opens nor closes it (whatever tags the user wrote): the grammar rules from the
    # first token, which may also be <think> (the model opens its reasoning); there is nothing to close
    asked = [{"role": "user", "content": "What do <think> and </think> mean?"}]
    (neutral,) = engine.chat(asked, sampling_params=params, use_tqdm=False, chat_template=NEUTRAL)
    assert end not in neutral.token_ids and neutral.reasoning_content is None
    jsonschema.validate(json.loads(neutral.text), DIGIT)
    thinks = SamplingParams(max_tokens=40, temperature=0, logit_bias={start: 70.0, end: 100.0},
                            structured_output=StructuredOutputParams(json=DIGIT))
    (opened,) = engine.chat(asked, sampling_params=thinks, use_tqdm=False, chat_template=NEUTRAL)
    assert opened.token_ids[:2] == [start, end] and opened.reasoning_content == "" and opened.finish_reason == "stop"
    jsonschema.validate(json.loads(opened.text), DIGIT)
