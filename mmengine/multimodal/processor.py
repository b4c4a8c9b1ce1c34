"""InputProcessor: prompt + images, videos, audio -> validated token ids with expanded placeholder runs and items.

Every check on user input happens here, before anything is scheduled or allocated,
and every failure is a typed InvalidInputError naming the prompt it came from.

The HF processor does the work, split in its two halves: images go through the image processor
(only when their preprocessed inputs are not already in the processor cache), and the model family
says how many placeholders each becomes; the text is tokenized with each image marker kept as one
token, which is then expanded into that image's run, as the processor's own expansion would (checked
once, at start-up, on two images of different sizes).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from mmengine.errors import (
    AudioCountMismatchError,
    EmptyPromptError,
    ImageCountMismatchError,
    InvalidInputError,
    ItemTooLargeError,
    PromptTooLongError,
    TooManyAudiosError,
    TooManyImagesError,
    TooManyVideosError,
    UnsupportedModelError,
    VideoCountMismatchError,
)
from mmengine.utils.keyed_lock import KeyedLock
from mmengine.encoder_cache.hashing import hash_bytes, hash_image_part, hash_user_id, model_fingerprint, processor_settings_key
from mmengine.models.family import EncoderInputs, ModelFamily
from mmengine.models.registry import load_hf_processor
from mmengine.multimodal.audio import DEFAULT_MAX_AUDIO_SECONDS, as_audio
from mmengine.multimodal.audio_loader import AudioLoader, LoadedAudio, audio_items, audio_limits
from mmengine.multimodal.embeds import check_embeds, hash_embeds, is_embeds_item
from mmengine.multimodal.image_loading import ImageInput, encoded_bytes
from mmengine.multimodal.light_processor import LightProcessor
from mmengine.multimodal.media_container import DEFAULT_MAX_MEDIA_DECODE_SECONDS
from mmengine.multimodal.processor_cache import ProcessorCache
from mmengine.multimodal.picture_preparer import PicturePreparer
from mmengine.multimodal.video import DEFAULT_MAX_VIDEO_SECONDS, as_video
from mmengine.multimodal.video_loader import LoadedVideo, VideoLimits, VideoLoader
from mmengine.multimodal.video_prompt import video_items, video_runs, write_video_markers
from mmengine.core.request import MMItem, ProcessedPrompt
from mmengine.sample.params import SamplingParams

if TYPE_CHECKING:
    from mmengine.multimodal.preprocess_pool import PreprocessPool


@dataclass
class BatchMemo:
    """The mm_hash of each picture object one batch (one generate() call) has read, by the object's id.
    It must not outlive the batch, whose objects stay alive and unchanged meanwhile (an id is reused
    once its object dies)."""

    hashes: dict[int, str] = field(default_factory=dict)
    locks: KeyedLock = field(default_factory=KeyedLock)


def split_uuids(mm_uuids: Any, modalities: Sequence[str] = ("image", "video")) -> dict[str, Any]:
    """A request's mm_uuids by modality: a list names images; a dict names each of `modalities` (those
    the family takes)."""
    if not isinstance(mm_uuids, dict):
        return {"image": mm_uuids}
    unknown = sorted(set(mm_uuids) - set(modalities))
    if unknown:
        raise InvalidInputError(f"mm_uuids names unknown modalities {unknown}; known: {', '.join(modalities)}")
    return dict(mm_uuids)


def _tone(num_samples: int, rate: int, frequency: float) -> np.ndarray:
    """A quiet sine wave: a probe clip."""
    return (0.1 * np.sin(2 * np.pi * frequency * np.arange(num_samples) / rate)).astype(np.float32)


class InputProcessor:
    def __init__(
        self,
        model_dir: Path,
        family: ModelFamily,
        max_model_len: int,
        limit_mm_per_prompt: dict[str, int],
        max_image_pixels: int,
        processor_cache_bytes: int = 0,
        hash_algo: str = "xxh3_128",
        hf_processor: Any = None,
        max_video_seconds: float = DEFAULT_MAX_VIDEO_SECONDS,
        max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
        max_media_decode_seconds: float = DEFAULT_MAX_MEDIA_DECODE_SECONDS,
    ) -> None:
        """`hf_processor`: the checkpoint's processor if already loaded (with any overrides applied)."""
        self.hf_processor = hf_processor if hf_processor is not None else load_hf_processor(model_dir)
        self.family = family
        self.tokenizer = self.hf_processor.tokenizer
        self.image_token: str = self.hf_processor.image_token
        self.image_token_id: int = family.image_token_id
        self.fingerprint = model_fingerprint(model_dir)
        self.settings_key = processor_settings_key(self.hf_processor.image_processor)
        self.max_model_len = max_model_len
        self.max_images = limit_mm_per_prompt.get("image", 0)
        self.max_videos = limit_mm_per_prompt.get("video", 0)
        self.max_audios = limit_mm_per_prompt.get("audio", 0)
        self.max_image_pixels = max_image_pixels
        # Set by the engine once the caches exist: a request must fit in the KV cache alone,
        # and each item in one step's encoder budget.
        self.max_tokens_in_kv_cache: int | None = None
        self._max_tokens_per_item: int | None = None
        # One pixel tensor per distinct item, shared by every request that has it and kept after they
        # finish (up to processor_cache_bytes): the same picture is preprocessed once.
        self.cache = ProcessorCache(processor_cache_bytes)
        # Several threads may add requests at once: the cache, the counters and the tokenizer are
        # touched under this lock; decoding, hashing and the image processor run outside it.
        self._lock = threading.Lock()
        self._decoding = KeyedLock()  # by digest of encoded bytes: equal bytes are decoded once
        self._preprocessing = KeyedLock()  # by mm_hash: an item is preprocessed once
        self.pictures = PicturePreparer(self.hf_processor.image_processor, family, max_image_pixels, self.fingerprint,
                                        self.settings_key, hash_algo)
        # Worker processes that prepare encoded pictures (set by the engine with mm_processor_workers)
        self.pool: PreprocessPool | None = None
        self.hash_algo = hash_algo
        self.num_images_decoded = 0
        self.num_images_preprocessed = 0
        self.video_token: str | None = getattr(self.hf_processor, "video_token", None) if family.video_token_id is not None else None
        self.videos = VideoLoader(
            family, self.cache, self._lock, self.fingerprint, self.settings_key,
            VideoLimits(max_video_seconds, max_image_pixels, max_model_len=max_model_len,
                        max_decode_seconds=max_media_decode_seconds), hash_algo,
        )
        self.audio_token: str | None = None
        self.audios: AudioLoader | None = None
        if family.audio_token_id is not None:
            self.audio_token = self.hf_processor.audio_token
            extractor = getattr(self.hf_processor, "feature_extractor", None)
            audio_settings = processor_settings_key(extractor) if extractor is not None else ""
            self.audios = AudioLoader(family, self.cache, self._lock, self.fingerprint, audio_settings,
                                      audio_limits(family, max_audio_seconds, max_media_decode_seconds), hash_algo)
        # (a front end's LightProcessor has no expansion of its own: the engine core checks the same checkpoint's)
        if not isinstance(self.hf_processor, LightProcessor):
            self._check_expansion()
            if self.audios is not None:
                self._check_audio_expansion()

    @property
    def max_tokens_per_item(self) -> int | None:
        return self._max_tokens_per_item

    @max_tokens_per_item.setter
    def max_tokens_per_item(self, value: int | None) -> None:
        self._max_tokens_per_item = value
        self.videos.limits.max_tokens_per_item = value

    def _check_expansion(self) -> None:
        """Checks, on a probe prompt with two images of different sizes, that tokenizing with markers
        kept whole and expanding each into the family's count for its image gives the processor's own
        ids: the processor and the model agree on every image's placeholder count."""
        probes = [Image.new("RGB", (64, 48), (127, 127, 127)), Image.new("RGB", (40, 96), (60, 90, 120))]
        text = f"USER: {self.image_token}\nCompare{self.image_token} with this. ASSISTANT:"
        ids = list(self.hf_processor(text=text, images=probes)["input_ids"][0])
        _, items, texts = self._picture_items(["", ""], self.family.split_images(self._preprocess(probes), len(probes)))
        counts = [self.family.num_tokens(inputs) for inputs in items]
        runs = [self.family.image_run_ids(inputs) for inputs in items]
        produced = sum(t == self.image_token_id for t in ids)
        if produced != sum(run.count(self.image_token_id) for run, _ in runs):
            raise UnsupportedModelError(
                f"the processor expands two probe images into {produced} placeholder tokens but the model makes "
                f"{sum(counts)} embeddings for them ({counts}): the checkpoint's processor and model configs disagree"
            )
        if self._tokenize(text, counts, image_texts=texts, image_runs=runs)[0] != ids:
            raise UnsupportedModelError(
                "the processor's tokenization differs from its tokenizer's with image markers expanded in place; "
                "this processor is not supported"
            )

    def _check_audio_expansion(self) -> None:
        """As _check_expansion, for two probe clips of different lengths: the processor's own ids equal
        the tokenizer's with each audio marker expanded into the family's run for its clip."""
        rate = self.family.audio_format.sampling_rate
        probes = [_tone(rate * 3 // 10, rate, 440.0), _tone(rate * 7 // 10, rate, 660.0)]
        text = f"USER: {self.audio_token}\nCompare{self.audio_token} with this. ASSISTANT:"
        ids = list(self.hf_processor(text=text, audio=probes, sampling_rate=rate)["input_ids"][0])
        counts = [self.family.num_tokens(self.family.audio_item(probe)) for probe in probes]
        expanded = self._tokenize(text, [], audio_counts=counts)[0]
        if expanded != ids:
            raise UnsupportedModelError(
                f"the processor expands two probe audio clips differently from the model's {counts} embeddings for them: "
                "the checkpoint's processor and model configs disagree"
            )

    def _preprocess(self, images: list[Image.Image]) -> Any:
        return self.pictures.preprocess(images)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """The prompt for `messages`, by default ready for the assistant's turn (`template_kwargs`, e.g. tools,
        chat_template, continue_final_message or the template's own variables, go to the template)."""
        return self.hf_processor.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                                     **template_kwargs)

    def process(
        self,
        prompt: str | None,
        images: Sequence[ImageInput] | None,
        params: SamplingParams,
        prompt_index: int = 0,
        mm_uuids: Sequence[str | None] | None = None,
        memo: BatchMemo | None = None,
        text_ids: list[int] | None = None,
        token_ids: list[int] | None = None,
        videos: Sequence[Any] | None = None,
        audios: Sequence[Any] | None = None,
    ) -> ProcessedPrompt:
        """`mm_uuids` optionally names each image: equal ids mean equal images (content is not hashed); a
        dict {"image": [...], "video": [...], "audio": [...]} names videos and audio clips too (as vLLM's
        multi_modal_uuids).
        `memo` is shared by the calls of one batch, so a picture object it gives for several prompts
        is read and hashed once. `text_ids`: the prompt's ids from `tokenize_batch`, if the batch was
        tokenized up front. `token_ids` instead of `prompt`: a token prompt (see _expand_token_ids).
        `prompt` is text the engine's intake checked (engine/prompt_inputs.py: a str of valid Unicode).
        `videos`: one per video marker (multimodal.video.Video, or what its `source` takes). `audios`: one per
        audio marker (multimodal.audio.Audio, a (samples, sampling_rate) tuple, a path or encoded bytes)."""
        try:
            return self._process(prompt, list(images or ()), params, mm_uuids, memo, text_ids, token_ids, list(videos or ()),
                                 list(audios or ()))
        except InvalidInputError as err:
            raise err.at_prompt(prompt_index) from err

    def _process(
        self,
        prompt: str | None,
        images: list[ImageInput],
        params: SamplingParams,
        mm_uuids: Sequence[str | None] | None,
        memo: BatchMemo | None = None,
        text_ids: list[int] | None = None,
        token_ids: list[int] | None = None,
        videos: list[Any] | None = None,
        audios: list[Any] | None = None,
    ) -> ProcessedPrompt:
        if token_ids is not None:
            self._check_vocabulary(token_ids)
        uuids = split_uuids(mm_uuids, ("image", "video", "audio") if self.audios is not None else ("image", "video"))
        mm_uuids = uuids.get("image")
        loaded_videos = self._load_videos(prompt, token_ids, videos or [], uuids.get("video"))
        loaded_audios = self._load_audios(prompt, token_ids, audios or [], uuids.get("audio"))
        if any(self.family.video_prompt_text(v.plan) is not None for v in loaded_videos):
            texts = [self.family.video_prompt_text(v.plan) for v in loaded_videos]
            prompt = write_video_markers(prompt, self.video_token, texts, *self._vision_wrap())
            text_ids = None
        if len(images) > self.max_images:
            raise TooManyImagesError(
                f"{len(images)} images given but limit_mm_per_prompt allows at most {self.max_images} per prompt"
            )
        num_markers = prompt.count(self.image_token) if token_ids is None else self._count_placeholders(token_ids, len(images))
        if num_markers != len(images):
            where = f"{self.image_token} marker(s)" if token_ids is None else "image placeholder(s) in its token ids"
            raise ImageCountMismatchError(f"the prompt has {num_markers} {where} but {len(images)} image(s) were given")
        mm_hashes, preprocessed, image_texts = self._picture_items(*self._load_items(images, mm_uuids, memo))
        if token_ids is not None and len(preprocessed) != len(images):
            raise InvalidInputError("a token prompt cannot hold pictures that make several items (pan-and-scan crops, image tiles); "
                                    "give the prompt as text")
        counts = [self.family.num_tokens(inputs) for inputs in preprocessed]
        for index, (inputs, count) in enumerate(zip(preprocessed, counts)):
            if "image_embeds" in inputs and inputs["image_embeds"].shape[0] != count:
                raise InvalidInputError(f"image {index}: image_embeds has {inputs['image_embeds'].shape[0]} rows but the "
                                        f"model gives this image {count} placeholder tokens")
        self._check_item_sizes(counts)
        audio_counts = [clip.num_tokens for clip in loaded_audios]
        self._check_item_sizes(audio_counts, "audio")
        audio_starts: list[int] = []
        image_runs = [self.family.image_run_ids(inputs) for inputs in preprocessed]
        if token_ids is None:
            token_ids, starts, video_starts, audio_starts = self._tokenize(
                prompt, counts, text_ids, video_runs(self.family, loaded_videos), audio_counts, image_texts, image_runs
            )
        else:
            (token_ids, starts), video_starts = self._expand_token_ids(token_ids, counts, image_runs), []
        if not token_ids:
            raise EmptyPromptError("the prompt is empty after tokenization")
        self._check_length(len(token_ids), params.max_tokens)
        items = self._placeholder_items(token_ids, starts, counts, preprocessed, mm_hashes)
        if loaded_videos:
            items += video_items(token_ids, video_starts, loaded_videos, self.family.video_token_id)
        if loaded_audios:
            items += audio_items(token_ids, audio_starts, loaded_audios, self.family.audio_token_id)
        items.sort(key=lambda item: item.offset)
        positions = self.family.prompt_positions(token_ids, items)
        return ProcessedPrompt(prompt=prompt, prompt_token_ids=token_ids, mm_items=items, mrope_positions=positions)

    def tokenize_batch(self, prompts: Sequence[str | None]) -> list[list[int] | None]:
        """Each text prompt's ids as the tokenizer gives them, from one call (a fast tokenizer encodes a
        batch on its own threads, outside the GIL); None where the prompt is given as token ids (None)."""
        texts = [(index, prompt) for index, prompt in enumerate(prompts) if prompt is not None]
        ids: list[list[int] | None] = [None] * len(prompts)
        if texts:
            with self._lock:
                encoded = self.tokenizer([prompt for _, prompt in texts])["input_ids"]
            for (index, _), prompt_ids in zip(texts, encoded):
                ids[index] = list(prompt_ids)
        return ids

    def _tokenize(
        self, prompt: str, counts: Sequence[int], ids: list[int] | None = None, video_runs: Sequence[list[int]] = (),
        audio_counts: Sequence[int] = (), image_texts: Sequence[str | None] = (),
        image_runs: Sequence[tuple[list[int], int]] = (),
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """The text tokenized as the processor does (or `ids`, its tokenization done earlier), the k-th
        image placeholder (the marker, one added token, or one the k-th marker's text in `image_texts`
        holds) expanded in place into a run of counts[k] placeholders, as the processor's own expansion
        would, the k-th video marker into adjacent runs of video_runs[k] and the k-th audio marker into a
        run of audio_counts[k]; also where each image item's, each video item's and each clip's run starts."""
        if any(text is not None for text in image_texts):  # the markers' text first (ids tokenized without it are stale)
            prompt, ids = write_video_markers(prompt, self.image_token, list(image_texts)), None
        if ids is None:
            with self._lock:  # a fast tokenizer may refuse concurrent calls ("Already borrowed")
                ids = self.tokenizer(prompt)["input_ids"]
        expanded: list[int] = []
        starts: list[int] = []
        video_starts: list[int] = []
        audio_starts: list[int] = []
        video_token, videos = self.family.video_token_id, iter(video_runs)
        audio_token = self.family.audio_token_id
        for token in ids:
            if token == self.image_token_id and len(starts) < len(counts):
                k = len(starts)
                run, offset = image_runs[k] if image_runs else self.family.image_prompt_ids(counts[k])
                starts.append(len(expanded) + offset)
                expanded += run
            elif token == audio_token and len(audio_starts) < len(audio_counts):
                run, offset = self.family.audio_prompt_ids(audio_counts[len(audio_starts)])
                audio_starts.append(len(expanded) + offset)
                expanded += run
            elif token == video_token and (run := next(videos, None)) is not None:
                for count in run:
                    video_starts.append(len(expanded))
                    expanded += [token] * count
            else:
                expanded.append(token)
        return expanded, starts, video_starts, audio_starts

    # -- videos ---------------------------------------------------------------------

    def _load_videos(
        self, prompt: str | None, token_ids: list[int] | None, videos: list[Any], uuids: Sequence[str | None] | None = None
    ) -> list[LoadedVideo]:
        """Each video checked against the prompt's markers and the limits, then loaded (multimodal/video_loader.py)."""
        markers = prompt.count(self.video_token) if prompt is not None and self.video_token else 0
        if token_ids is not None and self.family.video_token_id is not None and self.family.video_token_id in token_ids:
            raise VideoCountMismatchError("the token ids hold video placeholders; videos need a text prompt with its video markers")
        if not videos:
            if markers:
                raise VideoCountMismatchError(f"the prompt has {markers} {self.video_token} marker(s) but no video was given")
            return []
        if self.video_token is None:
            raise InvalidInputError(f"{self.family.display_name} takes no videos")
        if token_ids is not None:
            raise InvalidInputError("videos need a text prompt (with its video markers); prompt_token_ids with videos is not supported")
        if len(videos) > self.max_videos:
            raise TooManyVideosError(
                f"{len(videos)} videos given but limit_mm_per_prompt allows at most {self.max_videos} per prompt"
            )
        if markers != len(videos):
            raise VideoCountMismatchError(f"the prompt has {markers} {self.video_token} marker(s) but {len(videos)} video(s) were given")
        clips = [as_video(video, index) for index, video in enumerate(videos)]
        for index, uuid in enumerate(self._validated_user_ids(uuids, len(clips), "video") if uuids is not None else []):
            if uuid is not None:
                clips[index] = dataclasses.replace(clips[index], uuid=uuid)
        return [self.videos.load(clip, index) for index, clip in enumerate(clips)]

    # -- audio ----------------------------------------------------------------------

    def _load_audios(
        self, prompt: str | None, token_ids: list[int] | None, audios: list[Any], uuids: Sequence[str | None] | None = None
    ) -> list[LoadedAudio]:
        """Each clip checked against the prompt's markers and the limits, then loaded (multimodal/audio_loader.py)."""
        markers = prompt.count(self.audio_token) if prompt is not None and self.audio_token else 0
        if token_ids is not None and self.family.audio_token_id is not None and self.family.audio_token_id in token_ids:
            raise AudioCountMismatchError("the token ids hold audio placeholders; audio needs a text prompt with its audio markers")
        if not audios:
            if markers:
                raise AudioCountMismatchError(f"the prompt has {markers} {self.audio_token} marker(s) but no audio was given")
            return []
        if self.audios is None:
            raise InvalidInputError(f"{self.family.display_name} takes no audio ({len(audios)} audio clip(s) given)")
        if token_ids is not None:
            raise InvalidInputError("audio needs a text prompt (with its audio markers); prompt_token_ids with audio is not supported")
        if len(audios) > self.max_audios:
            raise TooManyAudiosError(
                f"{len(audios)} audio clips given but limit_mm_per_prompt allows at most {self.max_audios} per prompt"
            )
        if markers != len(audios):
            raise AudioCountMismatchError(f"the prompt has {markers} {self.audio_token} marker(s) but {len(audios)} audio clip(s) were given")
        clips = [as_audio(audio, index) for index, audio in enumerate(audios)]
        for index, uuid in enumerate(self._validated_user_ids(uuids, len(clips), "audio") if uuids is not None else []):
            if uuid is not None:
                clips[index] = dataclasses.replace(clips[index], uuid=uuid)
        return [self.audios.load(clip, index) for index, clip in enumerate(clips)]

    def _vision_wrap(self) -> tuple[str, str]:
        """The tokens a chat template writes around a video marker (<|vision_start|>, <|vision_end|>)."""
        return getattr(self.hf_processor, "vision_start_token", ""), getattr(self.hf_processor, "vision_end_token", "")


    def _check_vocabulary(self, token_ids: list[int]) -> None:
        vocab = self.family.text_config.vocab_size
        for position, token in enumerate(token_ids):
            if not 0 <= token < vocab:
                raise InvalidInputError(f"prompt_token_ids[{position}] = {token} is outside the vocabulary (0..{vocab - 1})")

    def _placeholder_runs(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """(start, length) of each maximal run of image placeholder tokens."""
        runs: list[tuple[int, int]] = []
        for index, token in enumerate(token_ids):
            if token != self.image_token_id:
                continue
            if runs and runs[-1][0] + runs[-1][1] == index:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((index, 1))
        return runs

    def _count_placeholders(self, token_ids: list[int], num_images: int) -> int:
        """How many pictures a token prompt's placeholders stand for, before the pictures' sizes are
        known: one per run when there are as many runs as pictures (expanded runs, or single
        placeholders apart), else one per placeholder token. Fewer runs than pictures but at least as
        many placeholders may be expanded runs of adjacent pictures (LLaVA-OneVision's template writes
        `<image><image>`), run together: taken as the pictures, and checked by _expand_token_ids once
        their sizes are known."""
        runs = self._placeholder_runs(token_ids)
        total = sum(length for _, length in runs)
        if len(runs) == num_images or len(runs) < num_images <= total:
            return num_images
        return total

    def _expand_token_ids(self, token_ids: list[int], counts: Sequence[int],
                          image_runs: Sequence[tuple[list[int], int]] = ()) -> tuple[list[int], list[int]]:
        """A token prompt with each picture's placeholders as the processor expands them, and where each
        run starts. A run may be the processor's expanded form (as long as one picture's count, or the
        sum of adjacent pictures' counts) or one placeholder per picture, which is expanded here as the
        processor expands a marker (with the tokens it writes around the run, e.g. Gemma 4's)."""
        expanded: list[int] = []
        starts: list[int] = []
        image, position = 0, 0
        for run_start, run_length in self._placeholder_runs(token_ids):
            expanded += token_ids[position:run_start]
            total, taken = 0, 0
            while image + taken < len(counts) and total < run_length:  # expanded runs of adjacent pictures
                total += counts[image + taken]
                taken += 1
            single = total != run_length  # one placeholder per picture: expanded as the processor would a marker
            if single:
                taken = run_length
                if image + taken > len(counts):
                    raise ImageCountMismatchError(
                        f"the token ids hold more image placeholders than the {len(counts)} image(s) given need"
                    )
            for k in range(image, image + taken):
                written = image_runs[k] if image_runs else self.family.image_prompt_ids(counts[k])
                run, offset = written if single else ([self.image_token_id] * counts[k], 0)
                starts.append(len(expanded) + offset)
                expanded += run
            image += taken
            position = run_start + run_length
        expanded += token_ids[position:]
        if image != len(counts):
            raise ImageCountMismatchError(f"the token ids hold placeholders for {image} image(s) but {len(counts)} were given")
        return expanded, starts

    def _picture_items(self, mm_hashes: list[str], pictures: list[EncoderInputs]
                       ) -> tuple[list[str], list[EncoderInputs], list[str | None]]:
        """Each picture as its items (one, or several: ModelFamily.image_items), with their mm_hashes, and the
        text each picture's marker becomes."""
        hashes, items, texts = [], [], []
        for mm_hash, picture in zip(mm_hashes, pictures):
            parts = self.family.image_items(picture)
            hashes += [mm_hash] if len(parts) == 1 else [hash_image_part(mm_hash, k, self.hash_algo) for k in range(len(parts))]
            items += parts
            texts.append(self.family.image_marker_text(self.hf_processor, picture))
        return hashes, items, texts

    def _check_item_sizes(self, counts: Sequence[int], kind: str = "image") -> None:
        """Each image's (or clip's) run must fit one step's encoder budget and, with the prompt's other
        tokens, max_model_len."""
        smaller = "lower max_pixels" if kind == "image" else "send a shorter clip"
        for index, count in enumerate(counts):
            if self.max_tokens_per_item is not None and count > self.max_tokens_per_item:
                raise ItemTooLargeError(
                    f"{kind} {index} needs {count} embeddings but the encoder cache budget is "
                    f"{self.max_tokens_per_item} per step (raise encoder_cache_size, or {smaller})"
                )
            if count >= self.max_model_len:
                where = " in mm_processor_kwargs" if kind == "image" else ""
                raise ItemTooLargeError(
                    f"{kind} {index} becomes {count} placeholder tokens, which cannot fit max_model_len="
                    f"{self.max_model_len} ({smaller}{where}, or raise max_model_len)"
                )

    def _load_items(
        self, images: list[ImageInput], mm_uuids: Sequence[str | None] | None, memo: BatchMemo | None
    ) -> tuple[list[str], list[EncoderInputs]]:
        """Each image's mm_hash and preprocessed inputs, one image after another."""
        user_ids = self._validated_user_ids(mm_uuids, len(images))
        items = [self._load_item(image, user_id, index, memo) for index, (image, user_id) in enumerate(zip(images, user_ids))]
        return [mm_hash for mm_hash, _ in items], [inputs for _, inputs in items]

    def _load_item(
        self, image: ImageInput, user_id: str | None, index: int, memo: BatchMemo | None
    ) -> tuple[str, EncoderInputs]:
        """One image's mm_hash and preprocessed inputs. What is known is not done again: a user id
        names the item (nothing is read to hash it), an object this batch has read has its hash in
        `memo`, encoded bytes seen before have theirs in the cache (no decode), and a known item's
        inputs come from the cache (no resize and normalize). Each of these is looked up and, if
        missing, made under its key's lock, so threads that bring the same object, bytes or item at
        once do the work once between them."""
        if is_embeds_item(image):  # precomputed embeddings: checked and hashed, never preprocessed
            inputs = check_embeds(image, self.family.embedding_width, self.family.embeds_need_grid, index)
            if user_id is not None:
                return hash_user_id(user_id, self.fingerprint, self.settings_key, self.hash_algo), inputs
            return hash_embeds(inputs, self.fingerprint, self.hash_algo), inputs
        if user_id is not None:
            mm_hash = hash_user_id(user_id, self.fingerprint, self.settings_key, self.hash_algo)
            return mm_hash, self._inputs(mm_hash, lambda: self._read(image, index))
        if memo is None:
            return self._load_by_content(image, index)
        with memo.locks.hold(id(image)):
            mm_hash = memo.hashes.get(id(image))
            if mm_hash is None:
                mm_hash, inputs = self._load_by_content(image, index)
                memo.hashes[id(image)] = mm_hash
                return mm_hash, inputs
        return mm_hash, self._inputs(mm_hash, lambda: self._read(image, index))

    def _load_by_content(self, image: ImageInput, index: int) -> tuple[str, EncoderInputs]:
        """An image known only by its content: encoded bytes (a file or bytes) by their digest, whose
        mm_hash the cache may already know; anything else by its decoded pixels."""
        encoded = encoded_bytes(image, image_index=index)
        if encoded is None:
            picture = self._read(image, index)
            mm_hash = self.pictures.content_hash(picture)
            return mm_hash, self._inputs(mm_hash, lambda: picture)
        digest = hash_bytes(encoded, self.hash_algo)
        with self._decoding.hold(digest):
            with self._lock:
                mm_hash = self.cache.hash_of_encoded(digest)
            if mm_hash is None and self.pool is not None:
                mm_hash, inputs = self.pool.prepare(encoded, index, os.fspath(image) if isinstance(image, (str, os.PathLike)) else None)
                with self._lock:
                    self.num_images_decoded += 1
                    self.cache.remember_encoded(digest, mm_hash)
                return mm_hash, self._adopt(mm_hash, inputs)
            if mm_hash is None:
                picture = self._read(image, index, encoded)
                mm_hash = self.pictures.content_hash(picture)
                with self._lock:
                    self.cache.remember_encoded(digest, mm_hash)
                return mm_hash, self._inputs(mm_hash, lambda: picture)
        return mm_hash, self._inputs(mm_hash, lambda: self._read(image, index, encoded))

    def _inputs(self, mm_hash: str, read: Callable[[], Image.Image]) -> EncoderInputs:
        """The item's preprocessed inputs: cached, else preprocessed now from the picture `read()` gives."""
        with self._preprocessing.hold(mm_hash):
            with self._lock:
                cached = self.cache.get(mm_hash)
            if cached is not None:
                return cached
            (inputs,) = self.family.split_images(self._preprocess([read()]), 1)
            with self._lock:
                self.num_images_preprocessed += 1
                return self.cache.put(mm_hash, inputs)

    def _adopt(self, mm_hash: str, inputs: EncoderInputs) -> EncoderInputs:
        """Inputs a worker prepared: the cache's if it has the item by now, else these, cached."""
        with self._preprocessing.hold(mm_hash):
            with self._lock:
                cached = self.cache.get(mm_hash)
                if cached is not None:
                    return cached
                self.num_images_preprocessed += 1
                return self.cache.put(mm_hash, inputs)

    def _read(self, image: ImageInput, index: int, encoded: bytes | None = None) -> Image.Image:
        """The picture decoded (or converted), once it is known that preprocessing it stays within
        max_image_pixels."""
        picture = self.pictures.decode(image, index, encoded)
        with self._lock:
            self.num_images_decoded += 1
        return picture

    def _validated_user_ids(self, mm_uuids: Sequence[str | None] | None, num_images: int, kind: str = "image") -> list[str | None]:
        if mm_uuids is None:
            return [None] * num_images
        if not isinstance(mm_uuids, (list, tuple)):
            raise InvalidInputError(f"mm_uuids' {kind} ids must be a list, got {type(mm_uuids).__name__}")
        if len(mm_uuids) != num_images:
            raise InvalidInputError(f"mm_uuids has {len(mm_uuids)} entries for {num_images} {kind}(s)")
        for index, user_id in enumerate(mm_uuids):
            if user_id is not None and not (isinstance(user_id, str) and user_id):
                raise InvalidInputError(f"mm_uuids[{index}] must be a non-empty str or None, got {user_id!r}")
        return list(mm_uuids)

    def _check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"{num_prompt_tokens} prompt tokens + max_tokens={max_tokens} = {total} "
                f"exceeds max_model_len={self.max_model_len}"
            )
        if self.max_tokens_in_kv_cache is not None and total > self.max_tokens_in_kv_cache:
            raise PromptTooLongError(
                f"{num_prompt_tokens} prompt tokens + max_tokens={max_tokens} = {total} "
                f"would not fit in the whole KV cache ({self.max_tokens_in_kv_cache} tokens)"
            )

    def _placeholder_items(
        self, token_ids: list[int], starts: list[int], counts: list[int], images: list[EncoderInputs], mm_hashes: list[str]
    ) -> list[MMItem]:
        """One item per image, in prompt order, each owning the run `_tokenize` expanded for it; the
        prompt must hold no image tokens besides those runs."""
        found = token_ids.count(self.image_token_id)
        # a run may hold other tokens among its placeholders (Pixtral's [IMG_BREAK]s); none may lie outside the runs
        expected = sum(token_ids[start:start + count].count(self.image_token_id) for start, count in zip(starts, counts))
        if found != expected or len(starts) != len(images):
            raise ImageCountMismatchError(
                f"the prompt holds {found} image tokens but its {len(images)} image(s) need {expected}"
            )
        return [
            MMItem("image", mm_hash, start, count, inputs)
            for inputs, start, count, mm_hash in zip(images, starts, counts, mm_hashes)
        ]
