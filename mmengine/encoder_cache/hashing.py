"""Content hashes of multimodal items: the same picture, processed the same way, hashes the same.

mm_hash = H(modality, model fingerprint, processor settings, item content). The content is the
decoded RGB pixels, so a path, encoded bytes, a PIL image and a numpy array of one picture agree;
different processor settings or a different model give different hashes. An audio clip's content is
its mono float32 waveform at the model's rate, after decoding and resampling.

H is the engine's `prefix_caching_hash_algo`: xxh3_128, or sha256 where crafted collisions are a
concern. The two must go together: a KV block's identity includes the mm_hash of every image it
overlaps, so an image hash collision would be a prefix-cache (and encoder-cache) collision too.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import xxhash
import numpy as np
from PIL import Image

from mmengine.multimodal.image_loading import image_content_bytes

# Files whose contents change what the vision encoder outputs for a given image.
_FINGERPRINT_FILES = ("config.json", "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


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


def new_hasher(algo: str) -> Any:
    """An incremental hasher (update / hexdigest) of one of the engine's hash algorithms."""
    if algo == "xxh3_128":
        return xxhash.xxh3_128()
    if algo == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown hash algorithm {algo!r}")


def hash_bytes(data: bytes, algo: str) -> str:
    h = new_hasher(algo)
    h.update(data)
    return h.hexdigest()


def hash_image(image: Image.Image, fingerprint: str, settings_key: str, algo: str = "xxh3_128") -> str:
    return _hash_item(b"image", fingerprint, settings_key, b"content", image_content_bytes(image), algo)


def hash_user_id(user_id: str, fingerprint: str, settings_key: str, algo: str = "xxh3_128", modality: str = "image") -> str:
    """A user-given item id (mm_uuids) stands in for the content; model and settings still separate it."""
    return _hash_item(modality.encode(), fingerprint, settings_key, b"uuid", user_id.encode(), algo)


def _hash_item(modality: bytes, fingerprint: str, settings_key: str, kind: bytes, content: bytes, algo: str) -> str:
    h = new_hasher(algo)
    for part in (modality, fingerprint.encode(), settings_key.encode(), kind):
        h.update(len(part).to_bytes(8, "little") + part)
    h.update(content)
    return h.hexdigest()


def hash_video(frames: np.ndarray, indices: list[int] | tuple[int, ...], fps: float, fingerprint: str, settings_key: str, algo: str = "xxh3_128") -> str:
    """A video by its sampled frames' pixels, which source frames they are and the source's rate
    (timestamps and temporal positions follow from them)."""
    header = f"{list(frames.shape)} {list(indices)} {fps!r}\n".encode("ascii")
    h = new_hasher(algo)
    for part in (b"video", fingerprint.encode(), settings_key.encode(), b"content"):
        h.update(len(part).to_bytes(8, "little") + part)
    h.update(header)
    h.update(memoryview(np.ascontiguousarray(frames)).cast("B"))  # the pixels without a copy
    return h.hexdigest()


def hash_video_patch(video_hash: str, index: int, algo: str = "xxh3_128") -> str:
    """Temporal patch `index` of a video: one item, cached on its own."""
    return _hash_item(b"video-patch", video_hash, str(index), b"patch", b"", algo)


def hash_image_part(image_hash: str, index: int, algo: str = "xxh3_128") -> str:
    """Item `index` of a picture that makes several items (Gemma 3's pan-and-scan: the whole picture, then
    each crop): each cached on its own."""
    return _hash_item(b"image-part", image_hash, str(index), b"part", b"", algo)


def hash_audio(waveform: np.ndarray, sampling_rate: int, fingerprint: str, settings_key: str, algo: str = "xxh3_128") -> str:
    """An audio clip by its mono float32 samples at the model's rate (after decoding and resampling, so
    the same sound from any container or source rate that resamples alike hashes the same)."""
    # + 0 turns -0.0 into 0.0: equal samples must hash alike (a decoder never writes -0.0, an array may)
    samples = np.ascontiguousarray(waveform, dtype=np.float32) + np.float32(0)
    h = new_hasher(algo)
    for part in (b"audio", fingerprint.encode(), settings_key.encode(), b"content"):
        h.update(len(part).to_bytes(8, "little") + part)
    h.update(f"{samples.shape[0]} {sampling_rate}\n".encode("ascii"))
    h.update(memoryview(samples).cast("B"))
    return h.hexdigest()
