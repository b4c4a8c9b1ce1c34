"""mmengine: a multimodal LLM inference engine that never does the same work twice.

The public names are imported on first use, so `import mmengine.errors` (and `mmengine --help`)
stays light: torch and transformers load only when the engine is actually needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["EngineConfig", "MMEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_EXPORTS = {
    "EngineConfig": "mmengine.config",
    "MMEngine": "mmengine.engine",
    "RequestOutput": "mmengine.outputs",
    "SamplingParams": "mmengine.sampling",
}

if TYPE_CHECKING:
    from mmengine.config import EngineConfig
    from mmengine.engine import MMEngine
    from mmengine.outputs import RequestOutput
    from mmengine.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mmengine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
