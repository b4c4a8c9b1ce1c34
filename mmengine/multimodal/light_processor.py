"""LightProcessor: what a front end uses of a checkpoint's HF processor, loaded without transformers' processor
class and without its modeling code.

A front end (and its preprocessing workers) tokenizes, renders chat templates and preprocesses pictures; the
family counts each picture's placeholders itself. Of transformers' processor it needs the tokenizer, the image
processor, the chat template and the marker tokens: a bag of parts, which this is. transformers' processor
class adds the placeholder expansion (which the engine core's processor checks once, at start-up, against the
family's counts) and, on import, transformers' modeling code: every image processor, video processor and
feature extractor imports `transformers.processing_utils`, which imports `modeling_utils` (Triton, torch's
model machinery, accelerate) for one name that only an audio tokenizer's check reads.
`import_processing_code` imports the processing code without it.
"""

from __future__ import annotations

import copyreg
import importlib
import sys
from dataclasses import dataclass
from typing import Any

from mmengine.utils.stand_in_import import import_with_stand_in


_PROCESSING = "transformers.processing_utils"
_MODELING = "transformers.modeling_utils"


class _AudioTokenizerCheck(type):
    """Stands for transformers' PreTrainedAudioTokenizerBase in processing_utils' isinstance check: an object is
    one once modeling_utils is loaded (an audio tokenizer's class comes from it) and is an instance of the real one."""

    def __instancecheck__(cls, instance: Any) -> bool:
        modeling = sys.modules.get(_MODELING)
        real = getattr(modeling, "PreTrainedAudioTokenizerBase", None)
        return isinstance(real, type) and not isinstance(real, _AudioTokenizerCheck) and isinstance(instance, real)


def import_processing_code() -> None:
    """Imports transformers' processing code (what image processors, video processors and feature extractors
    build on) without `transformers.modeling_utils`, unless either is imported already. A transformers whose
    processing code needs more of modeling_utils than the one name is imported the ordinary way."""
    from mmengine.models.config_import import import_config_code

    import_config_code()  # processing_utils imports the config validators too: without transformers' activations
    import_with_stand_in(_PROCESSING, _MODELING,
                         {"PreTrainedAudioTokenizerBase": _AudioTokenizerCheck("PreTrainedAudioTokenizerBase", (), {})})


def checkpoint_text_parts(model_dir: str) -> tuple[Any, dict[str, Any]]:
    """The checkpoint's tokenizer and its saved processor settings (the chat template among them), loaded after
    transformers' processing code alone (import_processing_code)."""
    import_processing_code()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True), saved_processor_settings(model_dir)


def _rebuilt(module: str, name: str) -> Any:
    """An empty instance of class `module.name`, imported after transformers' processing code (pickle then sets
    its state)."""
    import_processing_code()
    cls = getattr(importlib.import_module(module), name)
    return cls.__new__(cls)


def _reduced(part: Any) -> tuple[Any, ...]:
    cls = type(part)
    state = part.__getstate__() if hasattr(part, "__getstate__") else part.__dict__
    return _rebuilt, (cls.__module__, cls.__qualname__), state


def unpickled_without_modeling_code(part: Any) -> Any:
    """`part` (an image processor), whose class's pickles now import transformers' processing code through
    import_processing_code before the class: a preprocessing worker that unpickles it imports no modeling code
    either. (Registered for the class, in this process; unpickled, an object is the same as pickle's default.)"""
    copyreg.pickle(type(part), _reduced)
    return part


def special_token(tokenizer: Any, name: str, default: str) -> str:
    """The token a processor class takes for `name` (image_token, video_token, ...): the tokenizer's own where it
    names one, else the processor's default, as transformers' processors choose."""
    return getattr(tokenizer, name) if hasattr(tokenizer, name) else default


def saved_processor_settings(model_dir: str) -> dict[str, Any]:
    """The checkpoint's saved processor settings, with the chat template transformers' processor would take
    (chat_template.jinja, chat_template.json or processor_config.json's), read as its processor class reads them."""
    import_processing_code()
    from transformers import ProcessorMixin

    saved, _ = ProcessorMixin.get_processor_dict(model_dir, local_files_only=True)
    return saved


@dataclass
class LightProcessor:
    """The parts of a checkpoint's processor a front end uses (multimodal/processor.py's InputProcessor reads
    these names off either kind). Not callable: the placeholder expansion is the family's, and the engine core
    checks it against transformers' processor at start-up."""

    tokenizer: Any
    image_processor: Any
    chat_template: str | dict[str, str] | None
    image_token: str
    video_token: str | None = None
    # the tokens a chat template writes around a video marker (Qwen3-VL's processors name them; "" where none)
    vision_start_token: str = ""
    vision_end_token: str = ""
    audio_token: str | None = None
    feature_extractor: Any = None  # the audio feature extractor, where the family takes audio

    def apply_chat_template(self, conversation: list[dict[str, Any]] | list[list[dict[str, Any]]],
                            chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, str]] | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = False, **kwargs: Any) -> str | list[str]:
        """The prompt text, rendered as transformers' ProcessorMixin.apply_chat_template renders it with
        tokenize=False: the processor's template (or the named or given one), conversations normalized (None
        values dropped, OpenAI image_url parts as image parts), the tokenizer's special tokens and `kwargs` as
        the template's variables."""
        from transformers.utils.chat_template_utils import render_jinja_template

        if tokenize:
            raise TypeError("LightProcessor.apply_chat_template renders text only (tokenize=False)")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        conversations, batched = _normalized(conversation)
        prompts, _ = render_jinja_template(
            conversations=conversations, tools=tools, documents=documents, chat_template=self._template(chat_template),
            return_assistant_tokens_mask=False, continue_final_message=continue_final_message,
            add_generation_prompt=add_generation_prompt, **{**self.tokenizer.special_tokens_map, **kwargs},
        )
        return prompts if batched else prompts[0]

    def _template(self, chat_template: str | None) -> str:
        """As ProcessorMixin resolves it: a name among the processor's templates, a template's text, or the
        processor's own ("default" where it has several)."""
        own = self.chat_template
        if chat_template is not None:
            return own[chat_template] if isinstance(own, dict) and chat_template in own else chat_template
        if isinstance(own, dict):
            if "default" in own:
                return own["default"]
            raise ValueError(f"the processor has several chat templates but none named 'default': {', '.join(own)}")
        if own is None:
            raise ValueError("Cannot use apply_chat_template because this processor does not have a chat template.")
        return own


def _normalized(conversation: Any) -> tuple[list[list[dict[str, Any]]], bool]:
    """ProcessorMixin's normalization: one conversation or several; each message without its None values; an
    OpenAI {"type": "image_url"} part as {"type": "image", "url": ...}."""
    try:
        from transformers.utils.chat_template_utils import _normalize_chat_messages
    except ImportError:  # transformers < 5.24 drops the None values inline (and takes dict messages only)
        _normalize_chat_messages = messages_without_none

    batched = isinstance(conversation, (list, tuple)) and (
        isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages"))
    conversations = [_normalize_chat_messages(c) for c in (conversation if batched else [conversation])]
    for messages in conversations:
        for message in messages:
            if isinstance(message.get("content"), list):
                message["content"] = [_image_part(part) for part in message["content"]]
    return conversations, batched


def messages_without_none(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """transformers 5.x before 5.24's normalization of one conversation: each message without its None values."""
    return [{key: value for key, value in message.items() if value is not None} for message in messages]


def _image_part(part: Any) -> Any:
    if isinstance(part, dict) and part.get("type") == "image_url" and "image_url" in part:
        info = part["image_url"]
        return {"type": "image", "url": info.get("url", "") if isinstance(info, dict) else info}
    return part
