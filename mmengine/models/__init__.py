"""Model families: everything outside models/ asks a ModelFamily, never a model's config.

  family.py      the ModelFamily interface (tokens per item, the largest item, positions, encoder inputs)
  registry.py    which architectures mmengine runs, and how to build them
  config_import.py  transformers' config code imported without its activations (and model loading)
  text_config.py the text config's facts (head size, sliding window) that families and decoders both read
  loader.py      safetensors tensors, sharded or not, checked strictly; per-expert MoE tensors stacked
  quantization.py  a checkpoint's quantization_config: FP8 (block, per channel) dequantized at load
  vlm.py         what every VLM shares: a decoder, an LM head, the vision side
  llama.py       the Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache
  llava.py       LLaVA-1.5
  qwen_vl.py     Qwen2-VL and Qwen2.5-VL (native resolution, M-RoPE)
  qwen3_vl.py    Qwen3-VL (dense; DeepStack)
  qwen3_5.py     Qwen3.5 (dense): a hybrid decoder (Gated DeltaNet + gated attention) under Qwen3-VL's tower
  qwen_resize.py Qwen's resize rule and the largest item it makes (images and videos)
  qwen_video.py  Qwen's video rules, as transformers' video processors apply them
  gemma3.py      Gemma 3: the family and its model (SigLIP tower and projector over gemma3_text.py's decoder)
  gemma3_text.py Gemma 3's decoder: sliding and global layers, RoPE per layer kind, zero-centred norms
  gemma4.py      Gemma 4: the family and its model (vision and audio towers over gemma4_text.py's decoder)
  gemma4_text.py Gemma 4's decoder: sliding and global layers, KV sharing, per-layer inputs
  gemma4_vision.py  Gemma 4's processor (no torchvision), vision encoder and image items
  gemma4_audio.py   Gemma 4's feature-extractor settings, audio encoder and audio items
  llava_onevision.py  LLaVA-OneVision: the family and its model (LLaVA's tower and projector, tiles, newlines)
  anyres.py      anyres-max tiling: a picture's tiles, its run's length, packing the tiles' features
  onevision_video.py  LLaVA-OneVision's video rules (no torchvision): frames kept, resized, normalized
  internvl.py    InternVL 3 / 3.5: the family and its model (InternViT, pixel shuffle, 448 px tiles plus a thumbnail)
  mistral3.py    Mistral 3: the family and its model (Pixtral tower at native resolution, patch merger, [IMG_BREAK] rows)
  idefics3.py    Idefics3 and SmolVLM2: the families and their model (SigLIP-style tower, pixel-shuffle connector, tiles)
  idefics3_tiles.py  Idefics3's image splitting: the sizes, the grid, the processor's row/column marker text
  llama4.py      Llama 4: the family and its model (tiled ViT with pixel shuffle, one item per picture with its separators)
  llama4_text.py Llama 4's decoder: chunked local attention and NoPE layers, QK L2 norm, sigmoid-routed experts
  llama4_tiles.py  Llama 4's tiling, resize and normalize without torchvision; Llama4Processor's text for a picture
"""
