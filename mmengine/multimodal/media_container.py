"""Encoded audio and video: which FFmpeg demuxer may read request bytes, and how it opens them.

FFmpeg picks a demuxer by probing the data, and some demuxers open other inputs the data names:
ffconcat lists local files, SDP binds sockets and waits for packets, HLS playlists fetch segments,
`concat:` and `file:` URLs read files. Bytes a client sent must reach none of them. So, as pictures go
through an allow-list of Pillow formats (`image_loading.py`), a container is chosen here from its magic
bytes against an allow-list, and FFmpeg opens it with that demuxer forced, that demuxer alone allowed
(`format_whitelist`), and no protocol at all (`protocol_whitelist`: the bytes come through PyAV's own
I/O, so nothing else can be opened: no file, no socket, no nested input). Each item's demuxing and
decoding is bounded in wall time (`DecodeDeadline`), inside FFmpeg's calls as well as between them.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mmengine.errors import InvalidInputError, MediaDecodeTimeoutError, UnsupportedContainerError

# One engine default (EngineConfig.max_media_decode_seconds): the wall time one clip's or video's
# probing and decoding may take, far above a legitimate item's on any machine that serves it.
DEFAULT_MAX_MEDIA_DECODE_SECONDS: float = 120.0

_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot")
_TS_PACKET = 188
_SHOWN_BYTES = 16


@dataclass(frozen=True)
class ContainerFormat:
    name: str  # as errors and the docs call it
    demuxer: str  # FFmpeg's input format, forced when the data is opened


WAV = ContainerFormat("WAV", "wav")
FLAC = ContainerFormat("FLAC", "flac")
MP3 = ContainerFormat("MP3", "mp3")
OGG = ContainerFormat("OGG/Opus", "ogg")
AAC = ContainerFormat("AAC (ADTS)", "aac")
MP4 = ContainerFormat("MP4/MOV/M4A", "mov")
MATROSKA = ContainerFormat("Matroska/WebM", "matroska")
MPEG_TS = ContainerFormat("MPEG-TS", "mpegts")
AVI = ContainerFormat("AVI", "avi")

AUDIO_CONTAINERS: tuple[ContainerFormat, ...] = (WAV, FLAC, MP3, OGG, MP4, MATROSKA, AAC)
VIDEO_CONTAINERS: tuple[ContainerFormat, ...] = (MP4, MATROSKA, MPEG_TS, AVI)

# Given to every open: FFmpeg's whitelists are inherited by any input a demuxer would open, and the
# protocol list names none that exists. MP4's external data references stay off whatever the default.
_OPEN_OPTIONS: dict[str, str] = {"protocol_whitelist": "none", "enable_drefs": "0"}


def sniff_container(data: bytes) -> ContainerFormat | None:
    """The container `data` is, by its magic bytes; None for anything not on the allow-lists."""
    if data[:4] in (b"RIFF", b"RF64") and data[8:12] == b"WAVE":
        return WAV
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return AVI
    if data[:4] == b"fLaC":
        return FLAC
    if data[:4] == b"OggS":
        return OGG
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return MATROSKA
    if data[4:8] in _MP4_BOXES:
        return MP4
    if data[:1] == b"\x47" and all(data[i:i + 1] == b"\x47" for i in (_TS_PACKET, 2 * _TS_PACKET) if i < len(data)):
        return MPEG_TS
    return _sniff_elementary(data[_id3_length(data):])


def _id3_length(data: bytes) -> int:
    """Bytes of an ID3v2 tag at the start (MP3, AAC and FLAC files may carry one), 0 if there is none."""
    if len(data) < 10 or data[:3] != b"ID3" or any(byte & 0x80 for byte in data[6:10]):
        return 0
    size = (data[6] << 21) | (data[7] << 14) | (data[8] << 7) | data[9]  # synchsafe: 7 bits a byte
    footer = 10 if data[5] & 0x10 else 0
    return 10 + size + footer


def _sniff_elementary(data: bytes) -> ContainerFormat | None:
    """A raw stream's format from its first frame header: FLAC, ADTS AAC, or MPEG audio (MP3)."""
    if data[:4] == b"fLaC":
        return FLAC
    if len(data) < 2 or data[0] != 0xFF:
        return None
    if data[1] & 0xF6 == 0xF0:  # ADTS: 12 sync bits, layer 00
        return AAC
    if data[1] & 0xE0 == 0xE0 and data[1] & 0x06:  # MPEG audio: 11 sync bits, a layer
        return MP3
    return None


def container_for(data: bytes, allowed: tuple[ContainerFormat, ...], where: str, what: str) -> ContainerFormat:
    """The allowed container `data` is, else UnsupportedContainerError naming the item and what it starts with."""
    found = sniff_container(data)
    if found is None or found not in allowed:
        names = ", ".join(container.name for container in allowed)
        seen = f"{found.name}, not accepted for {what}" if found is not None else f"it begins {data[:_SHOWN_BYTES]!r}"
        raise UnsupportedContainerError(f"{where}: the data is not an accepted {what} container ({names}): {seen}")
    return found


class DecodeDeadline:
    """The wall time one item's probing and decoding may take, across every open of its data."""

    def __init__(self, seconds: float, where: str) -> None:
        self.seconds = seconds
        self.where = where
        self._ends = time.monotonic() + seconds

    @property
    def remaining(self) -> float:
        return self._ends - time.monotonic()

    @property
    def expired(self) -> bool:
        return self.remaining <= 0

    def check(self) -> None:
        if self.expired:
            raise self.error()

    def error(self) -> MediaDecodeTimeoutError:
        return MediaDecodeTimeoutError(
            f"{self.where}: decoding took longer than max_media_decode_seconds={self.seconds:g}"
        )


@contextlib.contextmanager
def open_media(
    data: bytes, container: ContainerFormat, deadline: DecodeDeadline, corrupt: type[InvalidInputError], what: str,
) -> Iterator[Any]:
    """`data` opened as `container` and nothing else. Any failure inside the block is a typed error naming
    the item: past the deadline MediaDecodeTimeoutError (FFmpeg's own blocking calls are interrupted then
    too), else `corrupt` with FFmpeg's reason; the caller's own typed errors pass through."""
    av = import_av(f"decoding {what} data")
    with decode_errors(deadline.where, corrupt, what, deadline):
        deadline.check()
        # PyAV interrupts an open or a read that blocks past its timeout; the loops check the deadline too
        timeout = max(deadline.remaining, 0.001)
        options = dict(_OPEN_OPTIONS, format_whitelist=container.demuxer)
        with av.open(io.BytesIO(data), mode="r", format=container.demuxer, options=options,
                     timeout=(timeout, timeout)) as opened:
            yield opened


@contextlib.contextmanager
def decode_errors(
    where: str, corrupt: type[InvalidInputError], what: str, deadline: DecodeDeadline | None = None,
) -> Iterator[None]:
    """PyAV's and FFmpeg's exceptions as typed errors naming the item (`where`)."""
    try:
        yield
    except (InvalidInputError, MemoryError):
        raise
    except Exception as exc:  # av.FFmpegError and its subclasses, and whatever a broken container raises
        if deadline is not None and deadline.expired:
            raise deadline.error() from exc
        raise corrupt(f"{where}: cannot decode the {what}: {type(exc).__name__}: {exc}") from exc


def import_av(need: str, instead: str = "") -> Any:
    """PyAV, or an InvalidInputError saying what needed it and how to do without (`instead`)."""
    try:
        import av
    except ImportError as err:
        raise InvalidInputError(f"{need} needs PyAV: pip install 'mmengine-vlm[video]'{instead}") from err
    return av
