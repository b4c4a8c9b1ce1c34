"""The on-disk cache of built test checkpoints: one directory per (spec, builder version, transformers
version), built in a temporary directory and renamed into place."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable
from typing import Any


def default_cache_dir() -> pathlib.Path:
    """$MMENGINE_CACHE_DIR, or ~/.cache/mmengine/tiny-models."""
    return pathlib.Path(
        os.environ.get("MMENGINE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "mmengine" / "tiny-models"
    )


def spec_key(spec: object, builder_version: int) -> str:
    """A stable hash of a dataclass spec, the builder version and the transformers version."""
    import transformers

    payload = {"spec": dataclasses.asdict(spec), "builder": builder_version, "transformers": transformers.__version__}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def cached_build(
    name: str, build: Callable[[pathlib.Path], object], cache_dir: str | os.PathLike | None = None
) -> pathlib.Path:
    """`cache_dir / name`, calling `build(directory)` on first use (`cache_dir` None: default_cache_dir()).

    The checkpoint is built in a temporary directory and renamed into place, so concurrent callers never
    see a partial build; when another builder wins the race its directory is kept and ours discarded.
    """
    cache_dir = default_cache_dir() if cache_dir is None else pathlib.Path(cache_dir)
    final = cache_dir / name
    if final.is_dir():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache_dir))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the finished cache entry should not be
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # a real failure, not a lost race against another builder
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def cached_spec_build(
    family: str, spec: Any, builder_version: int, build: Callable[[pathlib.Path, Any], object],
    cache_dir: str | os.PathLike | None = None,
) -> pathlib.Path:
    """The path of `family`'s cached tiny checkpoint of the dataclass `spec`, `build(directory, spec)` on first use:
    `cache_dir / "<family>-<spec_key>"` (cached_build; `cache_dir` None: default_cache_dir())."""
    return cached_build(f"{family}-{spec_key(spec, builder_version)}", lambda path: build(path, spec), cache_dir)
