"""The runner: scheduler output -> tensors -> vision encoder + decoder -> sampled tokens.

  model_runner.py  ModelRunner: loads the model, sizes the KV cache, runs a step
  inputs.py        persistent host/device input buffers and the step's packed layout
  step_sampling.py a launched step's logits -> tokens: grammar masks, logit bias, penalties, logprobs
  encoder_runs.py  a step's multimodal items through the towers, and their outputs into the embeddings
  kv_memory.py     start-up sizing: the sliding-window pool, a hybrid model's states, the KV blocks
  kv_copies.py     KV blocks between the device cache and the host tier
  cuda_graphs.py   batch-size buckets, capture and replay of decode-only steps
  graph_steps.py   the steps a capture records, and the static tensors they read and write
  state_steps.py   a hybrid model's recurrent states over a step: started, described, saves copied
  cascade_plan.py  whether a step runs cascade attention, and with which groups
  launched_step.py a step queued on the device, its tokens (and a draft head's drafts) read back later
  head_drafter.py  a draft head (MTP, EAGLE-3) drafting within the step that samples, on the device
  follow_drafts.py a step launched before a draft head's step is read: its rows moved on the device
  kv_tensors.py    the KV cache's device tensors, one per layer shape (Gemma 4's sliding and global layers differ)
  spans.py         how far each new token sees on layers that attend both ways inside a picture
  parallel_runner.py  tensor_parallel_size > 1: the driver's runner, one plan a step to the worker processes
  step_plan.py     that plan and rank 0's reply, as plain data
  worker.py        one rank: a ModelRunner over its slice of the model, mirroring the driver's requests
  shared_pixels.py a plan's pictures to the ranks in shared memory
"""

from mmengine.runner.model_runner import ModelRunner

__all__ = ["ModelRunner"]
