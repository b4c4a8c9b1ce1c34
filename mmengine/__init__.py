"""mmengine: a multimodal LLM inference engine that never does the same work twice.

The public names are imported on first use, so `import mmengine.errors` (and `mmengine --help`)
stays light: torch and transformers load only when the engine is actually needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmengine.lazy_exports import lazy_exports

__all__ = ["BeamSearchParams", "EngineConfig", "LoRARequest", "MMEngine", "RequestOutput", "SamplingParams", "StructuredOutputParams"]
__version__ = "0.1.0"

_EXPORTS = {
    "BeamSearchParams": "mmengine.beam_search",
    "EngineConfig": "mmengine.config",
    "LoRARequest": "mmengine.lora.request",
    "MMEngine": "mmengine.engine",
    "RequestOutput": "mmengine.outputs",
    "SamplingParams": "mmengine.sampling",
    "StructuredOutputParams": "mmengine.structured_output.params",
}

if TYPE_CHECKING:
    from mmengine.beam_search import BeamSearchParams
    from mmengine.config import EngineConfig
    from mmengine.lora.request import LoRARequest
    from mmengine.engine import MMEngine
    from mmengine.outputs import RequestOutput
    from mmengine.sampling import SamplingParams
    from mmengine.structured_output.params import StructuredOutputParams


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
