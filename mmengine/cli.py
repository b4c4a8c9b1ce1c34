"""The `mmengine` command: `demo` on a built-in tiny model, `generate` for one-off use on a checkpoint,
`budget` for the encoder-cache budget, `serve` for the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from mmengine.entrypoints.engine_flags import add_engine_options, engine_options
from mmengine.errors import MMEngineError

GENERATE_OWN_FLAGS = ("seed",)  # `generate --seed` seeds its request, not the engine
# Every family mmengine.testing.families builds a tiny checkpoint of (named here, so `--help` imports no torch)
DEMO_FAMILIES = ("llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "gemma3", "gemma4",
                 "llava_onevision", "idefics3", "smolvlm", "internvl", "mistral3", "llama4")


def _require_positive(args: argparse.Namespace, *names: str) -> None:
    from mmengine.errors import ConfigError

    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive int, got {value}")


def run_demo(args: argparse.Namespace) -> None:
    _require_positive(args, "requests", "unique_images", "max_tokens")
    from mmengine import MMEngine, SamplingParams
    from mmengine.config import EngineConfig
    from mmengine.testing import make_test_image
    from mmengine.testing.families import tiny_checkpoint_path

    config = EngineConfig(model="demo", **engine_options(args))  # the engine's own rules, before the model is built
    if args.family in ("qwen3_5", "qwen3_5_moe") and config.spec_config.method == "mtp":
        from mmengine.testing.mtp import tiny_qwen3_5_mtp_path

        path = tiny_qwen3_5_mtp_path(args.family, cache_dir=args.cache_dir)  # with a (random) MTP head to draft with
    else:
        path = tiny_checkpoint_path(args.family, args.cache_dir)
    print(f"tiny {args.family} checkpoint (random weights): {path}")
    engine = MMEngine(str(path), **engine_options(args))

    def user_turn(question: str, num_images: int) -> str:  # the model's own chat template
        content = [{"type": "image"}] * num_images + [{"type": "text", "text": question}]
        return engine.input_processor.apply_chat_template([{"role": "user", "content": content}])

    # (different sizes: a native-resolution family gives each its own token count)
    images = [make_test_image(seed, size=(48 + 16 * (seed % 4), 40 + 8 * (seed % 3))) for seed in range(args.unique_images)]
    questions = ["What is shown?", "Describe the colours.", "Is there a pattern?", "Count the shapes."]
    prompts, image_lists = [], []
    num_image_requests = 0
    for i in range(args.requests):
        question = questions[i % len(questions)]
        if i % 4 == 3:  # some text-only requests in the mix
            prompts.append(user_turn(question, 0))
            image_lists.append([])
        else:  # the image requests cycle through every unique image
            prompts.append(user_turn(question, 1))
            image_lists.append([images[num_image_requests % len(images)]])
            num_image_requests += 1
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:1], images=image_lists[:1], sampling_params=params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(prompts, images=image_lists, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    print("sample outputs (random weights, so the text is noise):")
    for output in outputs[:3]:
        print(f"  {output.prompt!r} -> {output.text!r}")
    print(
        f"{len(outputs)} requests ({sum(map(len, image_lists))} images, "
        f"{len({id(img) for imgs in image_lists for img in imgs})} unique) "
        f"in {elapsed:.2f}s: {len(outputs) / elapsed:.1f} req/s, {generated / elapsed:.1f} output tok/s"
    )
    if engine.family.video_token_id is not None:
        _demo_video(engine, params)
    print("engine stats:", json.dumps(engine.stats(), indent=2))


def _demo_video(engine: Any, params: Any) -> None:
    """Questions about one synthetic clip: it is encoded once, one encoder run per temporal patch."""
    from mmengine.testing.video import make_test_clip

    clip = make_test_clip(16, 60, 84)  # 8 seconds at 2 frames/s
    questions = ["What happens?", "What moves first?", "What colour is it at the end?", "Is it a loop?"]
    prompts = [engine.input_processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": q}]}]) for q in questions]
    before = engine.stats()["encoder_runs"]
    outputs = engine.generate(prompts, videos=[[clip]] * len(prompts), sampling_params=params, use_tqdm=False)
    patches = sum(item.modality == "video" for item in engine.input_processor.process(prompts[0], None, params, videos=[clip]).mm_items)
    print(f"{len(outputs)} questions about one 16-frame clip ({patches} temporal patches): "
          f"{engine.stats()['encoder_runs'] - before} encoder runs, {sum(o.num_cached_tokens for o in outputs)} prompt tokens "
          "served from the prefix cache")


def run_generate(args: argparse.Namespace) -> None:
    from mmengine import MMEngine, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    engine = MMEngine(args.model, **engine_options(args, exclude=GENERATE_OWN_FLAGS))
    images = args.image or []
    from mmengine.multimodal.video import Video

    videos = [Video(path, fps=args.video_fps) for path in args.video or []] or None
    if args.chat:
        content = [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos or []]
        content.append({"type": "text", "text": args.prompt})
        outputs = engine.chat([{"role": "user", "content": content}], images=images, sampling_params=params, use_tqdm=False,
                              videos=videos)
    else:
        outputs = engine.generate(args.prompt, images=images, sampling_params=params, use_tqdm=False, videos=videos)
    print(outputs[0].text)
    print(f"[finish_reason={outputs[0].finish_reason}, tokens={len(outputs[0].token_ids)}]", file=sys.stderr)


def run_budget(args: argparse.Namespace) -> None:
    """Derives the encoder-cache budget from the checkpoint's config alone (no weights are loaded)."""
    from pathlib import Path

    import torch

    from mmengine.config import EngineConfig
    from mmengine.encoder_cache.budget import compute_encoder_budget, explain_budget
    from mmengine.entrypoints.engine_flags import mapping_parser
    from mmengine.kv_cache.manager import cdiv
    from mmengine.models.loader import checkpoint_dtype
    from mmengine.models.registry import family_class_for, load_family, load_hf_config, load_hf_processor

    defaults = EngineConfig(model=args.model).options()
    explicit = {
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "max_model_len": args.max_model_len,
        "dtype": args.dtype,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "limit_mm_per_prompt": _parse_limits(args.limit_mm_per_prompt),
        "encoder_cache_size": args.encoder_cache_size,
        "max_audio_seconds": args.max_audio_seconds,
        "sliding_kv_ratio": args.sliding_kv_ratio,
        "mm_processor_kwargs": mapping_parser("--mm-processor-kwargs", int)(args.mm_processor_kwargs) if args.mm_processor_kwargs else None,
        "speculative_config": mapping_parser("--speculative-config", Any)(args.speculative_config) if args.speculative_config else None,
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel or None,
    }
    # the engine's rules; the device decides what dtype "auto" becomes
    config = EngineConfig(model=args.model, device=args.device, **{k: v for k, v in explicit.items() if v is not None})
    hf_config = load_hf_config(Path(args.model))
    family_class_for(hf_config)  # an unsupported architecture fails before the processor loads
    family = load_family(hf_config, load_hf_processor(Path(args.model), config.multimodal_config.mm_processor_kwargs), args.model)
    from mmengine.spec.draft_head import enable_draft_head

    enable_draft_head(config, family, Path(args.model))  # method "mtp": the head's layers join the KV cache

    def pick(name: str, value: object) -> tuple[object, str]:
        return (value, f"--{name.replace('_', '-')}") if value is not None else (defaults[name], "default")

    inputs = {
        "max_num_batched_tokens": pick("max_num_batched_tokens", args.max_num_batched_tokens),
        "max_num_seqs": pick("max_num_seqs", args.max_num_seqs),
        "limit_mm_per_prompt": pick("limit_mm_per_prompt", _parse_limits(args.limit_mm_per_prompt)),
        "encoder_cache_size": pick("encoder_cache_size", args.encoder_cache_size),
    }
    block_size = args.block_size
    if args.num_kv_blocks is not None:
        kv_tokens = (args.num_kv_blocks * block_size, f"--num-kv-blocks {args.num_kv_blocks} x block_size {block_size}")
    else:
        max_len = args.max_model_len or hf_config.text_config.max_position_embeddings
        blocks = inputs["max_num_seqs"][0] * cdiv(max_len, block_size)
        kv_tokens = (blocks * block_size, f"upper bound max_num_seqs x ceil(max_model_len {max_len} / {block_size}) blocks "
                     "(the KV cache is sized from free memory at start-up; pass --num-kv-blocks for the exact figure)")
    device = config.resolve_device()  # the dtype the engine would run in: --dtype auto depends on the device
    dtype = config.resolve_dtype(checkpoint_dtype(Path(args.model)), device)
    elem = torch.empty((), dtype=dtype).element_size()
    hidden = hf_config.text_config.hidden_size
    width = family.embedding_width  # Qwen3-VL: the DeepStack levels are cached beside the embedding
    levels = f" x (1 + {family.deepstack_levels} DeepStack levels)" if family.deepstack_levels else ""
    inputs["kv_tokens"] = kv_tokens
    inputs["bytes_per_token"] = (
        width * elem,
        f"text hidden_size {hidden}{levels} x {elem} bytes ({str(dtype).removeprefix('torch.')}: --dtype {args.dtype} on {device})",
    )
    budget = compute_encoder_budget(
        family.max_tokens_per_item(inputs["limit_mm_per_prompt"][0], config.multimodal_config.max_audio_seconds),
        inputs["max_num_batched_tokens"][0],
        inputs["max_num_seqs"][0],
        inputs["limit_mm_per_prompt"][0],
        pinned_room_tokens=kv_tokens[0],
        bytes_per_token=width * elem,
        encoder_cache_size=inputs["encoder_cache_size"][0],
        items_per_video=family.max_items_per_video,
        items_per_image=family.max_items_per_image,
    )
    if args.json:
        print(json.dumps(budget.to_json(), indent=2))
        return
    print(f"encoder cache budget for {args.model}")
    item_source = family.explain_max_tokens_per_item(inputs["limit_mm_per_prompt"][0], config.multimodal_config.max_audio_seconds)
    for line in explain_budget(budget, inputs, item_source, family.max_items_per_video, family.max_items_per_image):
        print("  " + line)
    from mmengine.encoder_cache.host_tier import host_tier_bytes
    from mmengine.runner.kv_tensors import kv_block_bytes

    # At TP > 1 each rank has host tiers of its own (of its KV heads' blocks), and their default is 0 (the driver
    # holds no tensors), as the engine sizes them
    tier_device = device.type if args.tensor_parallel_size == 1 else "cpu"
    each = "" if args.tensor_parallel_size == 1 else ", each rank's"
    default = f"default on {device.type}" if args.tensor_parallel_size == 1 else \
        f"default at --tensor-parallel-size {args.tensor_parallel_size}"
    host = host_tier_bytes(args.encoder_cache_host_bytes, tier_device)
    source = "--encoder-cache-host-bytes" if args.encoder_cache_host_bytes is not None else default
    per_item = budget.max_tokens_per_item * budget.bytes_per_token
    print(f"  host tier (evicted outputs)   {host:>12}   bytes ({source}{each}): {host // per_item} items of the largest size")
    _print_weights(family, args.model, elem)
    if config.spec_config.method == "eagle3":
        from mmengine.models.loader import checkpoint_shapes

        draft = sum(math.prod(shape) for shape in checkpoint_shapes(Path(config.spec_config.draft_model)).values())
        print(f"  EAGLE-3 head                  {draft * elem:>12}   bytes: {draft} parameters ({config.spec_config.draft_model})")
    kv_dtype = EngineConfig(model=args.model, kv_cache_dtype=args.kv_cache_dtype).resolve_kv_cache_dtype(dtype)
    kv_elem = torch.empty((), dtype=kv_dtype).element_size()
    block_bytes = kv_block_bytes(family.kv_cache_layout(), block_size, kv_elem)
    _print_kv_budget(family, block_size, kv_dtype, dtype, args.kv_cache_dtype)
    _print_window_budget(family, config, kv_elem, args.max_model_len or hf_config.text_config.max_position_embeddings)
    if family.recurrent_shape is not None:
        _print_state_budget(family, config, elem, block_bytes // block_size)
    if args.tensor_parallel_size > 1:
        _print_rank_budget(family, args.model, args.tensor_parallel_size, elem, kv_elem, block_size, args.num_kv_blocks,
                           args.enable_expert_parallel)
    kv_host = host_tier_bytes(args.kv_cache_host_bytes, tier_device)
    kv_source = "--kv-cache-host-bytes" if args.kv_cache_host_bytes is not None else default
    if args.tensor_parallel_size > 1:
        from mmengine.distributed.rank_budget import rank_kv_layout

        block_bytes = kv_block_bytes(rank_kv_layout(family.kv_cache_layout(), args.tensor_parallel_size), block_size, kv_elem)
    print("KV cache host tier (evicted prefix blocks)")
    print(f"  host tier                     {kv_host:>12}   bytes ({kv_source}{each}): {kv_host // block_bytes} blocks of "
          f"{block_bytes} bytes")


def _print_weights(family: Any, model_dir: str, elem: int) -> None:
    """The checkpoint's weights from its safetensors headers (no tensor is read), in the engine's dtype:
    every expert of a mixture-of-experts decoder is in memory, though a token reads only its top-k."""
    from pathlib import Path

    from mmengine.models.loader import checkpoint_headers
    from mmengine.models.quantization import quantization_of

    headers = checkpoint_headers(Path(model_dir))
    spec = quantization_of(family.hf_config)
    if spec is not None:
        _print_quantized_weights(spec, headers, elem)
        return
    numels = {name: math.prod(shape) for name, (shape, _) in headers.items()}
    head = sum(n for name, n in numels.items() if name.startswith("mtp."))  # Qwen3.5's MTP head: loaded to draft only
    total = sum(numels.values()) - (0 if family.num_draft_layers else head)
    print(f"weights                         {total * elem:>12}   bytes: {total} parameters x {elem} B (all loaded at start-up)")
    if head:
        label = "  of which the MTP head (mtp.*)" if family.num_draft_layers else "  not loaded: MTP head (mtp.*)"
        print(f"{label:<32}{head * elem:>12}   bytes: {head} parameters, read only to draft (--speculative-config "
              "with method mtp)")
    routed = sum(n for name, n in numels.items() if ".experts." in name)
    if routed:
        text = family.text_config
        experts = getattr(text, "num_experts", None) or text.num_local_experts  # (Llama 4 names them local)
        active = total - routed + routed * text.num_experts_per_tok // experts
        print(f"  of which routed experts       {routed * elem:>12}   bytes: {experts} experts a MoE layer, a token reads "
              f"{text.num_experts_per_tok}: {active * elem} bytes of weights active per token")


_HEADER_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "I16": 2, "F16": 2, "BF16": 2, "I32": 4, "F32": 4, "I64": 8}


def _print_quantized_weights(spec: Any, headers: dict[str, tuple[tuple[int, ...], str]], elem: int) -> None:
    """A quantized checkpoint: its bytes where the decoder's projections stay quantized (the fused
    kernels' path), and where they are dequantized at load."""
    packed_parts = {"qweight", "weight_packed"}  # int32 words of 8 int4 values
    side_parts = {"qzeros", "scales", "g_idx", "weight_scale", "weight_scale_inv", "weight_zero_point", "weight_shape",
                  "input_scale", "k_scale", "v_scale"}
    params = stored = 0
    for name, (shape, dtype) in headers.items():
        leaf = name.rpartition(".")[2]
        numel = math.prod(shape)
        if leaf in packed_parts:
            params += numel * 8
        elif leaf not in side_parts:
            params += numel
        # float tensors load in the model dtype; quantized values, their scales and zeros as stored
        stored += numel * (elem if dtype in ("F16", "BF16", "F32") and leaf not in side_parts else _HEADER_BYTES.get(dtype, elem))
    label = spec.method.removesuffix("-int4")
    print(f"weights (kept quantized)        {stored:>12}   bytes: {params} parameters, the {label} projections in their "
          "stored bits (CUDA with the Triton kernels; FP8 needs compute capability 8.9+)")
    print(f"weights (dequantized at load)   {params * elem:>12}   bytes: {params} parameters x {elem} B (CPU, LoRA, older GPUs)")


def _print_rank_budget(family: Any, model_dir: str, tp_size: int, elem: int, kv_elem: int, block_size: int,
                       num_kv_blocks: int | None, expert_parallel: bool = False) -> None:
    """One tensor-parallel rank's weights and KV cache (the decoder split, the vision side whole on every rank; the
    routed experts on their intermediate size, or with `expert_parallel` E/N whole experts a rank)."""
    from pathlib import Path

    from mmengine.distributed.rank_budget import rank_kv_layout, rank_share, routed_expert_share
    from mmengine.distributed.sharded_model import check_tensor_parallel_shapes
    from mmengine.distributed.sharding import routed_experts
    from mmengine.models.loader import checkpoint_shapes
    from mmengine.models.quantization import quantization_of
    from mmengine.runner.kv_tensors import kv_block_bytes

    check_tensor_parallel_shapes(family, tp_size, expert_parallel)  # a shape that does not divide: the engine's ConfigError
    shapes = checkpoint_shapes(Path(model_dir))
    share = rank_share(shapes, family.text_config, tp_size, expert_parallel)
    layout = rank_kv_layout(family.kv_cache_layout(), tp_size)
    per_token = kv_block_bytes(layout, 1, kv_elem)
    print(f"tensor parallelism (--tensor-parallel-size {tp_size}: {tp_size} worker processes, one rank each)")
    if quantization_of(family.hf_config) is not None:  # each rank keeps its slice of the bits (distributed/quantized_parallel.py)
        from mmengine.distributed.rank_budget import quantized_rank_share
        from mmengine.models.loader import checkpoint_headers

        quantized = quantized_rank_share(checkpoint_headers(Path(model_dir)), family.text_config, tp_size, elem, expert_parallel)
        print(f"  weights per rank (quantized)  {quantized.kept_bytes:>12}   bytes: {quantized.parameters} parameters, the rank's "
              "slice of each projection in its stored bits with its scales (the fused kernels' path, as at TP 1)")
        print(f"  weights per rank (dequantized){quantized.dequantized_bytes:>12}   bytes: {quantized.parameters} parameters x "
              f"{elem} B (CPU, LoRA, older GPUs)")
    else:
        print(f"  weights per rank              {share.per_rank * elem:>12}   bytes: {share.per_rank} of {share.whole} parameters "
              f"({share.replicated} replicated on every rank: the vision side, norms)")
    experts = routed_experts(family.text_config)
    routed = routed_expert_share(shapes, family.text_config, tp_size, expert_parallel) if experts else None
    if routed is not None and routed.whole:
        if expert_parallel:
            n = experts // tp_size
            how = f"{n} of {experts} experts a MoE layer, each whole (--enable-expert-parallel: rank r holds experts r x {n} .. (r+1) x {n} - 1)"
        else:
            how = f"all {experts} experts a MoE layer, each 1/{tp_size} of its intermediate rows"
        print(f"    of which routed experts     {routed.per_rank * elem:>12}   bytes: {routed.per_rank} of {routed.whole} "
              f"parameters, {how}")
    heads = layout[0][0] if layout else 0
    print(f"  KV cache per rank, one token  {per_token:>12}   bytes: {heads} of {family.text_config.num_key_value_heads} KV heads "
          f"a layer (split, or one replicated head when the ranks outnumber them)")
    blocks = f" x {num_kv_blocks} blocks (--num-kv-blocks) = {num_kv_blocks * per_token * block_size} bytes" if num_kv_blocks else ""
    print(f"  KV cache per rank, one block  {per_token * block_size:>12}   bytes{blocks}")
    if family.recurrent_shape is not None:
        from mmengine.distributed.sharded_hybrid import rank_shape

        shape = rank_shape(family.recurrent_shape, tp_size)
        print(f"  recurrent state per rank      {family.num_recurrent_layers * shape.state_bytes(elem):>12}   bytes a slot "
              f"(a live state or a checkpoint): {shape.num_value_heads} of {family.recurrent_shape.num_value_heads} value heads "
              f"x {family.num_recurrent_layers} linear-attention layers")


def _print_kv_budget(family: Any, block_size: int, kv_dtype: Any, model_dtype: Any, flag: str) -> None:
    """The KV cache's bytes per token in its dtype, and how many tokens a GiB holds."""
    import torch

    from mmengine.runner.kv_tensors import kv_block_bytes

    kv_elem, model_elem = (torch.empty((), dtype=d).element_size() for d in (kv_dtype, model_dtype))
    layout = family.kv_cache_layout()
    per_token = kv_block_bytes(layout, 1, kv_elem)
    name = str(kv_dtype).removeprefix("torch.")
    shapes = " + ".join(f"{layout.count(shape)} attention layers x {shape[0]} KV heads x {shape[1]}" for shape in dict.fromkeys(layout))
    print(f"KV cache ({name}: --kv-cache-dtype {flag})")
    head = f"; {family.num_draft_layers} of the layers the MTP head's" if family.num_draft_layers else (
        f"; {len(family.draft_kv_shapes)} of them the EAGLE-3 head's" if family.draft_kv_shapes else "")
    print(f"  one token                     {per_token:>12}   bytes: 2 x ({shapes}) x {kv_elem} B{head}")
    print(f"  one block                     {per_token * block_size:>12}   bytes: {block_size} tokens; {(1 << 30) // per_token} "
          f"tokens per GiB" + (f" ({model_elem // kv_elem}x those of a {str(model_dtype).removeprefix('torch.')} cache)"
                               if kv_elem < model_elem else ""))


def _print_window_budget(family: Any, config: Any, kv_elem: int, max_model_len: int) -> None:
    """Sliding-window layers (Gemma 4) or chunked-attention ones (Llama 4): each pool's bytes per token, and what
    keeping only the window (the current chunk) buys."""
    from mmengine.runner.kv_tensors import WindowPool, kv_pool_bytes

    windows = family.kv_cache_windows()
    window = next((w for w in windows if w is not None), None)
    if window is None:
        return
    from mmengine.kv_cache.chunked_attention import is_chunk

    full, windowed = kv_pool_bytes(family.kv_cache_layout(), windows, 1, kv_elem)
    count = sum(w is not None for w in windows)
    kind, keeps = ("chunked-attention", f"its current attention chunk's tokens") if is_chunk(window) else (
        "sliding-window", f"its last {window} tokens")
    print(f"KV cache pools ({count} {kind} layers of {window} tokens, {len(windows) - count} full-attention layers)")
    print(f"  full-attention pool, a token  {full:>12}   bytes: every token of every request and cached prefix")
    print(f"  {kind + ' pool, a token':<30}{windowed:>12}   bytes: a request keeps {keeps} (and a prefill chunk); "
          "blocks that left the window stay cached until reused")
    ratio = config.cache_config.sliding_kv_ratio
    if ratio is None or window >= max_model_len:
        why = "--sliding-kv-ratio is None" if ratio is None else f"max_model_len {max_model_len} is within the window"
        print(f"  one pool: every layer keeps every token ({why})")
        return
    pool = WindowPool.plan(window, ratio, config.cache_config.block_size, config.scheduler_config.max_num_batched_tokens, max_model_len)
    gib = 1 << 30
    kept_all = gib // (full + windowed)
    context = int(gib // (full + ratio * windowed))
    print(f"  split                         {ratio:>12}   window-pool tokens per full-pool token (--sliding-kv-ratio), at "
          f"least {pool.min_blocks} blocks (the null block, a window and a {config.scheduler_config.max_num_batched_tokens}-token chunk)")
    print(f"  tokens of context per GiB     {context:>12}   ({context / kept_all:.2f}x the {kept_all} when every layer keeps "
          f"every token); the window pool then holds {int(context * ratio)}")
    long, held = max_model_len, min(max_model_len, window + config.cache_config.block_size)
    print(f"  decoding at {long} tokens        {long * full + held * windowed:>12}   bytes a request holds (against "
          f"{long * (full + windowed)} with every layer keeping every token)")


def _print_state_budget(family: Any, config: Any, elem: int, kv_bytes_per_token: int) -> None:
    """A hybrid decoder's recurrent states: what one weighs, the live ones, and the checkpoints' share."""
    shape = family.recurrent_shape
    layers = family.num_recurrent_layers
    state = layers * shape.state_bytes(elem)
    live = (config.scheduler_config.max_num_seqs + 1) * state
    print(f"recurrent states ({layers} Gated DeltaNet layers; the KV cache holds the {family.num_attention_layers} attention layers)")
    print(f"  one state (live or checkpoint) {state:>12}   bytes: {layers} x ({shape.num_value_heads} heads x {shape.key_head_dim} x "
          f"{shape.value_head_dim} x 4 B + conv {shape.conv_dim} x {shape.conv_kernel - 1} x {elem} B), as much as "
          f"{state // kv_bytes_per_token} tokens of KV ({kv_bytes_per_token} bytes a token)")
    print(f"  live states                   {live:>12}   bytes: (max_num_seqs {config.scheduler_config.max_num_seqs} + 1 scratch for CUDA-graph "
          "padding) x one state")
    drafts = config.spec_config.num_speculative_tokens
    if drafts:
        print(f"  draft states                  {config.scheduler_config.max_num_seqs * drafts * state:>12}   bytes: max_num_seqs "
              f"{config.scheduler_config.max_num_seqs} x {drafts} speculative tokens x one state (a verify step keeps the "
              "state before each draft, to roll back to)")
    if not config.cache_config.enable_prefix_caching:
        print("  checkpoints                              0   (prefix caching off)")
    elif config.cache_config.num_state_checkpoints is not None:
        print(f"  checkpoints                   {config.cache_config.num_state_checkpoints * state:>12}   bytes: --num-state-checkpoints "
              f"{config.cache_config.num_state_checkpoints}")
    else:
        share = config.cache_config.state_checkpoint_memory_fraction
        print(f"  checkpoints                   {share:>12.0%}   of the cache memory left after the live states "
              f"(--state-checkpoint-memory-fraction): {int(share * (1 << 30)) // state} per GiB of it")


def _parse_limits(values: list[str] | None) -> dict[str, int] | None:
    """--limit-mm-per-prompt, given once or more: MODALITY=COUNT[,MODALITY=COUNT] or a JSON object each."""
    if not values:
        return None
    from mmengine.entrypoints.engine_flags import mapping_parser

    parse = mapping_parser("--limit-mm-per-prompt", int)
    return {modality: count for value in values for modality, count in parse(value).items()}


def build_parser() -> argparse.ArgumentParser:
    from mmengine import __version__

    parser = argparse.ArgumentParser(prog="mmengine", description="multimodal LLM inference engine")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a small workload on a built-in tiny random-weight model")
    demo.add_argument("--family", default="llava", choices=DEMO_FAMILIES, help="the tiny model's family")
    demo.add_argument("--requests", type=int, default=32)
    demo.add_argument("--unique-images", type=int, default=4)
    demo.add_argument("--max-tokens", type=int, default=16)
    demo.add_argument("--cache-dir", default=None,
                      help="where the tiny checkpoint is built (default: $MMENGINE_CACHE_DIR, else ~/.cache/mmengine/tiny-models)")
    add_engine_options(demo)
    demo.set_defaults(func=run_demo)

    gen = sub.add_parser("generate", help="generate once from a local checkpoint")
    gen.add_argument("--model", required=True, help="path to a local Hugging Face checkpoint directory")
    gen.add_argument("--prompt", required=True, help="prompt text; put one <image> marker per --image unless --chat")
    gen.add_argument("--image", action="append", help="image file (repeat for several images)")
    gen.add_argument("--video", action="append", help="video file (Qwen families; repeat for several videos)")
    gen.add_argument("--video-fps", type=float, default=None, help="frames per second sampled from each --video "
                     "(default: the checkpoint's video processor's)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt, images and videos with the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="the request's sampling seed")
    add_engine_options(gen, exclude=GENERATE_OWN_FLAGS)
    gen.set_defaults(func=run_generate)

    budget = sub.add_parser("budget", help="show how the encoder-cache budget is derived (loads no weights)")
    budget.add_argument("--model", required=True, help="path to a local checkpoint directory")
    budget.add_argument("--max-num-batched-tokens", type=int, default=None)
    budget.add_argument("--max-num-seqs", type=int, default=None)
    budget.add_argument("--limit-mm-per-prompt", action="append", metavar="MODALITY=COUNT[,...]",
                        help='e.g. image=4,video=0 or \'{"image": 4, "video": 0}\'')
    budget.add_argument("--encoder-cache-size", type=int, default=None, help="override the compute budget (embeddings)")
    budget.add_argument("--max-audio-seconds", type=float, default=None, help="the longest audio clip (families that take audio)")
    budget.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks, for the exact pinned room")
    budget.add_argument("--encoder-cache-host-bytes", type=int, default=None,
                        help="the encoder cache's host tier (default: a tenth of the available RAM on CUDA, 0 on CPU)")
    budget.add_argument("--kv-cache-host-bytes", type=int, default=None,
                        help="the prefix cache's host tier (default: a tenth of the available RAM on CUDA, 0 on CPU)")
    budget.add_argument("--block-size", type=int, default=16)
    budget.add_argument("--max-model-len", type=int, default=None)
    budget.add_argument("--sliding-kv-ratio", type=float, default=None,
                        help="sliding-window layers' pool: its blocks per full-attention block (Gemma 4; default 0.5)")
    budget.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    budget.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                        help="the KV cache's element type (auto: the model dtype)")
    budget.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (auto resolves the dtype per device)")
    budget.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks the decoder is split over: each rank's weights and KV cache are printed")
    budget.add_argument("--enable-expert-parallel", action="store_true",
                        help="MoE decoders: each rank holds whole experts (E / N of every MoE layer) instead of every "
                             "expert's share of its intermediate size")
    budget.add_argument(
        "--mm-processor-kwargs", default=None, metavar="KEY=VALUE[,KEY=VALUE]",
        help="image-processor overrides, e.g. max_pixels=1003520 (sets the largest item of native-resolution models)",
    )
    budget.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' (its draft states)')
    budget.add_argument("--json", action="store_true", help="print the terms as JSON")
    budget.set_defaults(func=run_budget)

    # Its options (EngineConfig's fields among them) are built by mmengine.entrypoints.serve_cli on use,
    # so that `mmengine --help` imports neither torch nor the server's packages.
    sub.add_parser("serve", help="run the OpenAI-compatible HTTP server (`mmengine serve --help` for its options)",
                   add_help=False)
    return parser


def run_serve(argv: Sequence[str], as_command: bool = False) -> None:
    from mmengine.entrypoints.serve_cli import run_serve as serve

    serve(argv, as_command=as_command)


def main(argv: Sequence[str] | None = None, as_command: bool = False) -> int:
    """`as_command`: this process is the `mmengine` command, which a finished `serve` may end at once."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv[:1] if argv[:1] == ["serve"] else argv)  # `serve` parses its own options
    try:
        if args.command == "serve":
            run_serve(argv[1:], as_command=as_command)
        else:
            args.func(args)
    except (MMEngineError, argparse.ArgumentTypeError) as err:
        message = " ".join(str(err).split())  # one line, whatever the message holds
        print(f"mmengine: error: {message}", file=sys.stderr)
        return 2
    return 0


def console_main() -> None:
    """The `mmengine` command and `python -m mmengine`."""
    sys.exit(main(as_command=True))


if __name__ == "__main__":
    console_main()
