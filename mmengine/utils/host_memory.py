"""How much host memory is free, so a CPU KV cache that cannot fit is refused before it is allocated."""

from __future__ import annotations

import os

from mmengine.errors import ConfigError

_GIB = 1 << 30


def available_host_memory() -> int | None:
    """Bytes of memory the kernel reports available (MemAvailable), or free pages; None if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_cpu_kv_cache_fits(num_blocks: int, bytes_per_block: int, explicit: bool) -> None:
    """Raises ConfigError if num_blocks KV blocks (with their encoder-cache share) exceed available memory."""
    needed = num_blocks * bytes_per_block
    available = available_host_memory()
    if available is None or needed <= available:
        return
    source = f"num_kv_blocks={num_blocks}" if explicit else f"{num_blocks} KV blocks (from cpu_kv_cache_bytes)"
    raise ConfigError(
        f"{source} needs {needed / _GIB:.1f} GiB of host memory ({bytes_per_block} bytes per block) but only "
        f"{available / _GIB:.1f} GiB is available; lower num_kv_blocks or cpu_kv_cache_bytes"
    )
