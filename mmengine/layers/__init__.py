"""The decoder's layers (they call kernels/, never the reverse).

  attention.py           per-step AttentionMetadata, the backend protocol, the Attention layer
  attention_backends.py  which backend a device gets: Triton on CUDA, the PyTorch reference elsewhere
  torch_attention.py     the reference backend in plain PyTorch (the CPU path)
  triton_attention.py    the Triton backend behind the same interface
  cascade.py             the shared-prefix (cascade) layout both backends read
  split_kv.py            how many slices a split-KV pass cuts each context into
  kernel_dispatch.py     whether the Triton kernels can run here; fused small ops or their references
  rotary.py norm.py activation.py   rotary tables, RMSNorm, the gated MLP activation
  lora.py                LoRA on the projections: a per-row low-rank delta from device slots
  gated_delta.py         Gated DeltaNet (Qwen3.5's linear attention) over state slots, with checkpoint saves
  gated_delta_rule.py    the gated delta rule: recurrent, chunked, batched decode; fla-core's kernels on CUDA
  moe.py                 mixture-of-experts MLPs: the top-k router, fused expert weights, a gated shared expert
  quantized_linear.py    projections kept in 4 or 8 bits, through the W4A16 and FP8 GEMMs
  fp8_dispatch.py        whether an FP8 projection's call runs W8A16 (Triton) or W8A8 (torch._scaled_mm)
"""
