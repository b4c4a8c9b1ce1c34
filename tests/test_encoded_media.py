"""Encoded audio and video as given (multimodal/encoded_media.py, through audio.py's and video.py's readers):
the modality's typed error naming the item for a file over its limit, audio bytes over theirs, empty data
and an unreadable file; other sources are not encoded bytes."""

from __future__ import annotations

import numpy as np
import pytest

from mmengine.errors import AudioTooLongError, CorruptAudioError, CorruptVideoError, VideoTooLargeError
from mmengine.multimodal import audio as audio_io
from mmengine.multimodal import video as video_io
from mmengine.multimodal.encoded_media import shown_path


def _audio_bytes(source: object, index: int = 0) -> bytes | None:
    audio = audio_io.Audio(source)
    return audio_io.encoded_audio_bytes(audio, audio_io.audio_label(audio, index))


def test_a_file_over_the_limit_is_the_modalitys_too_large_error(tmp_path, monkeypatch):
    monkeypatch.setattr(audio_io, "MAX_ENCODED_FILE_BYTES", 8)
    monkeypatch.setattr(video_io, "MAX_ENCODED_FILE_BYTES", 1)  # a video file may be 16 times the limit
    at_audio_limit, over_audio_limit = tmp_path / "fits.wav", tmp_path / "clip.wav"
    at_audio_limit.write_bytes(b"x" * 8)
    over_audio_limit.write_bytes(b"x" * 9)
    assert _audio_bytes(str(at_audio_limit)) == b"x" * 8
    with pytest.raises(AudioTooLongError, match=r"^audio 0 \(.*clip\.wav\): the file is larger than 8 bytes$"):
        _audio_bytes(str(over_audio_limit))
    at_video_limit, over_video_limit = tmp_path / "fits.mp4", tmp_path / "movie.mp4"
    at_video_limit.write_bytes(b"v" * 16)
    over_video_limit.write_bytes(b"v" * 17)
    assert video_io.encoded_video_bytes(video_io.Video(at_video_limit), 0) == b"v" * 16
    with pytest.raises(VideoTooLargeError, match=r"^video 3: .*movie\.mp4 is larger than 16 bytes$"):
        video_io.encoded_video_bytes(video_io.Video(over_video_limit), 3)


def test_given_audio_bytes_over_the_limit_are_too_long(monkeypatch):
    monkeypatch.setattr(audio_io, "MAX_ENCODED_FILE_BYTES", 8)
    assert _audio_bytes(bytearray(b"a" * 8)) == b"a" * 8
    with pytest.raises(AudioTooLongError, match=r"^audio 2: the audio bytes are larger than 8 bytes$"):
        _audio_bytes(b"a" * 9, index=2)


def test_empty_data_and_unreadable_files_are_corrupt_naming_the_item(tmp_path):
    with pytest.raises(CorruptAudioError, match=r"^audio 1: the audio bytes are empty$"):
        _audio_bytes(b"", index=1)
    with pytest.raises(CorruptVideoError, match=r"^video 2: the video bytes are empty$"):
        video_io.encoded_video_bytes(video_io.Video(memoryview(b"")), 2)
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(CorruptAudioError, match=r"^audio 0 \(.*empty\.wav\): the audio bytes are empty$"):
        _audio_bytes(empty)
    with pytest.raises(CorruptAudioError, match=r"^audio 0 \(.*missing\.wav\): cannot read the file: "):
        _audio_bytes(str(tmp_path / "missing.wav"))
    with pytest.raises(CorruptVideoError, match=r"^video 1: cannot read .*missing\.mp4: "):
        video_io.encoded_video_bytes(video_io.Video(str(tmp_path / "missing.mp4")), 1)
    with pytest.raises(CorruptVideoError, match=r"^video 0: cannot read "):
        video_io.encoded_video_bytes(video_io.Video(str(tmp_path / "nul\x00.mp4")), 0)


def test_samples_and_frames_are_not_encoded_bytes():
    assert audio_io.encoded_audio_bytes(audio_io.Audio(np.zeros(4, dtype=np.float32), 16000), "audio 0") is None
    assert video_io.encoded_video_bytes(video_io.Video(np.zeros((1, 2, 2, 3), dtype=np.uint8)), 0) is None


def test_long_paths_are_shortened_in_messages():
    assert shown_path("short.wav") == "short.wav"
    shown = shown_path("p" * 500)
    assert len(shown) == 200 and shown.endswith("...") and shown.startswith("p" * 197)
