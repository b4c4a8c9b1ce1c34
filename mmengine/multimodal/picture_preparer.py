"""A picture's cache miss: decoded within the limits, hashed by content, preprocessed into the family's
inputs. One object does it the same way in the engine's process and in a preprocessing worker
(preprocess_pool.py), so an item's mm_hash and pixels never depend on where it was prepared."""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from mmengine.encoder_cache.hashing import hash_image
from mmengine.models.family import EncoderInputs, ModelFamily
from mmengine.multimodal.fast_image_processor import Allocate, empty, fast_image_processor
from mmengine.multimodal.image_loading import ImageInput, load_image
from mmengine.multimodal.resize_guard import check_preprocessed_size

logger = logging.getLogger(__name__)

WARM_UP_SIZE = (96, 96)  # the warm-up picture's: within every family's size bounds


@dataclass(frozen=True)
class PreparerSpec:
    """What a worker process needs to build the engine's PicturePreparer (plain data: it is pickled): the
    engine's own image processor (its overrides applied) and checkpoint config, so a worker reads no
    checkpoint file and loads no tokenizer, and prepares pictures exactly as the engine's process does."""

    image_processor: Any
    hf_config: Any
    model_dir: str | Path | None  # the family's: where it reads other processor files from
    max_image_pixels: int
    fingerprint: str
    settings_key: str
    hash_algo: str


class PicturePreparer:
    def __init__(self, image_processor: Any, family: ModelFamily, max_image_pixels: int, fingerprint: str,
                 settings_key: str, hash_algo: str) -> None:
        self.image_processor = image_processor
        self.family = family
        self.max_image_pixels = max_image_pixels
        self.fingerprint = fingerprint
        self.settings_key = settings_key
        self.hash_algo = hash_algo
        # transformers' pixels, bit for bit, without its float passes (fast_image_processor.py); else its own
        self._fast, why = fast_image_processor(image_processor)
        if self._fast is None:
            logger.info("images are preprocessed by transformers' processor: %s", why)

    @classmethod
    def from_spec(cls, spec: PreparerSpec) -> PicturePreparer:
        """The preparer a worker builds: the engine's image processor, and its family rebuilt as load_family
        builds it (from the config and the settings that image processor uses)."""
        from mmengine.models.registry import family_class_for, image_processor_settings

        family = family_class_for(spec.hf_config)(spec.hf_config, image_processor_settings(spec.image_processor), spec.model_dir)
        return cls(spec.image_processor, family, spec.max_image_pixels, spec.fingerprint, spec.settings_key, spec.hash_algo)

    def spec(self) -> PreparerSpec:
        """What a preprocessing worker builds this preparer from (preprocess_pool.py)."""
        return PreparerSpec(self.image_processor, self.family.hf_config, self.family.model_dir, self.max_image_pixels,
                            self.fingerprint, self.settings_key, self.hash_algo)

    def warm_up(self) -> None:
        """Pays at start-up what the first picture would (about 50 ms on an idle CPU, several times that on a
        loaded one): Pillow's plugin registry (its first open imports every plugin), the JPEG decoder, the EXIF
        reader, hashing and the processor's first call. Nothing is cached or counted: this is no picture's."""
        buffer = io.BytesIO()
        Image.new("RGB", WARM_UP_SIZE, (128, 96, 64)).save(buffer, "JPEG")
        try:
            self.prepare_encoded(buffer.getvalue(), 0)
        except Exception as err:  # noqa: BLE001 - not fatal: the first picture pays instead, and reports its own errors
            logger.warning("warming up the picture path failed, so the first picture pays for it: %s: %s",
                           type(err).__name__, err)

    def decode(self, image: ImageInput, index: int, encoded: bytes | None = None) -> Image.Image:
        """The picture as RGB, once it is known that preprocessing it stays within max_image_pixels."""
        picture = load_image(image, max_pixels=self.max_image_pixels, image_index=index, encoded=encoded)
        check_preprocessed_size(self.image_processor, *picture.size, self.max_image_pixels, index, self.family.resized_size)
        return picture

    def content_hash(self, picture: Image.Image) -> str:
        return hash_image(picture, self.fingerprint, self.settings_key, self.hash_algo)

    def preprocess(self, pictures: list[Image.Image], allocate: Allocate = empty) -> Any:
        """The image processor's output for the pictures (the fast path's, in tensors `allocate` makes,
        where it has one)."""
        if self._fast is not None:
            return self._fast(pictures, allocate)
        return self.image_processor(images=pictures, return_tensors="pt")

    def inputs(self, picture: Image.Image, allocate: Allocate = empty) -> EncoderInputs:
        (inputs,) = self.family.split_images(self.preprocess([picture], allocate), 1)
        return inputs

    def prepare_encoded(self, encoded: bytes, index: int, path: str | None = None,
                        allocate: Allocate = empty) -> tuple[str, EncoderInputs]:
        """Encoded bytes' mm_hash and inputs (a preprocessing worker's task); `path`: the file they came
        from, for error messages."""
        picture = self.decode(path if path is not None else encoded, index, encoded)
        return self.content_hash(picture), self.inputs(picture, allocate)
