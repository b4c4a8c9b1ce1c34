"""Videos: what a caller gives, what is known before decoding, and the sampled frames.

A video is a file path, encoded bytes, or its frames (PIL images or a uint8 array [frames, H, W, 3]),
optionally wrapped in `Video` with its sampling (`fps` or `num_frames`) and size bounds. Files and
bytes are decoded with PyAV (the `video` extra), the one place untrusted video data is read. Only the
accepted containers (MP4/MOV, Matroska/WebM, MPEG-TS, AVI), judged by their magic bytes, are opened,
and FFmpeg may open nothing else (media_container.py). The container is probed first, and a clip
that is too long, has too many frames or too large frames is refused before any frame is decoded
(VideoTooLargeError); unreadable, corrupt or truncated data is a CorruptVideoError naming the video. Only the sampled frames are converted to RGB.

Which frames are sampled and how they are resized is the model family's rule (`models/qwen_video.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mmengine.errors import CorruptVideoError, InvalidInputError, VideoTooLargeError
from mmengine.multimodal.encoded_media import read_encoded, stated_seconds
from mmengine.multimodal.image_loading import MAX_ENCODED_FILE_BYTES
from mmengine.multimodal.media_container import (
    DEFAULT_MAX_MEDIA_DECODE_SECONDS,
    VIDEO_CONTAINERS,
    DecodeDeadline,
    container_for,
    import_av,
    open_media,
)

# One hour: longer than the clips vision-language models are trained on, and a bound on decoding work.
DEFAULT_MAX_VIDEO_SECONDS: float = 3600.0
# A frame rate above this is refused (slow-motion captures are 240 fps): with the duration it bounds the
# frames a decode walks through.
MAX_SOURCE_FPS: float = 240.0
# The rate assumed for frames given as a list or an array without `frame_rate`: Qwen's sampling rate, so
# pre-sampled frames get the timestamps the model was trained with.
DEFAULT_FRAME_RATE: float = 2.0


@dataclass
class Video:
    """A video and how to read it. `source`: a path, encoded bytes, or frames (a list of PIL images, or
    a uint8 array [frames, H, W, 3]). Sampling: `fps` frames per second, or `num_frames` in all (not
    both); neither samples a file at the model's default rate and keeps every given frame. `frame_rate`:
    the rate of given frames (default DEFAULT_FRAME_RATE). `min_pixels` / `max_pixels` / `total_pixels`
    override the checkpoint's size bounds, as transformers' video processors take them. `uuid` names
    the video (equal uuids mean equal videos; nothing is decoded to hash it)."""

    source: Any
    fps: float | None = None
    num_frames: int | None = None
    frame_rate: float | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    uuid: str | None = None

    def check(self, index: int) -> None:
        """Raises InvalidInputError naming the first setting that is not valid."""
        where = f"video {index}"
        if self.fps is not None and self.num_frames is not None:
            raise InvalidInputError(f"{where}: fps and num_frames are exclusive; give one")
        for name in ("fps", "frame_rate"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SOURCE_FPS):
                raise InvalidInputError(f"{where}: {name} must be a number in (0, {MAX_SOURCE_FPS:g}], got {value!r}")
        for name in ("num_frames", "min_pixels", "max_pixels", "total_pixels"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidInputError(f"{where}: {name} must be a positive int, got {value!r}")
        if self.uuid is not None and not (isinstance(self.uuid, str) and self.uuid):
            raise InvalidInputError(f"{where}: uuid must be a non-empty str, got {self.uuid!r}")

    def options_key(self) -> str:
        """The settings that change what the model sees, for content keys."""
        return f"fps={self.fps} n={self.num_frames} rate={self.frame_rate} px={self.min_pixels},{self.max_pixels},{self.total_pixels}"


def as_video(value: object, index: int) -> Video:
    video = value if isinstance(value, Video) else Video(value)
    video.check(index)
    return video


@dataclass(frozen=True)
class VideoInfo:
    """What is known of a video before its frames are decoded."""

    num_frames: int
    fps: float  # the rate of its frames
    height: int
    width: int

    @property
    def seconds(self) -> float:
        return self.num_frames / self.fps


@dataclass
class SampledVideo:
    """The frames a video's sampling picked, as RGB uint8 [T, H, W, 3], with where they came from."""

    frames: np.ndarray
    indices: list[int]  # their indices among the source's frames
    info: VideoInfo

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the sampled clip (transformers' VideoMetadata.sampled_fps)."""
        return len(self.indices) / self.info.num_frames * self.info.fps


def encoded_video_bytes(video: Video, index: int) -> bytes | None:
    """A path's or bytes' content (read, not decoded); None for given frames."""
    return read_encoded(video.source, f"video {index}", "video", max_file_bytes=MAX_ENCODED_FILE_BYTES * 16,
                        too_large=VideoTooLargeError, corrupt=CorruptVideoError, name_file=True)


def given_frames(video: Video, index: int, max_frame_pixels: int) -> np.ndarray:
    """Frames given as a list of PIL images or an array, as RGB uint8 [T, H, W, 3]."""
    source = video.source
    if isinstance(source, np.ndarray) or hasattr(source, "numpy") and not isinstance(source, (str, bytes)):
        array = np.asarray(source.numpy() if hasattr(source, "numpy") else source)
        if array.ndim != 4 or array.shape[-1] != 3 or array.dtype != np.uint8 or 0 in array.shape:
            raise InvalidInputError(
                f"video {index}: a frame array must be uint8 [frames, height, width, 3], got {array.dtype} {list(array.shape)}"
            )
        _check_frame_size(array.shape[2], array.shape[1], max_frame_pixels, index)
        return np.ascontiguousarray(array)
    if isinstance(source, (list, tuple)) and source and all(isinstance(frame, Image.Image) for frame in source):
        sizes = {frame.size for frame in source}
        if len(sizes) != 1:
            raise InvalidInputError(f"video {index}: its frames differ in size ({sorted(sizes)[:3]})")
        _check_frame_size(*source[0].size, max_frame_pixels, index)
        return np.stack([np.asarray(frame.convert("RGB")) for frame in source])
    kind = type(source).__name__
    raise InvalidInputError(
        f"video {index}: expected a path, encoded bytes, a list of PIL images or a uint8 array [frames, H, W, 3], got {kind}"
    )


def probe(
    data: bytes, index: int, max_seconds: float, max_frame_pixels: int,
    max_decode_seconds: float = DEFAULT_MAX_MEDIA_DECODE_SECONDS,
) -> VideoInfo:
    """The video's frame count, rate and frame size, checked against the limits before any frame is
    decoded. Containers' own frame counts and rates are often missing or wrong (Matroska, MPEG-TS), so
    the frames are counted by demuxing their packets (no decoding), and the rate is frames / duration
    where the duration is known. A count the container announces, consistent with its duration and
    rate (an MP4 index), that the packets fall short of means a truncated file. Only the accepted
    containers are opened (media_container.py), for at most `max_decode_seconds`."""
    _import_av()
    where = f"video {index}"
    container_format = container_for(data, VIDEO_CONTAINERS, where, "video")
    deadline = DecodeDeadline(max_decode_seconds, where)
    with open_media(data, container_format, deadline, CorruptVideoError, "video") as container:
        if not container.streams.video:
            raise CorruptVideoError(f"video {index}: the data holds no video stream")
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or 0)
        seconds = stated_seconds(container, stream)
        if seconds > max_seconds:
            raise VideoTooLargeError(f"video {index}: {seconds:.1f} s exceeds max_video_seconds={max_seconds:g}")
        _check_frame_size(stream.codec_context.width, stream.codec_context.height, max_frame_pixels, index)
        most = int(max_seconds * MAX_SOURCE_FPS)
        count = 0
        for packet in container.demux(stream):
            deadline.check()
            if packet.size:
                count += 1
                if count > most:
                    raise VideoTooLargeError(f"video {index}: more than {most} frames (max_video_seconds={max_seconds:g} at "
                                             f"{MAX_SOURCE_FPS:g} fps)")
        declared = int(stream.frames)
        announced = declared > 0 and rate > 0 and seconds > 0 and abs(declared - seconds * rate) <= max(2.0, 0.1 * declared)
        height, width = stream.codec_context.height, stream.codec_context.width
    if count < 1:
        raise CorruptVideoError(f"video {index}: the stream holds no frames")
    if announced and count < declared:
        raise CorruptVideoError(f"video {index}: truncated: the container announces {declared} frames but holds {count}")
    fps = count / seconds if seconds > 0 else rate
    if not 0 < fps <= MAX_SOURCE_FPS:
        raise CorruptVideoError(f"video {index}: frame rate {fps:g} is not in (0, {MAX_SOURCE_FPS:g}]")
    info = VideoInfo(num_frames=count, fps=fps, height=height, width=width)
    check_limits(info, index, max_seconds, max_frame_pixels)
    return info


def check_limits(info: VideoInfo, index: int, max_seconds: float, max_frame_pixels: int) -> None:
    if info.seconds > max_seconds:
        raise VideoTooLargeError(
            f"video {index}: {info.num_frames} frames at {info.fps:g} fps = {info.seconds:.1f} s exceeds max_video_seconds={max_seconds:g}"
        )
    _check_frame_size(info.width, info.height, max_frame_pixels, index)


def decode(
    data: bytes, indices: Sequence[int], info: VideoInfo, index: int,
    max_decode_seconds: float = DEFAULT_MAX_MEDIA_DECODE_SECONDS,
) -> np.ndarray:
    """The frames at `indices` (within the probed count) as RGB uint8 [T, H, W, 3], in at most
    `max_decode_seconds`. A stream whose packets do not all decode is corrupt: CorruptVideoError."""
    _import_av()
    where = f"video {index}"
    container_format = container_for(data, VIDEO_CONTAINERS, where, "video")
    deadline = DecodeDeadline(max_decode_seconds, where)
    wanted = sorted(set(indices))
    picked: dict[int, np.ndarray] = {}
    with open_media(data, container_format, deadline, CorruptVideoError, "video") as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for position, frame in enumerate(container.decode(stream)):
            deadline.check()
            if position in wanted:
                picked[position] = frame.to_ndarray(format="rgb24")
                if len(picked) == len(wanted):
                    break
    if len(picked) < len(wanted):
        raise CorruptVideoError(
            f"video {index}: frame {wanted[len(picked)]} of its {info.num_frames} could not be decoded (a corrupt stream)"
        )
    shapes = {frame.shape for frame in picked.values()}
    if len(shapes) != 1:
        raise CorruptVideoError(f"video {index}: its frames change size mid-stream ({sorted(shapes)[:2]})")
    return np.stack([picked[i] for i in indices])


def _check_frame_size(width: int, height: int, max_pixels: int, index: int) -> None:
    if width * height == 0:
        raise CorruptVideoError(f"video {index}: its frames are empty ({width}x{height})")
    if width * height > max_pixels:
        raise VideoTooLargeError(
            f"video {index}: frames of {width}x{height} = {width * height} pixels exceed max_image_pixels={max_pixels}"
        )


def _import_av() -> Any:
    return import_av("decoding a video file", " (or give the frames as a list or an array)")
