"""A request's video -> its plan (frames kept, size, patches), one mm_hash and one preprocessed item per
temporal patch.

What is known is not done again, as for pictures: a video given before with the same settings (the
same bytes, the same frames, or the same uuid) is looked up by that key, and if the processor cache
still holds its items nothing is decoded. Each key is loaded under its own lock, so threads that
bring one video at once decode it once. Everything that bounds the work (duration, frame size, the
resized size, the embeddings per item and in all) is checked before the first frame is decoded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from mmengine.encoder_cache.hashing import hash_bytes, hash_user_id, hash_video, hash_video_patch, new_hasher
from mmengine.errors import InvalidInputError, ItemTooLargeError, VideoTooLargeError
from mmengine.utils.keyed_lock import KeyedLock
from mmengine.models.family import EncoderInputs, ModelFamily, VideoPlan
from mmengine.multimodal import video as video_io
from mmengine.multimodal.media_container import DEFAULT_MAX_MEDIA_DECODE_SECONDS
from mmengine.multimodal.media_loader import MediaLoader
from mmengine.multimodal.processor_cache import ProcessorCache

MAX_REMEMBERED_VIDEOS = 4096


@dataclass
class LoadedVideo:
    plan: VideoPlan
    hashes: list[str]  # one per temporal patch
    inputs: list[EncoderInputs]


@dataclass
class VideoLimits:
    max_seconds: float
    max_frame_pixels: int
    max_tokens_per_item: int | None = None  # set by the engine once the encoder budget is known
    max_model_len: int | None = None
    max_decode_seconds: float = DEFAULT_MAX_MEDIA_DECODE_SECONDS  # each of the probe and the decode


class VideoLoader(MediaLoader[VideoLimits]):
    def __init__(
        self, family: ModelFamily, cache: ProcessorCache, cache_lock: threading.Lock, fingerprint: str, settings_key: str,
        limits: VideoLimits, hash_algo: str,
    ) -> None:
        super().__init__(family, cache, cache_lock, fingerprint, settings_key, limits, hash_algo)
        self._known: OrderedDict[str, tuple[VideoPlan, list[str]]] = OrderedDict()
        self._loading = KeyedLock()
        self.num_videos_decoded = 0
        self.num_videos_preprocessed = 0

    def load(self, video: video_io.Video, index: int) -> LoadedVideo:
        settings = f"{self.settings_key}|{video.options_key()}"
        if video.uuid is not None:  # a known id reads nothing: the source is read only on a miss
            key = hash_user_id(video.uuid, self.fingerprint, settings, self.hash_algo, modality="video")
            return self._load_keyed(key, video, index, settings, named=True)
        encoded = video_io.encoded_video_bytes(video, index)
        frames = None if encoded is not None else video_io.given_frames(video, index, self.limits.max_frame_pixels)
        if encoded is not None:
            key = "bytes:" + hash_bytes(encoded, self.hash_algo) + settings
        else:
            key = "frames:" + self._hash_frames(frames) + settings
        return self._load_keyed(key, video, index, settings, False, encoded, frames)

    def _load_keyed(
        self, key: str, video: video_io.Video, index: int, settings: str, named: bool,
        encoded: bytes | None = None, frames: np.ndarray | None = None,
    ) -> LoadedVideo:
        with self._loading.hold(key):
            known = self._lookup(key)
            if known is not None:
                return known
            if named:
                encoded = video_io.encoded_video_bytes(video, index)
                frames = None if encoded is not None else video_io.given_frames(video, index, self.limits.max_frame_pixels)
            loaded = self._read(video, index, encoded, frames, settings, key if named else None)
            with self._cache_lock:
                loaded.inputs = [self.cache.put(h, inputs) for h, inputs in zip(loaded.hashes, loaded.inputs)]
                self._known[key] = (loaded.plan, loaded.hashes)
                while len(self._known) > MAX_REMEMBERED_VIDEOS:
                    self._known.popitem(last=False)
                self.num_videos_preprocessed += 1
            return loaded

    def _lookup(self, key: str) -> LoadedVideo | None:
        with self._cache_lock:
            known = self._known.get(key)
            if known is None:
                return None
            self._known.move_to_end(key)
            plan, hashes = known
            inputs = [self.cache.get(h) for h in hashes]
        if any(x is None for x in inputs):
            return None
        return LoadedVideo(plan, list(hashes), inputs)  # type: ignore[arg-type]

    def _hash_frames(self, frames: np.ndarray) -> str:
        h = new_hasher(self.hash_algo)
        h.update(f"{list(frames.shape)}\n".encode("ascii"))
        h.update(memoryview(np.ascontiguousarray(frames)).cast("B"))
        return h.hexdigest()

    def _read(
        self, video: video_io.Video, index: int, encoded: bytes | None, frames: np.ndarray | None, settings: str, uuid_key: str | None
    ) -> LoadedVideo:
        limits = self.limits
        if encoded is not None:
            info = video_io.probe(encoded, index, limits.max_seconds, limits.max_frame_pixels, limits.max_decode_seconds)
        else:
            num, height, width = frames.shape[:3]
            info = video_io.VideoInfo(num, float(video.frame_rate or video_io.DEFAULT_FRAME_RATE), height, width)
            video_io.check_limits(info, index, limits.max_seconds, limits.max_frame_pixels)
        # given frames without fps / num_frames are kept as they are
        keep_all = encoded is None and video.fps is None and video.num_frames is None
        try:
            plan = self.family.plan_video(info, video, keep_all)
        except InvalidInputError as err:
            raise type(err)(f"video {index}: {err.reason}") from err
        self._check_plan(plan, index)
        if encoded is not None:
            frames = video_io.decode(encoded, plan.indices, info, index, limits.max_decode_seconds)
            with self._cache_lock:
                self.num_videos_decoded += 1
        else:
            frames = frames[list(plan.indices)]
        video_hash = uuid_key or hash_video(frames, plan.indices, plan.source_fps, self.fingerprint, settings, self.hash_algo)
        inputs = self.family.video_items(frames, plan)
        hashes = [hash_video_patch(video_hash, j, self.hash_algo) for j in range(len(inputs))]
        return LoadedVideo(plan, hashes, inputs)

    def _check_plan(self, plan: VideoPlan, index: int) -> None:
        limits = self.limits
        if plan.height * plan.width > limits.max_frame_pixels:
            raise VideoTooLargeError(
                f"video {index}: frames would be resized to {plan.width}x{plan.height}, more than max_image_pixels={limits.max_frame_pixels}"
            )
        largest = plan.item_tokens(plan.num_patches - 1)  # (the last item carries any trailing tokens)
        if limits.max_tokens_per_item is not None and largest > limits.max_tokens_per_item:
            raise ItemTooLargeError(
                f"video {index}: each temporal patch becomes {largest} embeddings but the encoder cache budget is "
                f"{limits.max_tokens_per_item} per step (lower the video's max_pixels, or raise encoder_cache_size)"
            )
        if limits.max_model_len is not None and plan.num_tokens >= limits.max_model_len:
            raise ItemTooLargeError(
                f"video {index}: {len(plan.indices)} frames of {plan.width}x{plan.height} become {plan.num_tokens} placeholder tokens, "
                f"which cannot fit max_model_len={limits.max_model_len} (sample fewer frames, or lower max_pixels)"
            )
