"""Which containers request bytes may open (multimodal/media_container.py): the allow-list by magic bytes,
FFmpeg's whitelists, the per-item decode deadline, and hostile bytes (ffconcat, HLS, SDP, `concat:` and
`file:` URLs) that must be typed errors naming the item and never open a file or a socket."""

from __future__ import annotations

import io
import itertools
import socket

import av
import numpy as np
import pytest
import torch

from hostile_media import FileOpenWatch, hostile_payloads, sockets_on
from test_gemma4_audio import RATE, wav_bytes
from mmengine.config import EngineConfig
from mmengine.errors import (
    ConfigError,
    CorruptAudioError,
    CorruptVideoError,
    MediaDecodeTimeoutError,
    UnsupportedContainerError,
)
from mmengine.multimodal import audio as audio_io
from mmengine.multimodal import media_container
from mmengine.multimodal import video as video_io
from mmengine.multimodal.media_container import (
    AUDIO_CONTAINERS,
    VIDEO_CONTAINERS,
    ContainerFormat,
    DecodeDeadline,
    open_media,
    sniff_container,
)

LIMITS = audio_io.AudioLimits(30.0, "max_audio_seconds=30")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1] & ~1  # RTP takes an even port, RTCP the next


def tone(seconds: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def float_wav_bytes(samples: np.ndarray) -> bytes:
    return encode_audio("wav", "pcm_f32le", samples)


def encode_audio(muxer: str, codec: str, samples: np.ndarray, rate: int = RATE) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=muxer) as container:
        stream = container.add_stream(codec, rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="fltp", layout="mono")
        frame.sample_rate = RATE
        resampler = av.AudioResampler(format=stream.codec_context.format, layout="mono", rate=rate)
        for part in [*resampler.resample(frame), *resampler.resample(None)]:
            container.mux(stream.encode(part))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def encode_video(muxer: str, codec: str = "mpeg4", frames: int = 8) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=muxer) as container:
        stream = container.add_stream(codec, rate=4)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(frames):
            picture = np.full((32, 32, 3), 15 * i, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        container.mux(stream.encode(None))
    return buffer.getvalue()


AUDIO_SAMPLES = {  # name: (muxer, codec, the container it must be sniffed as)
    "wav": ("wav", "pcm_s16le", media_container.WAV),
    "flac": ("flac", "flac", media_container.FLAC),
    "mp3": ("mp3", "libmp3lame", media_container.MP3),
    "ogg-opus": ("ogg", "libopus", media_container.OGG),
    "m4a": ("ipod", "aac", media_container.MP4),
    "adts-aac": ("adts", "aac", media_container.AAC),
    "webm-opus": ("webm", "libopus", media_container.MATROSKA),
    "mkv-mp3": ("matroska", "libmp3lame", media_container.MATROSKA),
}
VIDEO_SAMPLES = {
    "mp4": ("mp4", "mpeg4", media_container.MP4),
    "mov": ("mov", "mpeg4", media_container.MP4),
    "webm": ("webm", "libvpx-vp9", media_container.MATROSKA),
    "mkv": ("matroska", "mpeg4", media_container.MATROSKA),
    "mpegts": ("mpegts", "mpeg4", media_container.MPEG_TS),
    "avi": ("avi", "mpeg4", media_container.AVI),
}


@pytest.mark.parametrize("name", sorted(AUDIO_SAMPLES))
def test_every_accepted_audio_container_is_recognised_and_decodes(name):
    muxer, codec, container = AUDIO_SAMPLES[name]
    rate = 48_000 if codec == "libopus" else RATE
    data = encode_audio(muxer, codec, tone(), rate)
    assert sniff_container(data) == container and container in AUDIO_CONTAINERS
    waveform = audio_io.decode(data, "audio 0", RATE, LIMITS)
    assert abs(len(waveform) - RATE // 2) < RATE // 10  # half a second, give or take a codec's padding


def test_mp3_without_an_id3_tag_and_flac_behind_one_are_recognised():
    mp3 = encode_audio("mp3", "libmp3lame", tone())
    tag_length = media_container._id3_length(mp3)
    assert tag_length > 0 and sniff_container(mp3[tag_length:]) == media_container.MP3
    assert len(audio_io.decode(mp3[tag_length:], "audio 0", RATE, LIMITS)) > RATE // 4
    flac = encode_audio("flac", "flac", tone())
    tagged = b"ID3\x04\x00\x00\x00\x00\x00\x05" + bytes(5) + flac
    assert sniff_container(tagged) == media_container.FLAC


@pytest.mark.parametrize("name", sorted(VIDEO_SAMPLES))
def test_every_accepted_video_container_is_recognised_and_decodes(name):
    muxer, codec, container = VIDEO_SAMPLES[name]
    data = encode_video(muxer, codec)
    assert sniff_container(data) == container and container in VIDEO_CONTAINERS
    info = video_io.probe(data, 0, 60, 10**6)
    assert info.num_frames == 8
    assert video_io.decode(data, [0, 7], info, 0).shape == (2, 32, 32, 3)


def test_a_container_of_the_other_kind_is_refused_by_name():
    with pytest.raises(UnsupportedContainerError, match=r"^video 0: .*accepted video container .*: WAV, not accepted for video"):
        video_io.probe(wav_bytes(tone()), 0, 60, 10**6)
    with pytest.raises(UnsupportedContainerError, match=r"^audio 0: .*accepted audio container .*: AVI, not accepted for audio"):
        audio_io.decode(encode_video("avi"), "audio 0", RATE, LIMITS)


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A real WAV and MP4 where the hostile bytes point (the working directory), watched for opens."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.wav").write_bytes(wav_bytes(tone()))
    (tmp_path / "secret.mp4").write_bytes(encode_video("mp4"))
    watches = [FileOpenWatch(tmp_path / name) for name in ("secret.wav", "secret.mp4")]
    yield watches
    for watch in watches:
        watch.close()


def test_unguarded_ffmpeg_does_open_the_planted_file(planted):
    """The watch sees what the guard prevents: plain av.open of the ffconcat bytes reads the planted file."""
    with av.open(io.BytesIO(hostile_payloads("secret.wav", 0)["ffconcat"])) as container:
        assert len(list(container.decode(audio=0))) > 0
    assert planted[0].events() > 0 or not planted[0].supported


@pytest.mark.parametrize("name", sorted(hostile_payloads("x", 0)))
@pytest.mark.parametrize("kind", ["audio", "video"])
def test_hostile_bytes_are_refused_by_name_and_open_nothing(planted, name, kind):
    port = _free_port()
    target = "secret.wav" if kind == "audio" else "secret.mp4"
    data = hostile_payloads(target, port)[name]
    with pytest.raises(UnsupportedContainerError, match=rf"^{kind} 0: the data is not an accepted {kind} container") as caught:
        if kind == "audio":
            audio_io.decode(data, "audio 0", RATE, LIMITS)
        else:
            video_io.probe(data, 0, 60, 10**6)
    assert [watch.events() for watch in planted] == [0, 0]
    assert sockets_on({port, port + 1}) == []
    # the answer is the same whether or not the named file exists: no oracle for the server's files
    missing = hostile_payloads("missing" + target, port)[name]
    with pytest.raises(UnsupportedContainerError) as caught_missing:
        if kind == "audio":
            audio_io.decode(missing, "audio 0", RATE, LIMITS)
        else:
            video_io.probe(missing, 0, 60, 10**6)
    assert str(caught.value).split(": it begins")[0] == str(caught_missing.value).split(": it begins")[0]


@pytest.mark.parametrize("demuxer", ["concat", "hls", "sdp"])
def test_ffmpeg_opens_nothing_else_even_with_a_dangerous_demuxer_forced(planted, demuxer):
    """The second wall, should the allow-list ever admit a bad demuxer: the options every open carries
    (no protocol whitelisted) keep it from reaching the planted file or a socket."""
    port = _free_port()
    payload = {"concat": "ffconcat", "hls": "hls", "sdp": "sdp"}[demuxer]
    data = hostile_payloads("secret.wav", port)[payload]
    with pytest.raises(CorruptAudioError, match="^audio 0: cannot decode the audio"):
        with open_media(data, ContainerFormat(demuxer, demuxer), DecodeDeadline(30, "audio 0"), CorruptAudioError, "audio") as opened:
            list(opened.decode(audio=0))
    assert [watch.events() for watch in planted] == [0, 0]
    assert sockets_on({port, port + 1}) == []


def test_a_decode_past_its_deadline_is_a_typed_error_naming_the_item(monkeypatch):
    """A clock that moves a second a look: the deadline passes mid-decode, between frames."""
    ticks = itertools.count()
    monkeypatch.setattr(media_container.time, "monotonic", lambda: float(next(ticks)))
    slow = audio_io.AudioLimits(30.0, "max_audio_seconds=30", max_decode_seconds=6)
    with pytest.raises(MediaDecodeTimeoutError, match=r"^audio 0: decoding took longer than max_media_decode_seconds=6$"):
        audio_io.decode(wav_bytes(tone(2.0)), "audio 0", RATE, slow)
    ticks = itertools.count()
    with pytest.raises(MediaDecodeTimeoutError, match=r"^video 0: decoding took longer than max_media_decode_seconds=5$"):
        video_io.probe(encode_video("mp4", frames=16), 0, 60, 10**6, max_decode_seconds=5)
    with pytest.raises(MediaDecodeTimeoutError, match="^video 0: "):
        with open_media(b"", media_container.MP4, DecodeDeadline(0, "video 0"), CorruptVideoError, "video"):
            pass


def test_max_media_decode_seconds_is_validated_and_has_a_flag():
    with pytest.raises(ConfigError, match="max_media_decode_seconds"):
        EngineConfig(model="x", max_media_decode_seconds=0)
    import argparse

    from mmengine.entrypoints.engine_flags import add_engine_options

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert parser.parse_args(["--max-media-decode-seconds", "7.5"]).max_media_decode_seconds == 7.5


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_float_wav_that_decodes_to_nan_or_infinity_is_refused(bad):
    samples = tone()
    samples[100] = bad
    with pytest.raises(CorruptAudioError, match="^audio 0: the decoded samples hold NaN or infinite values"):
        audio_io.decode(float_wav_bytes(samples), "audio 0", RATE, LIMITS)


def test_bfloat16_and_float16_tensors_of_samples_are_taken():
    samples = tone()
    as_bf16 = torch.from_numpy(samples).to(torch.bfloat16)
    taken, rate = audio_io.given_samples(audio_io.Audio(as_bf16, sampling_rate=RATE), "audio 0", LIMITS)
    assert rate == RATE and taken.dtype == np.float32
    np.testing.assert_array_equal(taken, as_bf16.float().numpy())
    taken16, _ = audio_io.given_samples(audio_io.Audio(torch.from_numpy(samples).half(), sampling_rate=RATE), "audio 0", LIMITS)
    np.testing.assert_allclose(taken16, samples, atol=1e-3)
