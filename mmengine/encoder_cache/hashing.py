"""Content hashes of multimodal items: the same picture, processed the same way, hashes the same.

mm_hash = xxh3_128(modality, model fingerprint, processor settings, item content). The content
is the decoded RGB pixels, so a path, encoded bytes, a PIL image and a numpy array of one
picture agree; different processor settings or a different model give different hashes.
"""

from __future__ import annotations

import json
from pathlib import Path

import xxhash
from PIL import Image

from mmengine.multimodal.image_loading import image_content_bytes

# Files whose contents change what the vision encoder outputs for a given image.
_FINGERPRINT_FILES = ("config.json", "preprocessor_config.json", "processor_config.json")


def model_fingerprint(model_dir: Path) -> str:
    h = xxhash.xxh3_128()
    for name in _FINGERPRINT_FILES:
        path = model_dir / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"") + b"\0")
    return h.hexdigest()


def processor_settings_key(image_processor: object) -> str:
    """The image processor's settings as canonical JSON."""
    to_dict = getattr(image_processor, "to_dict", None)
    settings = to_dict() if callable(to_dict) else vars(image_processor)
    return json.dumps(settings, sort_keys=True, default=str)


def hash_image(image: Image.Image, fingerprint: str, settings_key: str) -> str:
    return _hash_item(b"image", fingerprint, settings_key, b"content", image_content_bytes(image))


def hash_user_id(user_id: str, fingerprint: str, settings_key: str, modality: str = "image") -> str:
    """A user-given item id (mm_uuids) stands in for the content; model and settings still separate it."""
    return _hash_item(modality.encode(), fingerprint, settings_key, b"uuid", user_id.encode())


def _hash_item(modality: bytes, fingerprint: str, settings_key: str, kind: bytes, content: bytes) -> str:
    h = xxhash.xxh3_128()
    for part in (modality, fingerprint.encode(), settings_key.encode(), kind):
        h.update(len(part).to_bytes(8, "little") + part)
    h.update(content)
    return h.hexdigest()
