"""Model families: everything outside models/ asks a ModelFamily, never a model's config.

  family.py      the ModelFamily interface (tokens per item, the largest item, positions, encoder inputs)
  registry.py    which architectures mmengine runs, and how to build them
  config_import.py  transformers' config code imported without its activations (and model loading)
  text_config.py the text config's facts (head size, sliding window) that families and decoders both read
  loader.py      safetensors tensors, sharded or not, checked strictly; per-expert MoE tensors stacked
  quantization.py  a checkpoint's quantization_config: FP8 (block, per channel) dequantized at load
  vlm.py         what every VLM shares: a decoder, an LM head, the vision side
  llama.py       the Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache
  llava.py       LLaVA-1.5 (the family; each family's model is in its <family>_model.py, the family's model_class
                 names it: front ends and preprocessing workers import the family, never its model)
  llava_model.py LLaVA-1.5's model: CLIP or SigLIP tower, projector, decoder
  qwen_vl.py     Qwen2-VL and Qwen2.5-VL (native resolution, M-RoPE)
  qwen_vl_model.py  the Qwen-VL families' model: transformers' tower (packed attention) over the decoder
  qwen3_vl.py    Qwen3-VL (dense; DeepStack)
  qwen3_5.py     Qwen3.5 (dense): a hybrid decoder (Gated DeltaNet + gated attention) under Qwen3-VL's tower
  qwen3_5_model.py  Qwen3.5's model: the hybrid decoder and its multi-token-prediction head
  qwen_resize.py Qwen's resize rule and the largest item it makes (images and videos)
  qwen_video.py  Qwen's video rules, as transformers' video processors apply them
  gemma3.py      Gemma 3's family: pictures, pan-and-scan, soft tokens
  gemma3_model.py  Gemma 3's model (SigLIP tower and projector over gemma3_text.py's decoder)
  gemma3_text.py Gemma 3's decoder: sliding and global layers, RoPE per layer kind, zero-centred norms
  gemma4.py      Gemma 4's family: pictures, clips, the KV cache's layout
  gemma4_model.py  Gemma 4's model (vision and audio towers over gemma4_text.py's decoder)
  gemma4_layers.py  Gemma 4's decoder layers as its config describes them (kind, KV heads, head size, KV source)
  gemma4_text.py Gemma 4's decoder: sliding and global layers, KV sharing, per-layer inputs
  gemma4_vision.py  Gemma 4's processor (no torchvision), vision encoder and image items
  gemma4_audio.py   Gemma 4's feature-extractor settings, audio encoder and audio items
  llava_onevision.py  LLaVA-OneVision's family (anyres-max tiles, videos)
  llava_onevision_model.py  its model (LLaVA's tower and projector, tiles, newlines)
  anyres.py      anyres-max tiling: a picture's tiles, its run's length, packing the tiles' features
  onevision_video.py  LLaVA-OneVision's video rules (no torchvision): frames kept, resized, normalized
  internvl.py    InternVL 3 / 3.5's family (448 px tiles plus a thumbnail)
  internvl_model.py  its model (InternViT, pixel shuffle, the decoder)
  mistral3.py    Mistral 3's family ([IMG_BREAK] rows, the engine's own prompt processor)
  mistral3_model.py  its model (Pixtral tower at native resolution, patch merger)
  idefics3.py    Idefics3 and SmolVLM2: the families (tiles, marker text)
  idefics3_model.py  their model (SigLIP-style tower, pixel-shuffle connector)
  idefics3_tiles.py  Idefics3's image splitting: the sizes, the grid, the processor's row/column marker text
  llama4.py      Llama 4's family (one item per picture with its separators)
  llama4_model.py  its model (tiled ViT with pixel shuffle over llama4_text.py's decoder)
  llama4_text.py Llama 4's decoder: chunked local attention and NoPE layers, QK L2 norm, sigmoid-routed experts
  llama4_tiles.py  Llama 4's tiling, resize and normalize without torchvision; Llama4Processor's text for a picture
"""
