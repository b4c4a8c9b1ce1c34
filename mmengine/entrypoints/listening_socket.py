"""The server's listening socket, bound before the model loads (as vLLM does): a port already taken is a typed
error in a second, not after minutes of loading weights, and the port is held from then on."""

from __future__ import annotations

import socket

from mmengine.errors import ConfigError


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (port 0: one the kernel picks); ConfigError naming the address and why
    (in use, no such address, a privileged port)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be 0-65535 (0: any free port), got {port}")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET  # "::" as uvicorn takes it
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as err:
        why = err.strerror or str(err)
        raise ConfigError(f"cannot listen on {host}:{port} (--host, --port): {why}") from None
