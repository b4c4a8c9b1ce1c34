"""Hostile audio/video bytes (each makes an unguarded FFmpeg open another input: a local file or a socket),
and the watches that prove nothing was opened: inotify on a planted file, the process's UDP sockets."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import psutil

_IN_ACCESS, _IN_OPEN = 0x1, 0x20


def sdp(port: int) -> bytes:
    """A session description: FFmpeg binds RTP/RTCP ports and waits for packets."""
    return (b"v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=x\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
            + f"m=audio {port} RTP/AVP 0\r\n".encode())


def hostile_payloads(name: str, port: int) -> dict[str, bytes]:
    """Bytes that point FFmpeg at `name` (a file relative to the working directory) or at `port`."""
    raw = name.encode()
    return {
        "ffconcat": b"ffconcat version 1.0\nfile " + raw + b"\n",
        "ffconcat-concat-protocol": b"ffconcat version 1.0\nfile 'concat:" + raw + b"|" + raw + b"'\n",
        "hls": b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\n" + raw + b"\n#EXT-X-ENDLIST\n",
        "hls-concat-protocol": b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nconcat:" + raw + b"|" + raw + b"\n#EXT-X-ENDLIST\n",
        "hls-file-protocol": b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nfile:" + raw + b"\n#EXT-X-ENDLIST\n",
        "sdp": sdp(port),
    }


class FileOpenWatch:
    """Counts opens and reads of one file by anything in this process, FFmpeg's C code included (inotify).
    `supported` is False where there is no inotify (not Linux): then `events()` cannot tell."""

    def __init__(self, path: Path) -> None:
        self.supported = sys.platform.startswith("linux")
        self._fd = -1
        if self.supported:
            libc = ctypes.CDLL(None, use_errno=True)
            self._fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if self._fd < 0 or libc.inotify_add_watch(self._fd, os.fsencode(path), _IN_OPEN | _IN_ACCESS) < 0:
                raise OSError(ctypes.get_errno(), f"cannot watch {path}")

    def events(self) -> int:
        """Opens and reads seen since the last call (each inotify event is 16 bytes with no name)."""
        if not self.supported:
            return 0
        seen = 0
        while True:
            try:
                seen += len(os.read(self._fd, 4096)) // 16
            except BlockingIOError:
                return seen

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "FileOpenWatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sockets_on(ports: set[int]) -> list:
    """This process's sockets bound to any of `ports`."""
    return [conn for conn in psutil.Process().net_connections(kind="inet") if conn.laddr and conn.laddr.port in ports]
