"""The runner: scheduler output -> tensors -> vision encoder + decoder -> sampled tokens.

  model_runner.py  ModelRunner: loads the model, sizes the KV cache, runs a step
  inputs.py        persistent host/device input buffers and the step's packed layout
  cuda_graphs.py   batch-size buckets, capture and replay of decode-only steps
"""

from mmengine.runner.model_runner import ModelRunner

__all__ = ["ModelRunner"]
