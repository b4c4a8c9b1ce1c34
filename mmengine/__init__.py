"""mmengine: a multimodal LLM inference engine that never does the same work twice."""

from mmengine.config import EngineConfig
from mmengine.engine import MMEngine
from mmengine.outputs import RequestOutput
from mmengine.sampling import SamplingParams

__all__ = ["EngineConfig", "MMEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
