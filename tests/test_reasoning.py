"""Reasoning parsers: `<think>...</think>` apart from the answer, in the engine's outputs and the
server's messages (whole and streamed), with the split only ever growing while a request runs."""

from __future__ import annotations

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serve_helpers import MODEL_NAME, running_server

from mmengine import MMEngine, SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.errors import ConfigError
from mmengine.sample.reasoning import prompt_opens_reasoning, split_reasoning

OPENS = "{% for m in messages %}USER: {{ m['content'] }} {% endfor %}ASSISTANT: <think>\n"  # as Qwen3-2507 / R1 templates
CLOSES = "{% for m in messages %}USER: {{ m['content'] }} {% endfor %}ASSISTANT: <think>\n\n</think>\n\n"  # enable_thinking=False
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


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


def test_the_server_gives_reasoning_content_whole_and_streamed(engines):
    _, thinking = engines
    with running_server(AsyncMMEngine(thinking), ServerSettings(MODEL_NAME, chat_template=OPENS)) as running:
        client = openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0)
        ask = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
               "extra_body": {"ignore_eos": True}}
        whole = client.chat.completions.create(**ask)
        (offline,) = thinking.chat(ask["messages"], sampling_params=GREEDY, use_tqdm=False, chat_template=OPENS)
        message = whole.choices[0].message
        assert message.reasoning_content == offline.reasoning_content and (message.content or "") == offline.text
        reasoning, content = [], []
        for chunk in client.chat.completions.create(**ask, stream=True):
            for choice in chunk.choices:
                reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
                content.append(choice.delta.content or "")
        assert "".join(reasoning) == offline.reasoning_content and "".join(content) == offline.text
        response = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=8, temperature=0)
        (stops_at_eos,) = thinking.chat(ask["messages"], sampling_params=SamplingParams(max_tokens=8, temperature=0),
                                        use_tqdm=False, chat_template=OPENS)
        kinds = [item.type for item in response.output]
        assert kinds[0] == "reasoning" and response.output[0].content[0].text == stops_at_eos.reasoning_content
        assert response.usage.output_tokens_details.reasoning_tokens > 0


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
    import jsonschema

    from mmengine import StructuredOutputParams

    engine = MMEngine(str(think_tokens_checkpoint), max_model_len=256, device="cpu", dtype="float32", reasoning_parser="qwen3")
    end = engine.tokenizer.convert_tokens_to_ids("</think>")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=0, logit_bias={end: 100.0},
                            structured_output=StructuredOutputParams(json=schema))
    (answer,) = engine.chat([{"role": "user", "content": "hi"}], sampling_params=params, use_tqdm=False, chat_template=OPENS)
    assert answer.token_ids[0] == end and answer.token_ids.count(end) == 1  # the grammar forbids it after
    assert answer.reasoning_content == "" and answer.finish_reason == "stop"
    jsonschema.validate(__import__("json").loads(answer.text), schema)
    # a prompt that closed the reasoning itself: the grammar rules from the first token
    (closed,) = engine.chat([{"role": "user", "content": "hi"}], sampling_params=params, use_tqdm=False, chat_template=CLOSES)
    assert end not in closed.token_ids and closed.reasoning_content is None
    jsonschema.validate(__import__("json").loads(closed.text), schema)
