"""Images, videos and audio: from what a caller gives to token ids and items.

  processor.py        InputProcessor: prompt + pictures -> token ids with expanded runs, and items
  light_processor.py  a front end's processor parts (tokenizer, image processor, template), no transformers modeling code
  fast_image_processor.py  transformers' PIL image processors' pixels, bit for bit, without their float passes
  picture_preparer.py a picture's cache miss (decode, limits, content hash, preprocess): the same here and in a worker
  preprocess_pool.py  worker processes that prepare encoded pictures, tensors back in shared memory
  image_loading.py    paths, bytes, PIL images, arrays -> RGB images, with limits
  resize_guard.py     what the image processor's resize will allocate, known before it runs
  embeds.py           precomputed image embeddings as an item kind
  media_urls.py       image and video URLs (data:, file://, http(s)) and input_audio data under a MediaPolicy: the server's and chat()'s
  processor_cache.py  preprocessed items kept across requests
  video.py            Video: a caller's clip, its sampling and bounds, probed before decoding
  video_loader.py     a clip -> its plan, hashes and one item per temporal patch
  video_prompt.py     where a prompt's videos go (markers, runs, items)
  audio.py            Audio: a caller's clip, its limits, decoded and resampled to the model's mono rate
  audio_loader.py     a clip -> its hash and item (cached), and a prompt's audio items
  media_container.py  which containers request bytes may open (magic bytes, FFmpeg's whitelists), decode deadlines
"""
