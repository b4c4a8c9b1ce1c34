"""InputProcessor: prompt + images -> validated token ids with expanded placeholder runs and items.

Every check on user input happens here, before anything is scheduled or allocated,
and every failure is a typed InvalidInputError naming the prompt it came from.

The HF processor does the work, split in its two halves: the text is tokenized with each image
marker kept as one token, which is then expanded into the run of placeholders the processor's own
expansion produces (measured once, at start-up); images go through the image processor only when
their preprocessed pixels are not already in the processor cache.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import PretrainedConfig

from mmengine.errors import (
    EmptyPromptError,
    ImageCountMismatchError,
    InvalidInputError,
    ItemTooLargeError,
    PromptTooLongError,
    TooManyImagesError,
    UnsupportedModelError,
)
from mmengine.api_inputs import check_prompt_text
from mmengine.encoder_cache.hashing import hash_bytes, hash_image, hash_user_id, model_fingerprint, processor_settings_key
from mmengine.models.registry import load_hf_processor
from mmengine.multimodal.image_loading import ImageInput, encoded_bytes, load_image
from mmengine.multimodal.processor_cache import ProcessorCache
from mmengine.multimodal.resize_guard import check_preprocessed_size
from mmengine.request import MMItem, ProcessedPrompt
from mmengine.sampling import SamplingParams


class InputProcessor:
    def __init__(
        self,
        model_dir: Path,
        hf_config: PretrainedConfig,
        max_model_len: int,
        limit_mm_per_prompt: dict[str, int],
        max_image_pixels: int,
        processor_cache_bytes: int = 0,
        hash_algo: str = "xxh3_128",
    ) -> None:
        self.hf_processor = load_hf_processor(model_dir)
        self.tokenizer = self.hf_processor.tokenizer
        self.image_token: str = self.hf_processor.image_token
        self.image_token_id: int = hf_config.image_token_id
        self.fingerprint = model_fingerprint(model_dir)
        self.settings_key = processor_settings_key(self.hf_processor.image_processor)
        self.max_model_len = max_model_len
        self.max_images = limit_mm_per_prompt.get("image", 0)
        self.max_image_pixels = max_image_pixels
        # Set by the engine once the caches exist: a request must fit in the KV cache alone,
        # and each item in one step's encoder budget.
        self.max_tokens_in_kv_cache: int | None = None
        self.max_tokens_per_item: int | None = None
        # One pixel tensor per distinct item, shared by every request that has it and kept after they
        # finish (up to processor_cache_bytes): the same picture is preprocessed once.
        self.cache = ProcessorCache(processor_cache_bytes)
        # Several threads may add requests at once: the cache, the counters and the tokenizer are
        # touched under this lock; decoding, hashing and the image processor run outside it.
        self._lock = threading.Lock()
        self.hash_algo = hash_algo
        self.num_images_decoded = 0
        self.num_images_preprocessed = 0
        self.tokens_per_image = 0
        self._measure_tokens_per_image()

    def _measure_tokens_per_image(self) -> None:
        """How many placeholder tokens the HF processor expands one image marker into (fixed-size
        LLaVA-style processors: the same for every image). Also checks, on a probe prompt, that
        tokenizing with markers kept whole and expanding them gives the processor's own ids."""
        probe = Image.new("RGB", (64, 48), (127, 127, 127))
        text = f"USER: {self.image_token}\nCompare{self.image_token} with this. ASSISTANT:"
        ids = self.hf_processor(text=text, images=[probe, probe])["input_ids"][0]
        per_image, rest = divmod(sum(t == self.image_token_id for t in ids), 2)
        if rest or per_image == 0:
            raise UnsupportedModelError("the processor does not expand each image marker into one run of image tokens")
        self.tokens_per_image = per_image
        if self._tokenize(text) != list(ids):
            raise UnsupportedModelError(
                "the processor's tokenization differs from its tokenizer's with image markers expanded in place; "
                "this processor is not supported"
            )

    def check_tokens_per_image(self, expected: int) -> None:
        """Fails at start-up if the processor expands an image into a different number of placeholders
        than the model makes embeddings (a checkpoint whose processor and model configs disagree)."""
        produced = self.tokens_per_image
        if produced != expected:
            raise UnsupportedModelError(
                f"the processor expands an image into {produced} placeholder tokens but the model produces "
                f"{expected} embeddings per image: the checkpoint's processor and model configs disagree"
            )

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        return self.hf_processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def process(
        self,
        prompt: str,
        images: Sequence[ImageInput] | None,
        params: SamplingParams,
        prompt_index: int = 0,
        mm_uuids: Sequence[str | None] | None = None,
    ) -> ProcessedPrompt:
        """`mm_uuids` optionally names each image: equal ids mean equal images (content is not hashed)."""
        try:
            return self._process(prompt, list(images or ()), params, mm_uuids)
        except InvalidInputError as err:
            raise err.at_prompt(prompt_index) from err

    def _process(
        self, prompt: str, images: list[ImageInput], params: SamplingParams, mm_uuids: Sequence[str | None] | None
    ) -> ProcessedPrompt:
        check_prompt_text(prompt)
        if len(images) > self.max_images:
            raise TooManyImagesError(
                f"{len(images)} images given but limit_mm_per_prompt allows at most {self.max_images} per prompt"
            )
        num_markers = prompt.count(self.image_token)
        if num_markers != len(images):
            raise ImageCountMismatchError(
                f"the prompt has {num_markers} {self.image_token} marker(s) but {len(images)} image(s) were given"
            )
        mm_hashes, pixels = self._load_items(images, mm_uuids)
        token_ids = self._tokenize(prompt)
        if not token_ids:
            raise EmptyPromptError("the prompt is empty after tokenization")
        self._check_length(len(token_ids), params.max_tokens)
        items = self._placeholder_items(token_ids, pixels, mm_hashes)
        return ProcessedPrompt(prompt=prompt, prompt_token_ids=token_ids, mm_items=items)

    def _tokenize(self, prompt: str) -> list[int]:
        """The text tokenized as the processor does, each image marker (one added token) expanded in
        place into its run of placeholders, as the processor's own expansion would, without pixels."""
        with self._lock:  # a fast tokenizer may refuse concurrent calls ("Already borrowed")
            ids = self.tokenizer(prompt)["input_ids"]
        run = [self.image_token_id] * self.tokens_per_image
        expanded: list[int] = []
        for token in ids:
            if token == self.image_token_id:
                expanded += run
            else:
                expanded.append(token)
        return expanded

    def _load_items(
        self, images: list[ImageInput], mm_uuids: Sequence[str | None] | None
    ) -> tuple[list[str], list[torch.Tensor]]:
        """Each image's mm_hash and preprocessed pixels. A known item (same user id, same encoded
        bytes, or same decoded pixels) reuses the cached tensor: no decode in the first two cases,
        no resize and normalize in any."""
        user_ids = self._validated_user_ids(mm_uuids, len(images))
        hashes: list[str] = []
        pixels: list[torch.Tensor | None] = []
        to_preprocess: dict[str, Image.Image] = {}
        for index, (image, user_id) in enumerate(zip(images, user_ids)):
            mm_hash = hash_user_id(user_id, self.fingerprint, self.settings_key, self.hash_algo) if user_id is not None else None
            digest = encoded = None
            if mm_hash is None:
                encoded = encoded_bytes(image, image_index=index)
                if encoded is not None:
                    digest = hash_bytes(encoded, self.hash_algo)
                    with self._lock:
                        mm_hash = self.cache.hash_of_encoded(digest)
            with self._lock:
                cached = self.cache.get(mm_hash) if mm_hash is not None else None
            if cached is None and mm_hash not in to_preprocess:
                loaded = load_image(image, max_pixels=self.max_image_pixels, image_index=index, encoded=encoded)
                check_preprocessed_size(self.hf_processor.image_processor, *loaded.size, self.max_image_pixels, index)
                hashed_now = mm_hash is None
                if hashed_now:
                    mm_hash = hash_image(loaded, self.fingerprint, self.settings_key, self.hash_algo)
                with self._lock:
                    self.num_images_decoded += 1
                    if hashed_now:
                        cached = self.cache.get(mm_hash)
                    if digest is not None:
                        self.cache.remember_encoded(digest, mm_hash)
                if cached is None:
                    to_preprocess.setdefault(mm_hash, loaded)
            hashes.append(mm_hash)
            pixels.append(cached)
        if to_preprocess:
            batch = self.hf_processor.image_processor(images=list(to_preprocess.values()), return_tensors="pt")
            with self._lock:
                self.num_images_preprocessed += len(to_preprocess)
                fresh = {h: self.cache.put(h, t.clone()) for h, t in zip(to_preprocess, batch["pixel_values"])}
            pixels = [p if p is not None else fresh[h] for p, h in zip(pixels, hashes)]
        return hashes, pixels  # type: ignore[return-value]

    def _validated_user_ids(self, mm_uuids: Sequence[str | None] | None, num_images: int) -> list[str | None]:
        if mm_uuids is None:
            return [None] * num_images
        if len(mm_uuids) != num_images:
            raise InvalidInputError(f"mm_uuids has {len(mm_uuids)} entries for {num_images} image(s)")
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

    def _placeholder_items(self, token_ids: list[int], pixels: list[torch.Tensor], mm_hashes: list[str]) -> list[MMItem]:
        """One item per image, in prompt order, each owning a contiguous run of image tokens."""
        positions = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        num_images = len(mm_hashes)
        if num_images == 0:
            if positions:
                raise ImageCountMismatchError(f"the prompt contains {len(positions)} image token(s) but no image")
            return []
        per_image, rest = divmod(len(positions), num_images)
        if rest or per_image == 0:
            raise ImageCountMismatchError(
                f"{len(positions)} image tokens cannot be split evenly over {num_images} image(s)"
            )
        items = []
        for idx in range(num_images):
            run = positions[idx * per_image : (idx + 1) * per_image]
            if run[-1] - run[0] + 1 != per_image:
                raise ImageCountMismatchError(f"the image tokens of image {idx} are not contiguous")
            if self.max_tokens_per_item is not None and per_image > self.max_tokens_per_item:
                raise ItemTooLargeError(
                    f"image {idx} needs {per_image} embeddings but the encoder cache budget is "
                    f"{self.max_tokens_per_item} per step (raise encoder_cache_size)"
                )
            items.append(MMItem("image", mm_hashes[idx], run[0], per_image, {"pixel_values": pixels[idx]}))
        return items
