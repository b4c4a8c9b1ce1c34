"""Triton attention kernels over the paged KV cache.

Conventions shared by every kernel here:
- KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (K at 0, V at 1).
- Attention states are (output [tokens, heads, head_dim], lse [tokens, heads]) with the
  log-sum-exp in natural log of the scaled scores; an empty row has lse = -inf and output 0.
- Kernels use exp2 internally (scores pre-multiplied by log2(e)) and convert at the boundary.
"""
