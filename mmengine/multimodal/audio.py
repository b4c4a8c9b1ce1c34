"""Audio clips: what a caller gives, what is known before decoding, and the mono waveform a model takes.

A clip is a file path, encoded bytes (WAV, FLAC, MP3, OGG/Opus, MP4/M4A,
Matroska/WebM or AAC), or float samples
with their rate: `Audio(samples, sampling_rate=...)` or vLLM's `(samples, sampling_rate)` tuple.
Files and bytes are decoded with PyAV (the `video` extra), the one place untrusted audio is read. Only
the accepted containers are opened, judged by their magic bytes, and FFmpeg may open nothing else
(media_container.py: UnsupportedContainerError, MediaDecodeTimeoutError). A container that states a
duration over the limit is refused before anything is decoded, and decoding stops as soon as the
samples pass it (AudioTooLongError); unreadable or corrupt data, a stream that ends well before its
stated duration, or samples that decode to NaN or infinity, is a CorruptAudioError naming the clip. Every clip becomes mono
float32 at the model's rate through the same resampler (libswresample), so one sound given as WAV,
FLAC or samples at the same rate gives the same waveform, and so the same content hash.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmengine.errors import AudioTooLongError, CorruptAudioError, InvalidInputError
from mmengine.multimodal.encoded_media import read_encoded, shown_path, stated_seconds
from mmengine.multimodal.image_loading import MAX_ENCODED_FILE_BYTES
from mmengine.multimodal.media_container import (
    AUDIO_CONTAINERS,
    DEFAULT_MAX_MEDIA_DECODE_SECONDS,
    DecodeDeadline,
    container_for,
    decode_errors,
    import_av,
    open_media,
)

# One engine default: Gemma 4's feature extractor takes at most 30 s, which also bounds a clip.
DEFAULT_MAX_AUDIO_SECONDS: float = 30.0
# Source rates outside this range are refused: they bound the samples a decode walks through.
MAX_SOURCE_RATE = 768_000
# A stream that decodes to less than this share of its stated duration is truncated.
_TRUNCATED_SHARE = 0.9
# ... and by more than this: a container's duration counts the codec's priming and padding, which the
# decoder drops (MP3 in Matroska states 0.14 s more than its samples), so a short clip is not called cut.
_TRUNCATED_SLACK_SECONDS = 0.25


@dataclass
class Audio:
    """An audio clip and how to read it. `source`: a path, encoded bytes, or a 1-D float array of mono
    samples in [-1, 1] (numpy or torch), which needs its `sampling_rate` in Hz. `uuid` names the clip
    (equal uuids mean equal clips; nothing is decoded to hash it)."""

    source: Any
    sampling_rate: int | None = None
    uuid: str | None = None

    def check(self, where: str) -> None:
        """Raises InvalidInputError naming the first setting that is not valid."""
        rate = self.sampling_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int) or not 0 < rate <= MAX_SOURCE_RATE):
            raise InvalidInputError(f"{where}: sampling_rate must be an int in (0, {MAX_SOURCE_RATE}], got {rate!r}")
        if self.uuid is not None and not (isinstance(self.uuid, str) and self.uuid):
            raise InvalidInputError(f"{where}: uuid must be a non-empty str, got {self.uuid!r}")


def as_audio(value: object, index: int) -> Audio:
    """An Audio from what a caller gave: an Audio, a (samples, sampling_rate) tuple, a path or bytes."""
    if isinstance(value, Audio):
        audio = value
    elif isinstance(value, tuple) and len(value) == 2 and not isinstance(value[1], (str, bytes)):
        audio = Audio(value[0], value[1])
    else:
        audio = Audio(value)
    audio.check(f"audio {index}")
    return audio


@dataclass(frozen=True)
class AudioLimits:
    """The longest clip taken, in seconds, and the limit to name when one is longer."""

    max_seconds: float
    name: str  # e.g. "max_audio_seconds=30"
    max_decode_seconds: float = DEFAULT_MAX_MEDIA_DECODE_SECONDS

    def check_seconds(self, seconds: float, where: str, what: str = "") -> None:
        if seconds > self.max_seconds:
            raise AudioTooLongError(f"{where}: {what}{seconds:.2f} s exceeds {self.name}")


def audio_label(audio: Audio, index: int) -> str:
    """How errors name a clip: its position in the prompt, and its file where it has one."""
    if isinstance(audio.source, (str, os.PathLike)):
        return f"audio {index} ({shown_path(audio.source)})"
    return f"audio {index}"


def encoded_audio_bytes(audio: Audio, where: str) -> bytes | None:
    """A path's or bytes' content (read, not decoded); None for samples."""
    return read_encoded(audio.source, where, "audio", max_file_bytes=MAX_ENCODED_FILE_BYTES, too_large=AudioTooLongError,
                        corrupt=CorruptAudioError, max_given_bytes=MAX_ENCODED_FILE_BYTES)


def given_samples(audio: Audio, where: str, limits: AudioLimits) -> tuple[np.ndarray, int]:
    """Samples given as an array, as contiguous mono float32 with their rate, checked against the limits."""
    source = audio.source
    if not (isinstance(source, np.ndarray) or type(source).__module__.startswith("torch")):
        raise InvalidInputError(
            f"{where}: expected a path, encoded bytes, or a float array of samples with its sampling rate "
            f"(Audio(samples, sampling_rate=...) or (samples, sampling_rate)), got {type(source).__name__}"
        )
    array = np.asarray(_tensor_as_numpy(source) if hasattr(source, "detach") else source)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.floating) or array.size == 0:
        hint = " (mix the channels down to mono first, e.g. samples.mean(axis=0))" if array.ndim == 2 else ""
        raise InvalidInputError(f"{where}: samples must be a non-empty 1-D float array (mono, in [-1, 1]), got "
                                f"{array.dtype} {list(array.shape)}{hint}")
    if audio.sampling_rate is None:
        raise InvalidInputError(f"{where}: samples need their sampling rate: Audio(samples, sampling_rate=...) "
                                "or (samples, sampling_rate)")
    limits.check_seconds(array.size / audio.sampling_rate, where)
    if not np.isfinite(array).all():
        raise InvalidInputError(f"{where}: the samples hold NaN or infinite values")
    return np.ascontiguousarray(array, dtype=np.float32), audio.sampling_rate


def _tensor_as_numpy(tensor: Any) -> np.ndarray:
    """A torch tensor's values in numpy; floats as float32, since numpy has no bfloat16 or float8."""
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.is_floating_point() else tensor).numpy()


def resample(samples: np.ndarray, source_rate: int, rate: int, where: str) -> np.ndarray:
    """Mono float32 samples at `source_rate` resampled to `rate` (unchanged when the rates agree)."""
    if source_rate == rate:
        return samples
    av = _import_av()
    with decode_errors(where, CorruptAudioError, "audio"):
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
        frame.sample_rate = source_rate
        resampler = _resampler(av, rate)
        return _joined([*resampler.resample(frame), *resampler.resample(None)])


def decode(data: bytes, where: str, rate: int, limits: AudioLimits) -> np.ndarray:
    """The first audio stream of encoded `data` as mono float32 at `rate`. Only the accepted containers
    are opened (media_container.py); a stated duration over the limit is refused before decoding, the
    decode stops once its samples pass the limit, and it may take at most `limits.max_decode_seconds`."""
    av = _import_av()
    container_format = container_for(data, AUDIO_CONTAINERS, where, "audio")
    _check_riff_length(data, where)
    deadline = DecodeDeadline(limits.max_decode_seconds, where)
    with open_media(data, container_format, deadline, CorruptAudioError, "audio") as container:
        if not container.streams.audio:
            raise CorruptAudioError(f"{where}: the data holds no audio stream")
        stream = container.streams.audio[0]
        source_rate = int(stream.codec_context.sample_rate or stream.rate or 0)
        if not 0 < source_rate <= MAX_SOURCE_RATE:
            raise CorruptAudioError(f"{where}: sample rate {source_rate} is not in (0, {MAX_SOURCE_RATE}]")
        stated = stated_seconds(container, stream)
        limits.check_seconds(stated, where, "the container states ")
        most = int(limits.max_seconds * source_rate)
        resampler, frames, count = _resampler(av, rate), [], 0
        for frame in container.decode(stream):
            deadline.check()
            count += frame.samples
            if count > most:
                raise AudioTooLongError(f"{where}: more than {limits.max_seconds:g} s of samples decoded ({limits.name})")
            frames += resampler.resample(frame)
        frames += resampler.resample(None)
    if count == 0:
        raise CorruptAudioError(f"{where}: the stream holds no samples")
    held = count / source_rate
    if stated > 0 and held < _TRUNCATED_SHARE * stated and stated - held > _TRUNCATED_SLACK_SECONDS:
        raise CorruptAudioError(f"{where}: truncated: the container states {stated:.2f} s but holds "
                                f"{held:.2f} s")
    waveform = _joined(frames)
    if not np.isfinite(waveform).all():
        raise CorruptAudioError(f"{where}: the decoded samples hold NaN or infinite values")
    return waveform


_UNKNOWN_RIFF_SIZES = (0, 0xFFFFFFFF)  # written by streaming encoders that never went back to fill them in


def _check_riff_length(data: bytes, where: str) -> None:
    """A WAV file cut short: FFmpeg states its duration from the bytes present, so the header's sizes (the
    RIFF chunk's and the data chunk's) are what tells."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return
    declared = int.from_bytes(data[4:8], "little")
    offset = 12
    while offset + 8 <= len(data):
        chunk, size = data[offset:offset + 4], int.from_bytes(data[offset + 4:offset + 8], "little")
        if chunk == b"data":
            if size not in _UNKNOWN_RIFF_SIZES and offset + 8 + size > len(data):
                raise CorruptAudioError(f"{where}: truncated: the WAV header states {size} bytes of samples but "
                                        f"{len(data) - offset - 8} follow")
            break
        offset += 8 + size + (size & 1)
    if declared not in _UNKNOWN_RIFF_SIZES and declared + 8 > len(data) and offset + 8 > len(data):
        raise CorruptAudioError(f"{where}: truncated: the RIFF header states {declared + 8} bytes but the file has {len(data)}")


def _resampler(av: Any, rate: int) -> Any:
    return av.AudioResampler(format="flt", layout="mono", rate=rate)


def _joined(frames: list[Any]) -> np.ndarray:
    if not frames:
        return np.zeros(0, dtype=np.float32)
    return np.ascontiguousarray(np.concatenate([frame.to_ndarray()[0] for frame in frames]), dtype=np.float32)


def _import_av() -> Any:
    return import_av("decoding or resampling audio", " (or give float samples at the model's rate)")
