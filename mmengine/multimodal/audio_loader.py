"""A request's audio clip -> its mm_hash and preprocessed item (the family's features of its waveform),
and the prompt's items (one per clip's placeholder run).

What is known is not done again, as for pictures: encoded bytes seen before have their mm_hash
remembered (no decode), a uuid names the clip (nothing read while its item is cached), and a known
item's features come from the processor cache (no feature extraction). Each key is loaded under its
own lock, so threads that bring one clip at once decode it once. The mm_hash is over the waveform at
the model's rate, so the same sound as WAV, as FLAC or as samples is one encoder-cache entry.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mmengine.core.request import MMItem
from mmengine.encoder_cache.hashing import hash_audio, hash_bytes, hash_user_id
from mmengine.errors import AudioCountMismatchError, AudioTooLongError, InvalidInputError
from mmengine.models.family import EncoderInputs, ModelFamily
from mmengine.multimodal import audio as audio_io
from mmengine.multimodal.media_container import DEFAULT_MAX_MEDIA_DECODE_SECONDS
from mmengine.multimodal.media_loader import MediaLoader
from mmengine.multimodal.processor_cache import ProcessorCache
from mmengine.utils.keyed_lock import KeyedLock

# Samples a resampler may round a clip of exactly the limit's length up by.
_RESAMPLING_SLACK = 2


@dataclass
class LoadedAudio:
    mm_hash: str
    inputs: EncoderInputs
    num_tokens: int


def audio_limits(
    family: ModelFamily, max_audio_seconds: float, max_decode_seconds: float = DEFAULT_MAX_MEDIA_DECODE_SECONDS,
) -> audio_io.AudioLimits:
    """The engine's max_audio_seconds, or the family's own cap where that is lower (a clip is never truncated)."""
    audio_format = family.audio_format
    if audio_format is None or max_audio_seconds <= audio_format.max_seconds:
        return audio_io.AudioLimits(max_audio_seconds, f"max_audio_seconds={max_audio_seconds:g}", max_decode_seconds)
    return audio_io.AudioLimits(audio_format.max_seconds, f"{audio_format.max_seconds:g} s, the most this model takes "
                                                        f"(max_audio_seconds={max_audio_seconds:g} is higher)", max_decode_seconds)


class AudioLoader(MediaLoader[audio_io.AudioLimits]):
    def __init__(
        self, family: ModelFamily, cache: ProcessorCache, cache_lock: threading.Lock, fingerprint: str, settings_key: str,
        limits: audio_io.AudioLimits, hash_algo: str,
    ) -> None:
        super().__init__(family, cache, cache_lock, fingerprint, settings_key, limits, hash_algo)
        self._decoding = KeyedLock()  # by digest of encoded bytes: equal bytes are decoded once
        self._preprocessing = KeyedLock()  # by mm_hash: an item's features are extracted once
        self.num_audios_decoded = 0  # clips decoded or resampled
        self.num_audios_preprocessed = 0  # feature extractions

    @property
    def rate(self) -> int:
        return self.family.audio_format.sampling_rate

    def load(self, audio: audio_io.Audio, index: int) -> LoadedAudio:
        where = audio_io.audio_label(audio, index)
        if audio.uuid is not None:  # a known id reads nothing: the source is read only on a miss
            mm_hash = hash_user_id(audio.uuid, self.fingerprint, self.settings_key, self.hash_algo, modality="audio")
            return self._loaded(mm_hash, lambda: self._waveform(audio, where))
        encoded = audio_io.encoded_audio_bytes(audio, where)
        if encoded is None:
            waveform = self._waveform(audio, where)
            return self._loaded(self._hash(waveform), lambda: waveform)
        digest = "audio:" + hash_bytes(encoded, self.hash_algo)
        with self._decoding.hold(digest):
            with self._cache_lock:
                mm_hash = self.cache.hash_of_encoded(digest)
            if mm_hash is None:
                waveform = self._decode(encoded, where)
                mm_hash = self._hash(waveform)
                with self._cache_lock:
                    self.cache.remember_encoded(digest, mm_hash)
                return self._loaded(mm_hash, lambda: waveform)
        return self._loaded(mm_hash, lambda: self._decode(encoded, where))

    def _hash(self, waveform: np.ndarray) -> str:
        return hash_audio(waveform, self.rate, self.fingerprint, self.settings_key, self.hash_algo)

    def _waveform(self, audio: audio_io.Audio, where: str) -> np.ndarray:
        encoded = audio_io.encoded_audio_bytes(audio, where)
        if encoded is not None:
            return self._decode(encoded, where)
        samples, source_rate = audio_io.given_samples(audio, where, self.limits)
        return self._checked(audio_io.resample(samples, source_rate, self.rate, where), where)

    def _decode(self, encoded: bytes, where: str) -> np.ndarray:
        return self._checked(audio_io.decode(encoded, where, self.rate, self.limits), where)

    def _checked(self, waveform: np.ndarray, where: str) -> np.ndarray:
        """A decoded or resampled waveform within the limit (a sample or two of resampling rounding past an
        exact limit is dropped) that makes at least one token."""
        most = int(self.limits.max_seconds * self.rate)
        if len(waveform) > most + _RESAMPLING_SLACK:
            raise AudioTooLongError(f"{where}: {len(waveform) / self.rate:.2f} s exceeds {self.limits.name}")
        waveform = waveform[:most]
        if self.family.audio_num_tokens(len(waveform)) < 1:
            raise InvalidInputError(f"{where}: {len(waveform) / self.rate * 1000:.1f} ms is too short to make an audio token")
        with self._cache_lock:
            self.num_audios_decoded += 1
        return waveform

    def _loaded(self, mm_hash: str, read: Callable[[], np.ndarray]) -> LoadedAudio:
        """The item's features: cached, else extracted now from the waveform `read()` gives."""
        with self._preprocessing.hold(mm_hash):
            with self._cache_lock:
                inputs = self.cache.get(mm_hash)
            if inputs is None:
                fresh = self.family.audio_item(read())
                with self._cache_lock:
                    self.num_audios_preprocessed += 1
                    inputs = self.cache.put(mm_hash, fresh)
        return LoadedAudio(mm_hash, inputs, self.family.num_tokens(inputs))


def audio_items(token_ids: list[int], starts: list[int], clips: list[LoadedAudio], audio_token_id: int) -> list[MMItem]:
    """One item per clip, at the run starts the expansion recorded; the prompt must hold no audio tokens
    besides them."""
    expected, found = sum(clip.num_tokens for clip in clips), token_ids.count(audio_token_id)
    if found != expected or len(starts) != len(clips):
        raise AudioCountMismatchError(f"the prompt holds {found} audio tokens but its {len(clips)} audio clip(s) need {expected}")
    return [MMItem("audio", clip.mm_hash, start, clip.num_tokens, clip.inputs) for clip, start in zip(clips, starts)]
