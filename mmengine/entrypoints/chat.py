"""OpenAI chat messages -> the conversation MMEngine.chat takes (image parts as {"type": "image"}, video
parts as {"type": "video"}, input_audio parts as {"type": "audio"}) plus the image, video and audio
sources in order, and the chat template that renders it into a prompt."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmengine.engine.prompt_inputs import TemplateOptions, normalize_conversations
from mmengine.entrypoints.api_errors import APIError
from mmengine.errors import InvalidInputError
from mmengine.multimodal.media_urls import input_audio_of, part_url

if TYPE_CHECKING:  # (annotations only: a front end over an engine-core process imports no model code)
    from mmengine.engine.mm_engine import Conversation, MMEngine

_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


def _bad(reason: str) -> APIError:
    return APIError(400, reason, param="messages", code="invalid_value")


@dataclass(frozen=True)
class VideoPart:
    """A video_url content part's URL (loaded later, off the event loop)."""

    url: str


@dataclass(frozen=True)
class AudioPart:
    """An input_audio content part's base64 data and format (decoded later, off the event loop)."""

    data: str
    format: str


@dataclass(frozen=True)
class EmbedsPart:
    """An image_embeds content part's payload (decoded later, off the event loop)."""

    payload: Any


MediaSource = str | EmbedsPart | VideoPart | AudioPart


def parse_messages(messages: list[Any], allow_embeds: bool = False) -> tuple[Conversation, list[MediaSource]]:
    """Splits OpenAI messages into a template-ready conversation and the media in order: images (URLs,
    or image_embeds parts when `allow_embeds`), videos (VideoPart) and audio clips (AudioPart)."""
    if not messages:
        raise _bad("messages must be a non-empty list")
    conversation: Conversation = []
    urls: list[MediaSource] = []
    for position, message in enumerate(messages):
        where = f"messages[{position}]"
        if not isinstance(message, dict):
            raise _bad(f"{where} must be an object with 'role' and 'content'")
        role = message.get("role")
        role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role  # normalize_conversations names a bad one
        content = message.get("content")
        if content is None:
            content = ""  # e.g. an assistant turn that only called tools
        if isinstance(content, list):
            content = [_part(part, f"{where}.content[{index}]", urls, allow_embeds) for index, part in enumerate(content)]
        turn: dict[str, Any] = {"role": role, "content": content}
        if message.get("tool_calls"):
            turn["tool_calls"] = _tool_calls(message["tool_calls"], where)
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                turn[key] = message[key]
        conversation.append(turn)
    try:
        normalize_conversations(conversation)  # roles, content types, valid text
    except InvalidInputError as err:
        raise _bad(err.reason) from None
    return conversation, urls


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's calls for the template, their arguments as objects (the templates write
    them with tojson, as vLLM passes them)."""
    if not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls must be a list")
    parsed = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"{where}.tool_calls[{index}] needs {{'function': {{'name': ..., 'arguments': ...}}}}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as err:
                raise _bad(f"{where}.tool_calls[{index}].function.arguments is not valid JSON: {err}") from None
        parsed.append({"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return parsed


def _part(part: Any, where: str, urls: list[MediaSource], allow_embeds: bool) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}: a text part needs a 'text' string")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        url = part_url(part)
        if url is None:
            raise _bad(f"{where}: an image_url part needs {{'image_url': {{'url': ...}}}}")
        urls.append(url)
        return {"type": "image"}
    if kind == "video_url":
        url = part_url(part)
        if url is None:
            raise _bad(f"{where}: a video_url part needs {{'video_url': {{'url': ...}}}}")
        urls.append(VideoPart(url))
        return {"type": "video"}
    if kind == "input_audio":
        data = input_audio_of(part)
        if data is None:
            raise _bad(f"{where}: an input_audio part needs {{'input_audio': {{'data': base64 str, 'format': str}}}}")
        urls.append(AudioPart(*data))
        return {"type": "audio"}
    if kind == "image_embeds":
        if not allow_embeds:
            raise APIError(400, f"{where}: image_embeds parts are off; start the server with --enable-mm-embeds",
                           param="messages", code="mm_embeds_disabled")
        urls.append(EmbedsPart(part.get("image_embeds")))
        return {"type": "image"}
    raise _bad(f"{where}: unsupported content part {kind!r}; expected 'text', 'image_url', 'video_url', 'input_audio' "
               "or 'image_embeds'")


class ChatTemplate:
    """The template chats are rendered with: `--chat-template`'s text, else the model's own."""

    def __init__(self, engine: MMEngine, override: str | None = None) -> None:
        self._engine = engine
        processor_template = getattr(engine.input_processor.hf_processor, "chat_template", None)
        tokenizer_template = getattr(engine.tokenizer, "chat_template", None)
        # None: the processor's own, as MMEngine.chat renders it
        self._template = override if override is not None else (None if processor_template else tokenizer_template)
        self.available = bool(override or processor_template or tokenizer_template)
        self._warm_up()

    def _warm_up(self) -> None:
        """Renders a one-line chat once, so that compiling the template (tens of ms) is paid at start-up and not
        by the first request; a template that refuses this chat is left for the requests to report."""
        if self.available:
            with contextlib.suppress(Exception):
                self.render([{"role": "user", "content": [{"type": "text", "text": "Hello"}]}])

    @property
    def renders_tools(self) -> bool:
        """Whether the template writes a request's tools into the prompt (else they cannot be offered)."""
        processor = self._engine.input_processor.hf_processor
        text = self._template or getattr(processor, "chat_template", None) or getattr(self._engine.tokenizer, "chat_template", None)
        return isinstance(text, str) and "tools" in text

    def render(self, conversation: Conversation, options: TemplateOptions | None = None) -> str:
        """The prompt: `options` (tools, chat_template_kwargs, add_generation_prompt, continue_final_message)
        applied to the server's template (or to the request's own, when the server trusts them)."""
        if not self.available and (options is None or options.chat_template is None):
            raise APIError(
                400,
                "this model has no chat template, so chat completions cannot be rendered: start the server "
                "with --chat-template FILE (a Jinja template), or use /v1/completions with a raw prompt",
                param="messages",
                code="missing_chat_template",
            )
        processor = self._engine.input_processor
        kwargs = (options or TemplateOptions()).render_kwargs()
        if self._template is not None and "chat_template" not in kwargs:  # a request's own (trusted) template wins
            kwargs["chat_template"] = self._template
        try:
            return processor.apply_chat_template(conversation, **kwargs)
        except Exception as err:  # jinja2's TemplateError and the template's own raise_exception
            raise _bad(f"the chat template rejects this conversation: {err}") from err
