"""Triton kernels: plain tensors and numbers in; they never import layers/ or models/.

  prefill_attention.py decode_attention.py cascade_attention.py merge_states.py online_softmax.py
                       attention over the paged KV cache (varlen prefill, split-KV decode, shared prefix)
  kv_store.py rotary.py rms_norm.py activation.py   the decoder's fused small ops
  lora.py              the segmented LoRA matmul
  fused_moe.py         mixture-of-experts MLPs: pairs sorted by expert, two grouped GEMMs, no host sync
  w4a16.py fp8_gemm.py the W4A16 and FP8-weight GEMMs: 4- and 8-bit weights dequantized in registers
  weight_gemm.py       what those GEMMs share: output tile, activation loads, the store, the launch
  w8a8.py              the W8A8 FP8 GEMM: activations quantized per token, torch._scaled_mm (no Triton)
  kv_quant.py          writing K/V into an FP8 cache (the rounding every backend shares)
  e4m3.py              e4m3 as bytes where Triton has no e4m3 type (before sm_89): exact decode and encode
  tiling.py checks.py common.py   tile shapes layouts must match, host-side argument checks, launch helpers
  cross_compile.py     compiles every kernel for sm_80/sm_90 without a GPU and reports its resources

Conventions shared by every kernel here:
- KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (K at 0, V at 1).
- Attention states are (output [tokens, heads, head_dim], lse [tokens, heads]) with the
  log-sum-exp in natural log of the scaled scores; an empty row has lse = -inf and output 0.
- Kernels use exp2 internally (scores pre-multiplied by log2(e)) and convert at the boundary.
"""
