"""The model-family interface: everything outside `models/` asks a family, never a model's config.

A family is one VLM architecture (LLaVA-1.5, Qwen2-VL, Qwen2.5-VL, ...). It owns:

- the model class (vision tower + projector + decoder) the runner builds and loads, named by module
  (`ModelClass`): front ends and preprocessing workers import the family's module, never its model's;
- how an image-processor output becomes per-item encoder inputs (`split_images`) and how many
  placeholders (embeddings) an item's inputs make (`num_tokens`), and how a step's items go through the tower and come back per item
  (the model's `encode_items`);
- the largest item the configuration can produce (`max_tokens_per_item`), which sizes the encoder
  budget, `mmengine budget` and the profiling run, with a one-line explanation of where it came from;
- the dummy items used to profile memory (`dummy_items`);
- positions: 1-D (nothing to do) or M-RoPE (`prompt_positions`: a [tokens, 3] table for the prompt
  plus the delta that shifts every later position);
- the text-model facts the runner and engine need (`text_config`, `head_dim`, `sliding_window`).

Adding a family means a file under `models/` with a `ModelFamily` subclass (importing no model code at
module level), one with its model, and one entry in `models/registry.py`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import numpy as np
from torch import nn
from transformers import PretrainedConfig

from mmengine.models.text_config import head_dim_of, sliding_window_of
from mmengine.core.request import MMItem

if TYPE_CHECKING:
    from mmengine.multimodal.light_processor import LightProcessor


class EncoderInputs(dict):
    """One item's vision-tower inputs by name (e.g. "pixel_values"). A dict subclass so the processor
    cache can hold it weakly while requests share it."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.values())


@dataclass(frozen=True)
class PromptPositions:
    """M-RoPE positions of a prompt: row i holds token i's (temporal, height, width) position; every
    token after the prompt (generated ones) sits at `index + delta` in all three channels."""

    table: np.ndarray  # [num_prompt_tokens, 3] int64
    delta: int


@dataclass(frozen=True)
class AudioFormat:
    """What a family's audio tower takes: mono waveforms at `sampling_rate`, of at most `max_samples`
    samples each (longer clips are refused, never truncated)."""

    sampling_rate: int
    max_samples: int

    @property
    def max_seconds(self) -> float:
        return self.max_samples / self.sampling_rate


@dataclass(frozen=True)
class VideoPlan:
    """How a video becomes items: the source frames kept (`indices`, at `source_fps`), the size every
    frame is resized to, the temporal patches (items) and their embeddings each, and the M-RoPE
    temporal step between patches."""

    indices: tuple[int, ...]
    source_fps: float
    source_frames: int
    height: int
    width: int
    num_patches: int
    tokens_per_patch: int
    time_step: float
    timestamps: tuple[float, ...]  # seconds at each patch's middle
    # Embeddings the video's run ends with, carried by its last item (LLaVA-OneVision's newline after all frames)
    trailing_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_patches * self.tokens_per_patch + self.trailing_tokens

    def item_tokens(self, index: int) -> int:
        """Embeddings of item `index` (the last one carries the trailing tokens)."""
        return self.tokens_per_patch + (self.trailing_tokens if index == self.num_patches - 1 else 0)


class ModelClass:
    """A family's model class, by module and class name, imported when read (`family.model_class(hf_config)`): the
    family's module, which every front end and preprocessing worker imports, holds none of the model's code (its
    layers, kernels and transformers' modeling code), which only the processes that build the model import."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __get__(self, instance: object, owner: type | None = None) -> type[nn.Module]:
        return getattr(importlib.import_module(self.module), self.name)


class ModelFamily:
    """Base class of a family; subclasses set the class attributes and override what differs."""

    architectures: ClassVar[tuple[str, ...]] = ()
    model_type: ClassVar[str] = ""  # the HF config's model_type, for configs without `architectures`
    display_name: ClassVar[str] = ""
    model_class: ClassVar[type[nn.Module]]
    # Position channels per token: 1 (plain RoPE) or 3 (M-RoPE).
    position_channels: ClassVar[int] = 1
    # Whether precomputed embeddings need the picture's grid beside them (M-RoPE positions do)
    embeds_need_grid: ClassVar[bool] = False

    def __init__(
        self, hf_config: PretrainedConfig, image_processor_settings: dict[str, Any] | None = None, model_dir: str | None = None
    ) -> None:
        """`image_processor_settings`: the checkpoint's preprocessor config with the engine's overrides
        applied (for families whose item size depends on it); `model_dir`: where other processor files
        (a video processor's settings) are read from."""
        self.hf_config = hf_config
        self.image_processor_settings = dict(image_processor_settings or {})
        self.model_dir = model_dir

    # Why a front end loads this family's full transformers processor, not a LightProcessor ("": it need not)
    full_processor_reason: ClassVar[str] = "its processor's parts are not yet loaded without transformers' processor class"

    @classmethod
    def load_light_processor(cls, model_dir: str, overrides: dict[str, Any]) -> LightProcessor | Any | None:
        """What a front end uses of the processor, loaded without transformers' processor class and modeling code
        and equal to `load_processor`'s parts: a LightProcessor (multimodal/light_processor.py: tokenizer, image
        processor, chat template, marker tokens), or the family's own processor where load_processor's is the
        engine's; None where the family needs transformers' processor (`full_processor_reason` says why)."""
        return None

    @classmethod
    def load_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """The checkpoint's HF processor (tokenizer + image processor), with image-processor overrides.

        Every family loads transformers' PIL-backend image processor whether or not torchvision is
        installed, so that the pixels, the tokens and the exact fast path are the same on every machine
        (where torchvision is installed transformers would pick its torchvision backend, whose resize
        differs). The PIL one replaces whatever AutoProcessor loaded: `AutoProcessor(backend="pil")` is
        no way round it, since transformers hands `backend` to the tokenizer too (whose `backend` it
        then reports) and to a video processor (which has no PIL backend)."""
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True, **overrides)
        if not is_pil_image_processor(processor.image_processor):
            processor.image_processor = pil_image_processor(model_dir, overrides)
        return processor

    # -- text model -------------------------------------------------------------

    @property
    def text_config(self) -> PretrainedConfig:
        return self.hf_config.text_config

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.text_config)

    @property
    def sliding_window(self) -> int | None:
        return sliding_window_of(self.text_config)

    @property
    def num_attention_layers(self) -> int:
        """Decoder layers with a KV cache (all of them, but in a hybrid decoder)."""
        return self.text_config.num_hidden_layers

    # Layers of the checkpoint's own draft head that the KV cache holds after the decoder's (speculative
    # decoding with method "mtp" sets it before the model is built; see draft_layers_in).
    num_draft_layers: int = 0

    def draft_layers_in(self, model_dir: Path) -> int:
        """Layers of the checkpoint's multi-token-prediction head (0: it has none, or the family reads none)."""
        return 0

    # (KV heads, head size) of a separate draft model's layers, kept in the KV cache after the decoder's
    # (speculative decoding with method "eagle3" sets it before the model is built)
    draft_kv_shapes: tuple[tuple[int, int], ...] = ()

    def kv_cache_layout(self) -> list[tuple[int, int]]:
        """(KV heads, head size) of each layer with a KV cache, in order: one shape for most decoders."""
        return [(self.text_config.num_key_value_heads, self.head_dim)] * self.num_attention_layers + list(self.draft_kv_shapes)

    def kv_cache_windows(self) -> list[int | None]:
        """The sliding window of each layer with a KV cache, in kv_cache_layout's order (None: it attends
        to every earlier token; an AttentionChunk from kv_cache/chunked_attention.py: it attends within chunks of
        that many tokens, Llama 4's); windowed and chunked layers keep their blocks in a pool of their own."""
        return [None] * (self.num_attention_layers + len(self.draft_kv_shapes))

    @property
    def bidirectional_modalities(self) -> frozenset[str]:
        """Modalities whose placeholder tokens attend to each other both ways (in some layers): a prefill
        chunk holds such an item whole."""
        return frozenset()

    @property
    def recurrent_shape(self) -> Any:
        """A hybrid decoder's linear-attention state shape (layers/gated_delta.GatedDeltaShape), else None."""
        return None

    @property
    def num_recurrent_layers(self) -> int:
        return 0

    @property
    def image_token_id(self) -> int:
        return self.hf_config.image_token_id

    @property
    def deepstack_levels(self) -> int:
        """Vision features added to the first decoder layers besides the input embeddings (Qwen3-VL's
        DeepStack); they travel in the item's encoder output, after its embedding."""
        return 0

    @property
    def embedding_width(self) -> int:
        """Values per placeholder token in an item's encoder output (what the encoder cache holds)."""
        return self.text_config.hidden_size * (1 + self.deepstack_levels)

    # -- items --------------------------------------------------------------------

    def max_tokens_by_modality(self) -> dict[str, int]:
        """The most embeddings one item of each modality the family takes can make."""
        raise NotImplementedError

    def max_tokens_per_item(self, limits: Mapping[str, int] | None = None, max_audio_seconds: float | None = None) -> int:
        """The largest item among the modalities `limits` (limit_mm_per_prompt) allows: a modality limited
        to 0 cannot size the encoder budget. Every modality counts when `limits` is None or allows none.
        `max_audio_seconds` (the engine's) bounds the largest audio clip below the family's own cap."""
        sizes = self.max_tokens_by_modality()
        if "audio" in sizes and max_audio_seconds is not None:
            sizes["audio"] = min(sizes["audio"], self.audio_num_tokens(int(max_audio_seconds * self.audio_format.sampling_rate)))
        allowed = [tokens for modality, tokens in sizes.items() if limits is None or limits.get(modality, 0) > 0]
        return max(allowed or sizes.values())

    def explain_max_tokens_per_item(self, limits: Mapping[str, int] | None = None, max_audio_seconds: float | None = None) -> str:
        raise NotImplementedError

    def split_images(self, batch: Any, num_images: int) -> list[EncoderInputs]:
        """The image processor's output for `num_images` images, one entry per image, in order."""
        raise NotImplementedError

    def num_tokens(self, inputs: EncoderInputs) -> int:
        """How many placeholder tokens (one embedding each) an item with these inputs takes."""
        raise NotImplementedError

    def image_prompt_ids(self, num_tokens: int) -> tuple[list[int], int]:
        """The ids an image marker becomes in the prompt (its run of `num_tokens` placeholders, and any
        tokens the processor writes around it, e.g. Gemma 4's <|image> and <image|>), and where the run
        starts in them."""
        return [self.image_token_id] * num_tokens, 0

    def image_run_ids(self, inputs: EncoderInputs) -> tuple[list[int], int]:
        """As image_prompt_ids, for an item with these inputs: the run may hold other tokens among its
        placeholders that only the item's grid places (Pixtral's [IMG_BREAK] after each row), which the item's
        encoder output then carries embeddings for."""
        return self.image_prompt_ids(self.num_tokens(inputs))

    def image_items(self, inputs: EncoderInputs) -> list[EncoderInputs]:
        """A picture's items, in prompt order: the picture itself, or (Gemma 3's pan-and-scan) the whole
        picture and then each of its crops, or (Idefics3) its tiles and then the global image, each its own
        entry in the encoder cache."""
        return [inputs]

    @property
    def max_items_per_image(self) -> int:
        """The most items one picture can make (image_items: its crops or tiles), for the encoder budget's cap."""
        return 1

    def image_marker_text(self, processor: Any, picture: EncoderInputs) -> str | None:
        """The text an image marker of a text prompt becomes before tokenizing, for a picture with these inputs
        (as split_images gave them; image_items gives its items), holding one placeholder token where each
        item's run goes (image_prompt_ids expands it), where the processor writes text around the runs
        (Gemma 3's `<start_of_image>` marker becomes `\n\n<start_of_image>`, the run, `<end_of_image>\n\n`,
        whose newlines merge with the prompt's own; Idefics3's tile markers depend on the picture's grid);
        None where the marker is itself the placeholder token. `processor`: the checkpoint's HF processor."""
        return None

    def resized_size(self, height: int, width: int) -> tuple[int, int] | None:
        """(height, width) the image processor resizes an image to, or None where the generic rule of
        `multimodal.resize_guard` (the processor's `size` settings) applies."""
        return None

    def dummy_items(self, num_items: int) -> list[EncoderInputs]:
        """`num_items` items of the largest size, for the memory-profiling run."""
        raise NotImplementedError

    def dummy_audio_items(self, num_items: int, max_audio_seconds: float) -> list[EncoderInputs]:
        """`num_items` clips of the longest length accepted, for the memory-profiling run (none for a
        family that takes no audio)."""
        return []

    # Whether every picture reaches the encoder at one size (dummy_items' size), so that the encoder's
    # input shapes are exactly its batch sizes and start-up can warm each of them (a step's items of
    # other modalities go through their tower as a batch of their own, unpadded).
    items_have_one_size: bool = False

    # -- videos -------------------------------------------------------------------

    @property
    def video_token_id(self) -> int | None:
        """The placeholder token of video items, or None for a family that takes no videos."""
        return None

    @property
    def max_items_per_video(self) -> int:
        """The most items one video can make (its temporal patches at the most frames sampled)."""
        return 1

    def plan_video(self, info: Any, video: Any, keep_all_frames: bool = False) -> VideoPlan:
        """Which frames of a video (a multimodal.video.VideoInfo) are kept (all of them, or by the
        family's sampling rule and the `Video`'s fps / num_frames) and their resized size; known before
        any frame is decoded."""
        raise NotImplementedError

    def video_items(self, frames: np.ndarray, plan: VideoPlan) -> list[EncoderInputs]:
        """The sampled frames [T, H, W, 3] as items, one per temporal patch, in order."""
        raise NotImplementedError

    def video_prompt_text(self, plan: VideoPlan) -> str | None:
        """The text a video's marker becomes before tokenizing, with one video token per item (Qwen3-VL
        writes each patch's timestamp), or None where the marker stays one token for all items."""
        return None

    # -- audio --------------------------------------------------------------------

    @property
    def audio_token_id(self) -> int | None:
        """The placeholder token of audio items, or None for a family that takes no audio."""
        return None

    @property
    def audio_format(self) -> AudioFormat | None:
        """The waveforms the audio tower takes (rate, most samples); None for a family that takes no audio."""
        return None

    def audio_prompt_ids(self, num_tokens: int) -> tuple[list[int], int]:
        """As image_prompt_ids, for a clip's audio marker (e.g. Gemma 4's <|audio> ... <audio|> around the run)."""
        return [self.audio_token_id] * num_tokens, 0

    def audio_item(self, waveform: np.ndarray) -> EncoderInputs:
        """A mono float32 waveform at audio_format's rate as one item's encoder inputs."""
        raise NotImplementedError

    def audio_num_tokens(self, num_samples: int) -> int:
        """How many placeholder tokens a clip of `num_samples` samples (at audio_format's rate) takes."""
        raise NotImplementedError

    # -- positions ----------------------------------------------------------------

    def prompt_positions(self, token_ids: Sequence[int], items: Sequence[MMItem]) -> PromptPositions | None:
        """M-RoPE positions of a prompt, or None for plain 1-D positions (token index = position)."""
        return None


def is_pil_image_processor(image_processor: Any) -> bool:
    """Whether `image_processor` is one of transformers' PIL-backend image processors."""
    from transformers.image_processing_backends import PilBackend

    return isinstance(image_processor, PilBackend)


def pil_image_processor(model_dir: str, overrides: Mapping[str, Any]) -> Any:
    """The checkpoint's image processor on transformers' PIL backend (whatever is installed), with
    `overrides` replacing its saved settings."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_dir, local_files_only=True, backend="pil", **dict(overrides))
