"""What callers hand to MMEngine's methods, checked and put in shape before anything is queued.

Every misuse is an InvalidInputError (a ValueError) saying what was given and what was expected:
a bare image where a list belongs, a dict where SamplingParams belong, a prompt that is not text,
a conversation that is not a list of messages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from mmengine.errors import ChatTemplateOptionError, EmptyPromptError, InvalidInputError
from mmengine.multimodal.media_urls import input_audio_of, part_url
from mmengine.sample.params import SamplingParams

# A single image given where a list of images belongs is one of these.
_IMAGE_LIKE = (str, bytes, bytearray, memoryview, os.PathLike)
CHAT_ROLES = ("system", "user", "assistant", "tool")


def type_name(value: object) -> str:
    cls = type(value)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _is_list(value: object) -> bool:
    return isinstance(value, (list, tuple))


def _looks_like_one_image(value: object) -> bool:
    if isinstance(value, _IMAGE_LIKE):
        return True
    module = type(value).__module__
    return module.startswith(("PIL.", "numpy")) or hasattr(value, "__array_interface__")


def check_prompt_text(prompt: object, prompt_index: int | None = None) -> str:
    """A prompt must be a str that is valid Unicode (no lone surrogates, which cannot be tokenized)."""
    if not isinstance(prompt, str):
        hint = " (decode bytes first)" if isinstance(prompt, (bytes, bytearray)) else ""
        raise InvalidInputError(f"a prompt must be a str, got {type_name(prompt)}{hint}", prompt_index)
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidInputError(
            f"the prompt holds a lone surrogate {prompt[err.start]!r} at character {err.start}: not valid Unicode text",
            prompt_index,
        ) from None
    return prompt


def check_image_list(images: object, prompt_index: int | None = None) -> list[Any]:
    """None or a list/tuple of images; a bare image (or a path string) is refused, not iterated."""
    if images is None:
        return []
    if _is_list(images):
        return list(images)
    if _looks_like_one_image(images):
        raise InvalidInputError(
            f"images must be a list with one image per image marker, got a bare {type_name(images)}: "
            "pass [image] instead",
            prompt_index,
        )
    raise InvalidInputError(f"images must be a list of images or None, got {type_name(images)}", prompt_index)


def check_sampling_params(params: object, prompt_index: int | None = None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    hint = ": use SamplingParams(**params)" if isinstance(params, dict) else ""
    raise InvalidInputError(f"sampling_params must be a SamplingParams or None, got {type_name(params)}{hint}", prompt_index)


def check_salt(salt: object, prompt_index: int | None = None) -> str | None:
    if salt is not None and not isinstance(salt, str):
        raise InvalidInputError(f"cache_salt must be a str or None, got {type_name(salt)}", prompt_index)
    return salt


def check_request_id(request_id: object) -> str | None:
    if request_id is not None and not (isinstance(request_id, str) and request_id):
        raise InvalidInputError(f"request_id must be a non-empty str or None, got {request_id!r}")
    return request_id


@dataclass
class PromptInput:
    """One prompt as the caller gave it: its text or its token ids (one of the two), its pictures and clips."""

    text: str | None
    token_ids: list[int] | None
    images: list[Any]
    videos: list[Any] = field(default_factory=list)
    audios: list[Any] = field(default_factory=list)


_PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data")


def is_single_prompt(prompts: object) -> bool:
    """A str or a prompt dict is one prompt; a list is a batch."""
    return isinstance(prompts, (str, dict))


def check_video_list(videos: object, prompt_index: int | None = None) -> list[Any]:
    """None or a list/tuple of videos; a bare video (a path, bytes, a Video or a frame array) is refused."""
    if videos is None:
        return []
    if _is_list(videos):
        return list(videos)
    raise InvalidInputError(
        f"videos must be a list with one video per video marker, got a bare {type_name(videos)}: pass [video] instead",
        prompt_index,
    )


def check_audio_list(audios: object, prompt_index: int | None = None) -> list[Any]:
    """None or a list of audio clips; a bare clip (a path, bytes, an Audio or a (samples, rate) tuple) is refused."""
    if audios is None:
        return []
    if isinstance(audios, list) or (isinstance(audios, tuple) and not _is_samples_and_rate(audios)):
        return list(audios)
    raise InvalidInputError(
        f"audios must be a list with one clip per audio marker, got a bare {type_name(audios)}: pass [clip] instead",
        prompt_index,
    )


def _is_samples_and_rate(value: object) -> bool:
    """One clip given as vLLM's (samples, sampling_rate) tuple."""
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], int) and not isinstance(value[0], (str, bytes))


_MODALITIES = ("image", "video", "audio")


def normalize_prompt(prompt: object, images: object, prompt_index: int | None = None, videos: object = None,
                     audios: object = None) -> PromptInput:
    """A str, or a dict as vLLM's LLM.generate takes it: {"prompt": str} or {"prompt_token_ids": [int]},
    with an optional {"multi_modal_data": {"image": picture or [pictures], "video": video or [videos],
    "audio": clip or [clips]}} (then `images` / `videos` / `audios` must be None)."""
    clips = check_video_list(videos, prompt_index)
    sounds = check_audio_list(audios, prompt_index)
    if not isinstance(prompt, dict):
        return PromptInput(check_prompt_text(prompt, prompt_index), None, check_image_list(images, prompt_index), clips, sounds)
    unknown = sorted(set(prompt) - set(_PROMPT_DICT_KEYS))
    if unknown:
        raise InvalidInputError(f"unknown prompt dict key(s) {unknown}; known: {list(_PROMPT_DICT_KEYS)}", prompt_index)
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InvalidInputError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'", prompt_index)
    pictures = check_image_list(images, prompt_index)
    data = prompt.get("multi_modal_data")
    if data is not None:
        if not isinstance(data, dict) or set(data) - set(_MODALITIES):
            kinds = sorted(set(data) - set(_MODALITIES)) if isinstance(data, dict) else type_name(data)
            raise InvalidInputError(
                f"multi_modal_data must be {{'image': picture or [pictures], 'video': video or [videos], 'audio': clip or "
                f"[clips]}}; not supported: {kinds}",
                prompt_index,
            )
        if pictures and "image" in data:
            raise InvalidInputError("pictures given twice: in multi_modal_data and in images=", prompt_index)
        if clips and "video" in data:
            raise InvalidInputError("videos given twice: in multi_modal_data and in videos=", prompt_index)
        if sounds and "audio" in data:
            raise InvalidInputError("audio given twice: in multi_modal_data and in audios=", prompt_index)
        if "image" in data:
            value = data["image"]
            pictures = [] if value is None else list(value) if _is_list(value) else [value]
        if "video" in data:
            value = data["video"]
            # one video is a path, bytes, a Video, a frame array or a list of PIL frames
            clips = [] if value is None else list(value) if _is_video_list(value) else [value]
        if "audio" in data:
            value = data["audio"]
            sounds = [] if value is None else check_audio_list(value, prompt_index) if _is_list(value) and not \
                _is_samples_and_rate(value) else [value]
    if "prompt" in prompt:
        return PromptInput(check_prompt_text(prompt["prompt"], prompt_index), None, pictures, clips, sounds)
    return PromptInput(None, check_token_ids(prompt["prompt_token_ids"], prompt_index), pictures, clips, sounds)


def _is_video_list(value: object) -> bool:
    """A list of videos (not one video given as a list of PIL frames)."""
    return _is_list(value) and not (value and all(type(frame).__module__.startswith("PIL.") for frame in value))


def check_token_ids(token_ids: object, prompt_index: int | None = None) -> list[int]:
    """A token prompt: a non-empty list of ints (the vocabulary bound is checked where it is known)."""
    if not _is_list(token_ids) and type(token_ids).__module__ not in ("numpy", "torch"):
        raise InvalidInputError(f"prompt_token_ids must be a list of ints, got {type_name(token_ids)}", prompt_index)
    ids = list(token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids)
    if not ids:
        raise EmptyPromptError("prompt_token_ids is empty", prompt_index)
    for position, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int):
            raise InvalidInputError(f"prompt_token_ids[{position}] must be an int, got {token!r:.40}", prompt_index)
    return ids


def normalize_batch(
    prompts: object, images: object, sampling_params: object, videos: object = None, audios: object = None
) -> tuple[list[PromptInput], list[SamplingParams]]:
    """One prompt (a str or a prompt dict) or a batch (a list of them), with images, videos, audio clips
    and sampling params to match."""
    if is_single_prompt(prompts):
        inputs = [normalize_prompt(prompts, images, 0, videos, audios)]
    elif _is_list(prompts):
        image_lists = _batch_images(images, len(prompts))
        video_lists = _batch_images(videos, len(prompts), "videos")
        audio_lists = _batch_images(audios, len(prompts), "audios")
        inputs = [
            normalize_prompt(p, imgs or None, i, clips or None, sounds or None)
            for i, (p, imgs, clips, sounds) in enumerate(zip(prompts, image_lists, video_lists, audio_lists))
        ]
    else:
        raise InvalidInputError(f"prompts must be a str, a prompt dict, or a list of them, got {type_name(prompts)}")
    prompt_list = inputs
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        params_list = [check_sampling_params(sampling_params)] * len(prompt_list)
    elif _is_list(sampling_params):
        params_list = [check_sampling_params(p, i) for i, p in enumerate(sampling_params)]
        if len(params_list) != len(prompt_list):
            raise InvalidInputError(
                f"sampling_params must be one SamplingParams or one per prompt: got {len(params_list)} for "
                f"{len(prompt_list)} prompts"
            )
    else:
        params_list = [check_sampling_params(sampling_params)]
    return inputs, params_list


def _batch_images(images: object, num_prompts: int, name: str = "images") -> list[list[Any]]:
    if images is None:
        return [[] for _ in range(num_prompts)]
    if not _is_list(images):
        raise InvalidInputError(f"{name} must hold one list (or None) per prompt, got {type_name(images)}")
    if len(images) != num_prompts:
        raise InvalidInputError(
            f"{name} must hold one list per prompt: got {len(images)} lists for {num_prompts} prompts"
        )
    check = {"images": check_image_list, "videos": check_video_list, "audios": check_audio_list}[name]
    return [check(imgs, i) for i, imgs in enumerate(images)]


def normalize_salts(cache_salt: object, num_prompts: int) -> list[str | None]:
    if cache_salt is None or isinstance(cache_salt, str):
        return [cache_salt] * num_prompts
    if not _is_list(cache_salt):
        raise InvalidInputError(f"cache_salt must be a str, None, or one per prompt, got {type_name(cache_salt)}")
    if len(cache_salt) != num_prompts:
        raise InvalidInputError(f"cache_salt must be one salt or one per prompt: got {len(cache_salt)} for {num_prompts} prompts")
    return [check_salt(salt, index) for index, salt in enumerate(cache_salt)]


def normalize_uuids(mm_uuids: object, single: bool, num_prompts: int) -> list[Any]:
    """One prompt's ids (a list, one per image, or a dict {"image": [...], "video": [...], "audio": [...]})
    or one per prompt in a batch."""
    if mm_uuids is None:
        return [None] * num_prompts
    if single and isinstance(mm_uuids, dict):
        return [mm_uuids]
    if not _is_list(mm_uuids):
        raise InvalidInputError(
            f"mm_uuids must be a list (one id per image, or one list per prompt) or a dict by modality, got {type_name(mm_uuids)}"
        )
    if single:
        return [mm_uuids]
    if len(mm_uuids) != num_prompts:
        raise InvalidInputError(f"mm_uuids must hold one list per prompt: got {len(mm_uuids)} for {num_prompts} prompts")
    for index, uuids in enumerate(mm_uuids):
        if uuids is not None and not _is_list(uuids) and not isinstance(uuids, dict):
            raise InvalidInputError(f"mm_uuids must hold a list, a dict by modality or None per prompt, got {type_name(uuids)}", index)
    return list(mm_uuids)


def normalize_conversations(messages: object) -> tuple[list[list[dict[str, Any]]], bool]:
    """One conversation (a list of messages) or a batch of them; returns (conversations, single)."""
    if not _is_list(messages):
        raise InvalidInputError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts (or a list of such conversations), "
            f"got {type_name(messages)}"
        )
    single = bool(messages) and isinstance(messages[0], dict)
    conversations = [messages] if single else list(messages)
    for index, conversation in enumerate(conversations):
        _check_conversation(conversation, index)
    return [list(c) for c in conversations], single


def _check_conversation(conversation: object, index: int) -> None:
    if not _is_list(conversation) or not conversation:
        raise InvalidInputError(f"a conversation must be a non-empty list of messages, got {conversation!r:.80}", index)
    for position, message in enumerate(conversation):
        where = f"message {position}"
        if not isinstance(message, dict):
            raise InvalidInputError(f"{where} must be a dict with 'role' and 'content', got {type_name(message)}", index)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidInputError(f"{where} has role {role!r}; expected one of {', '.join(CHAT_ROLES)}", index)
        if "content" not in message:
            raise InvalidInputError(f"{where} has no 'content'", index)
        content = message["content"]
        if isinstance(content, str):
            check_prompt_text(content, index)
            continue
        if not _is_list(content):
            raise InvalidInputError(f"{where}: content must be a str or a list of parts, got {type_name(content)}", index)
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                check_prompt_text(part["text"], index)
            elif kind in ("image_url", "video_url"):
                if part_url(part) is None:
                    raise InvalidInputError(f"{where}: an {kind} part needs {{'{kind}': {{'url': str}}}}, got {part!r:.80}", index)
            elif kind == "input_audio":
                if input_audio_of(part) is None:
                    raise InvalidInputError(f"{where}: an input_audio part needs {{'input_audio': {{'data': base64 str, "
                                            f"'format': str}}}}, got {part!r:.80}", index)
            elif kind not in ("image", "video", "audio"):
                raise InvalidInputError(
                    f"{where}: each content part must be {{'type': 'text', 'text': str}}, {{'type': 'image'}}, "
                    f"{{'type': 'video'}}, {{'type': 'audio'}}, or an OpenAI image_url / video_url / input_audio part, "
                    f"got {part!r:.80}",
                    index,
                )


# What transformers' apply_chat_template passes to every template itself: chat_template_kwargs may not
# set them (a collision would silently win or lose, depending on the template).
TEMPLATE_OWN_VARIABLES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize",
    "return_dict", "return_assistant_tokens_mask", "padding", "truncation", "max_length", "return_tensors",
    "tokenizer_kwargs", "processor_kwargs", "bos_token", "eos_token", "raise_exception", "strftime_now",
})


@dataclass(frozen=True)
class TemplateOptions:
    """How a conversation becomes a prompt: the template (None: the model's), extra variables for it,
    whether the prompt opens the assistant's turn or continues the conversation's last message, tools."""

    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ChatTemplateOptionError(f"chat_template must be a str (a Jinja template), got {type_name(self.chat_template)}",
                                          "chat_template")
        if not isinstance(self.chat_template_kwargs, dict) or not all(isinstance(k, str) for k in self.chat_template_kwargs):
            raise ChatTemplateOptionError(f"chat_template_kwargs must be a dict with str keys, got {self.chat_template_kwargs!r:.80}")
        taken = sorted(TEMPLATE_OWN_VARIABLES & set(self.chat_template_kwargs))
        if taken:
            raise ChatTemplateOptionError(
                f"chat_template_kwargs may not set {taken[0]!r}: the template gets it from the request itself"
                + (" (pass it as its own argument)" if taken[0] in ("tools", "add_generation_prompt", "continue_final_message",
                                                                  "chat_template") else "")
            )
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise ChatTemplateOptionError(f"{name} must be a bool, got {getattr(self, name)!r}", name)
        if self.add_generation_prompt and self.continue_final_message:
            raise ChatTemplateOptionError("continue_final_message continues the last message, so it cannot be combined with "
                                          "add_generation_prompt=true (which opens a new assistant turn): set it to false",
                                          "continue_final_message")
        if self.tools is not None and not (_is_list(self.tools) and all(isinstance(t, dict) for t in self.tools)):
            raise ChatTemplateOptionError(f"tools must be a list of tool dicts, got {self.tools!r:.80}", "tools")

    def render_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of apply_chat_template (besides the messages)."""
        extra = {"tools": self.tools} if self.tools else {}
        if self.chat_template is not None:
            extra["chat_template"] = self.chat_template
        return {**dict(self.chat_template_kwargs), **extra, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}
