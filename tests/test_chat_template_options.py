"""Chat-template controls, in MMEngine.chat and the server alike: chat_template_kwargs reach the
template, add_generation_prompt and continue_final_message shape the prompt's end, a request's own
template (Python API) renders it, tools are rendered by the template; misuse is refused by name."""

from __future__ import annotations

import openai
import pytest
from serve_helpers import MODEL_NAME, running_server

from mmengine import MMEngine, SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.errors import ChatTemplateOptionError, InvalidInputError

# A template with a variable of its own, as Qwen3's enable_thinking
THINKING_TEMPLATE = (
    "{%- for m in messages -%}{{ m['role'] | upper }}: {{ m['content'] }}"
    "{%- if not loop.last or not continue_final_message -%}{{ '\\n' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}ASSISTANT:{% if enable_thinking is defined and not enable_thinking %} <think></think>"
    "{% endif %}{%- endif -%}"
)
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return MMEngine(str(checkpoint_dir()), max_model_len=256, device="cpu", dtype="float32")


def _prompt(engine, messages, **options) -> str:
    return engine.chat(messages, sampling_params=ONE_TOKEN, use_tqdm=False, **options)[0].prompt


def test_template_kwargs_and_the_prompts_end(engine):
    hello = [{"role": "user", "content": "hi"}]
    thinking = _prompt(engine, hello, chat_template=THINKING_TEMPLATE)
    quiet = _prompt(engine, hello, chat_template=THINKING_TEMPLATE, chat_template_kwargs={"enable_thinking": False})
    assert thinking == "USER: hi\nASSISTANT:" and quiet == "USER: hi\nASSISTANT: <think></think>"
    assert _prompt(engine, hello, chat_template=THINKING_TEMPLATE, add_generation_prompt=False) == "USER: hi\n"
    started = hello + [{"role": "assistant", "content": "The answer is"}]
    continued = _prompt(engine, started, chat_template=THINKING_TEMPLATE, add_generation_prompt=False, continue_final_message=True)
    assert continued == "USER: hi\nASSISTANT: The answer is"
    # the checkpoint's own template takes the same controls
    assert _prompt(engine, hello).endswith(" ASSISTANT:") and not _prompt(engine, hello, add_generation_prompt=False).endswith("ASSISTANT:")


def test_tools_reach_the_template(engine):
    template = "{{ messages[0]['content'] }}{% for t in tools %} [{{ t['function']['name'] }}]{% endfor %}"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    assert _prompt(engine, [{"role": "user", "content": "hi"}], chat_template=template, tools=[tool]) == "hi [get_weather]"


@pytest.mark.parametrize("options,field,words", [
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "'add_generation_prompt'"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "'messages'"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "a dict"),
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt", "a bool"),
    ({"chat_template": 3}, "chat_template", "a str"),
])
def test_misuse_is_refused_by_name(engine, options, field, words):
    with pytest.raises(ChatTemplateOptionError, match=words) as refused:
        engine.chat([{"role": "user", "content": "hi"}], sampling_params=ONE_TOKEN, use_tqdm=False, **options)
    assert refused.value.field == field
    assert not engine.has_unfinished_requests()


def test_the_server_takes_the_same_controls(engine):
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME, chat_template=THINKING_TEMPLATE)) as running:
        client = openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0)

        def prompt_tokens(**extra) -> int:
            answer = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=1, extra_body=extra)
            return answer.usage.prompt_tokens

        expected = {name: len(engine.tokenizer(text)["input_ids"]) for name, text in
                    {"thinking": "USER: hi\nASSISTANT:", "quiet": "USER: hi\nASSISTANT: <think></think>", "open": "USER: hi\n"}.items()}
        assert prompt_tokens() == expected["thinking"]
        assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == expected["quiet"]
        assert prompt_tokens(add_generation_prompt=False) == expected["open"]
        for extra, param in [({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                             ({"continue_final_message": True}, "continue_final_message"),
                             ({"chat_template": "{{ messages }}"}, "chat_template")]:  # not trusted by this server
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                               extra_body=extra)
            assert refused.value.body["param"] == param, refused.value.body


def test_chat_takes_openai_image_url_parts_like_images(engine, tmp_path):
    import io

    from mmengine.multimodal.media_urls import MediaPolicy, MediaURLError
    from mmengine.testing import make_test_image

    picture = make_test_image(7, size=(64, 48))
    encoded = io.BytesIO()
    picture.save(encoded, format="PNG")
    import base64

    url = "data:image/png;base64," + base64.b64encode(encoded.getvalue()).decode()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    as_part = engine.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                         {"type": "text", "text": "What is it?"}]}],
                          sampling_params=params, use_tqdm=False)[0]
    as_image = engine.chat([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
                           images=[picture], sampling_params=params, use_tqdm=False)[0]
    assert as_part.prompt_token_ids == as_image.prompt_token_ids and as_part.token_ids == as_image.token_ids
    # a file under the allowed directory; anything else refused by name, as the server refuses it
    path = tmp_path / "cat.png"
    picture.save(path)
    part = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{path}"}}]}]
    with pytest.raises(MediaURLError, match="file:// image URLs are not allowed") as refused:
        engine.chat(part, sampling_params=params, use_tqdm=False)
    assert refused.value.code == "local_media_disabled"
    allowed = engine.chat(part, sampling_params=params, use_tqdm=False, media_policy=MediaPolicy(allowed_local_media_path=tmp_path))
    assert allowed[0].prompt_token_ids.count(engine.family.image_token_id) == engine.family.max_tokens_per_item()
    with pytest.raises(MediaURLError, match="remote_media|not fetched"):
        engine.chat([{"role": "user", "content": [{"type": "image_url", "image_url": "https://example.com/cat.png"}]}],
                    sampling_params=params, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="pictures given twice"):
        engine.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}], images=[picture],
                    sampling_params=params, use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_a_trusting_server_renders_a_requests_own_template(engine):
    settings = ServerSettings(MODEL_NAME, trust_request_chat_template=True)
    with running_server(AsyncMMEngine(engine), settings) as running:
        client = openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0)
        answer = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                                extra_body={"chat_template": THINKING_TEMPLATE,
                                                            "chat_template_kwargs": {"enable_thinking": False}})
        assert answer.usage.prompt_tokens == len(engine.tokenizer("USER: hi\nASSISTANT: <think></think>")["input_ids"])
