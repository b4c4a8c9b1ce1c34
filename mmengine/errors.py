"""Typed errors. Everything a user can get wrong is a ValueError subclass that says what was wrong."""

from __future__ import annotations

import copy


class MMEngineError(Exception):
    """Base class of every error mmengine raises on purpose."""


class ConfigError(MMEngineError, ValueError):
    """An EngineConfig or SamplingParams value is invalid."""


class UnsupportedModelError(MMEngineError, ValueError):
    """The checkpoint's architecture or one of its settings is not supported."""


class CheckpointError(UnsupportedModelError):
    """A checkpoint file is missing, unreadable or malformed. `path` is the file at fault."""

    def __init__(self, reason: str, path: object = None) -> None:
        self.reason = reason
        self.path = None if path is None else str(path)
        super().__init__(reason if self.path is None else f"{self.path}: {reason}")

    def __reduce__(self):
        return (self.__class__, (self.reason, self.path))


class WeightsMismatchError(CheckpointError):
    """The checkpoint's tensors do not match the model: one is missing, unexpected, given twice or of the
    wrong shape. The message names the tensor, the expected and actual shape, and the file."""


class CascadeLayoutError(MMEngineError, ValueError):
    """A step's cascade layout does not fit the attention layer it reached (its tiles were planned for
    another GQA group): an engine bug, named by layer, never an assertion."""


class AdapterError(MMEngineError, ValueError):
    """A LoRA adapter cannot be used: a file is missing or malformed, it does not fit the base model
    (shapes, target modules), its rank exceeds max_lora_rank, or it uses a feature mmengine refuses
    (DoRA, modules_to_save, trained biases, ...). The message names the file and the tensor or field."""


class AdapterInUseError(AdapterError):
    """An adapter cannot be removed while requests that use it are queued or running."""


class EngineDeadError(MMEngineError, RuntimeError):
    """The engine serves nothing more: its step loop failed, its engine-core process died, or it was shut
    down. Every request in flight and every new one gets it (the server answers 503, code engine_dead)."""


class CudaGraphCaptureError(MMEngineError, RuntimeError):
    """Capturing the CUDA graphs failed at start-up (at tensor_parallel_size > 1: on some rank, and the others were
    stopped). The message names the rank and the cause; enforce_eager=True starts without graphs."""


class InvalidInputError(MMEngineError, ValueError):
    """A request's input is invalid. `prompt_index` names the offending prompt when known."""

    def __init__(self, reason: str, prompt_index: int | None = None) -> None:
        self.reason = reason
        self.prompt_index = prompt_index
        super().__init__(self._message())

    def _message(self) -> str:
        if self.prompt_index is None:
            return self.reason
        return f"prompt {self.prompt_index}: {self.reason}"

    def at_prompt(self, prompt_index: int) -> "InvalidInputError":
        """A copy of this error that names the prompt it came from."""
        located = copy.copy(self)
        located.prompt_index = prompt_index
        located.args = (located._message(),)
        return located

    def __reduce__(self):  # keep pickling (e.g. across processes) working with the extra field
        return (self.__class__, (self.reason, self.prompt_index))


class ChatTemplateOptionError(InvalidInputError):
    """A chat-template option is misused (`field` names it): chat_template_kwargs naming one of the
    template's own variables, add_generation_prompt together with continue_final_message, a wrong type."""

    def __init__(self, reason: str, field: str = "chat_template_kwargs", prompt_index: int | None = None) -> None:
        self.field = field
        super().__init__(reason, prompt_index)

    def __reduce__(self):
        return (self.__class__, (self.reason, self.field, self.prompt_index))


class UnknownAdapterError(InvalidInputError):
    """A request names a LoRA adapter that is not registered (or LoRA is not enabled)."""


class ImageCountMismatchError(InvalidInputError):
    """The number of images differs from the number of image markers in the prompt."""


class TooManyImagesError(InvalidInputError):
    """More images in one prompt than `limit_mm_per_prompt` allows."""


class CorruptImageError(InvalidInputError):
    """An image could not be read or decoded."""


class ImageTooLargeError(InvalidInputError):
    """An image has more pixels than `max_image_pixels` (decompression-bomb guard)."""


class UnsupportedImageTypeError(InvalidInputError):
    """An image was given as a type mmengine cannot read (or an array of a bad shape/dtype)."""


class CorruptVideoError(InvalidInputError):
    """A video could not be read or decoded, or ends before the frames its container announces."""


class VideoTooLargeError(InvalidInputError):
    """A video is longer than max_video_seconds, or its frames exceed max_image_pixels (checked before decoding)."""


class TooManyVideosError(InvalidInputError):
    """More videos in one prompt than `limit_mm_per_prompt` allows."""


class VideoCountMismatchError(InvalidInputError):
    """The number of videos differs from the number of video markers in the prompt."""


class CorruptAudioError(InvalidInputError):
    """An audio clip could not be read or decoded (unreadable, corrupt or truncated data, no audio stream)."""


class AudioTooLongError(InvalidInputError):
    """An audio clip is longer than max_audio_seconds or than the model takes (checked before decoding where
    the container states its duration), or its file is too large to read."""


class TooManyAudiosError(InvalidInputError):
    """More audio clips in one prompt than `limit_mm_per_prompt` allows."""


class AudioCountMismatchError(InvalidInputError):
    """The number of audio clips differs from the number of audio markers in the prompt."""


class UnsupportedContainerError(InvalidInputError):
    """Encoded audio or video data is not one of the accepted containers (judged by its magic bytes before
    FFmpeg sees it; multimodal/media_container.py lists them)."""


class MediaDecodeTimeoutError(InvalidInputError):
    """Probing and decoding one audio clip or video took longer than max_media_decode_seconds."""


class PreprocessingWorkerError(InvalidInputError):
    """The preprocessing worker process preparing a picture died (it is restarted), or could not start."""


class ItemTooLargeError(InvalidInputError):
    """A multimodal item produces more embeddings than the encoder cache can take in one step."""


class PromptTooLongError(InvalidInputError):
    """Prompt tokens plus max_tokens exceed the model's max_model_len."""


class EmptyPromptError(InvalidInputError):
    """The prompt tokenizes to zero tokens."""
