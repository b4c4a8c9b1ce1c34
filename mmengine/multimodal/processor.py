"""InputProcessor: prompt + images -> validated token ids with expanded placeholder runs and items.

Every check on user input happens here, before anything is scheduled or allocated,
and every failure is a typed InvalidInputError naming the prompt it came from.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoProcessor, PretrainedConfig

from mmengine.errors import (
    EmptyPromptError,
    ImageCountMismatchError,
    InvalidInputError,
    ItemTooLargeError,
    PromptTooLongError,
    TooManyImagesError,
    UnsupportedModelError,
)
from mmengine.encoder_cache.hashing import hash_image, hash_user_id, model_fingerprint, processor_settings_key
from mmengine.multimodal.image_loading import ImageInput, load_image
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
    ) -> None:
        self.hf_processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
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
        # One pixel tensor per distinct item among the requests alive: the same picture in a thousand
        # queued requests is held once.
        self._pixels: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()

    def check_tokens_per_image(self, expected: int) -> None:
        """Fails at start-up if the processor expands an image into a different number of placeholders
        than the model makes embeddings (a checkpoint whose processor and model configs disagree)."""
        probe = Image.new("RGB", (64, 48), (127, 127, 127))
        ids = self.hf_processor(text=self.image_token, images=[probe], return_tensors="pt")["input_ids"][0]
        produced = int((ids == self.image_token_id).sum())
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
        if not isinstance(prompt, str):
            raise InvalidInputError(f"prompt must be a str, got {type(prompt).__name__}")
        if len(images) > self.max_images:
            raise TooManyImagesError(
                f"{len(images)} images given but limit_mm_per_prompt allows at most {self.max_images} per prompt"
            )
        num_markers = prompt.count(self.image_token)
        if num_markers != len(images):
            raise ImageCountMismatchError(
                f"the prompt has {num_markers} {self.image_token} marker(s) but {len(images)} image(s) were given"
            )
        loaded = [load_image(img, max_pixels=self.max_image_pixels, image_index=i) for i, img in enumerate(images)]
        encoded = self.hf_processor(text=prompt, images=loaded or None, return_tensors="pt")
        token_ids: list[int] = encoded["input_ids"][0].tolist()
        if not token_ids:
            raise EmptyPromptError("the prompt is empty after tokenization")
        self._check_length(len(token_ids), params.max_tokens)
        mm_hashes = self._item_hashes(loaded, mm_uuids)
        items = self._placeholder_items(token_ids, encoded.get("pixel_values"), mm_hashes)
        return ProcessedPrompt(prompt=prompt, prompt_token_ids=token_ids, mm_items=items)

    def _item_hashes(self, images: list, mm_uuids: Sequence[str | None] | None) -> list[str]:
        if mm_uuids is None:
            mm_uuids = [None] * len(images)
        elif len(mm_uuids) != len(images):
            raise InvalidInputError(f"mm_uuids has {len(mm_uuids)} entries for {len(images)} image(s)")
        hashes = []
        for index, (image, user_id) in enumerate(zip(images, mm_uuids)):
            if user_id is None:
                hashes.append(hash_image(image, self.fingerprint, self.settings_key))
            elif isinstance(user_id, str) and user_id:
                hashes.append(hash_user_id(user_id, self.fingerprint, self.settings_key))
            else:
                raise InvalidInputError(f"mm_uuids[{index}] must be a non-empty str or None, got {user_id!r}")
        return hashes

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
        self, token_ids: list[int], pixel_values: torch.Tensor | None, mm_hashes: list[str]
    ) -> list[MMItem]:
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
        assert pixel_values is not None and pixel_values.shape[0] == num_images
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
            pixels = self._pixels.setdefault(mm_hashes[idx], pixel_values[idx].clone())
            items.append(MMItem("image", mm_hashes[idx], run[0], per_image, {"pixel_values": pixels}))
        return items
