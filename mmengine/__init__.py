"""mmengine: a multimodal LLM inference engine that never does the same work twice.

The public names are imported on first use, so `import mmengine.errors` (and `mmengine --help`)
stays light: torch and transformers load only when the engine is actually needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmengine.utils.lazy_exports import lazy_exports

__all__ = ["AsyncMMEngine", "BeamSearchParams", "EngineConfig", "LoRARequest", "MMEngine", "RequestOutput", "SamplingParams", "StructuredOutputParams"]
__version__ = "0.1.0"

_EXPORTS = {
    "AsyncMMEngine": "mmengine.engine.async_engine",
    "BeamSearchParams": "mmengine.engine.beam_search",
    "EngineConfig": "mmengine.config",
    "LoRARequest": "mmengine.lora.request",
    "MMEngine": "mmengine.engine.mm_engine",
    "RequestOutput": "mmengine.outputs",
    "SamplingParams": "mmengine.sample.params",
    "StructuredOutputParams": "mmengine.sample.structured_output.params",
}

if TYPE_CHECKING:
    from mmengine.engine.async_engine import AsyncMMEngine
    from mmengine.engine.beam_search import BeamSearchParams
    from mmengine.config import EngineConfig
    from mmengine.lora.request import LoRARequest
    from mmengine.engine.mm_engine import MMEngine
    from mmengine.outputs import RequestOutput
    from mmengine.sample.params import SamplingParams
    from mmengine.sample.structured_output.params import StructuredOutputParams


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
