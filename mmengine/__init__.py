"""mmengine: a multimodal LLM inference engine."""
