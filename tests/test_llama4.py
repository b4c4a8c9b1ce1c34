"""Llama 4 end to end against transformers (fp32, CPU): the tiny checkpoint has three RoPE layers with chunked
attention over 16-token chunks (QK L2 norm) and a NoPE layer with temperature tuning, MoE layers (sigmoid top-1
routing, a shared expert) between dense ones, and pictures cut into 32 px tiles plus a global tile. Greedy tokens
equal transformers' generate for text, one picture and two pictures of different grids; the tiles' canvas equals
transformers' rule; a picture across prefill-chunk boundaries, a mixed batch, a prefix hit with one encoder run,
preemption; the chunked layers' pool frees the blocks before the current chunk (a KV budget that holds the context
only so) and a hit needs only the current chunk's blocks there; demo and budget.

transformers 5.24's Llama4ForConditionalGeneration.forward reads `image_outputs` off its language model's output,
which has no such field: the reference gets the field (None) for this module's tests."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch
from books import assert_books_consistent
from conftest import KERNEL_FP32, hf_greedy, hf_logits
from family_checks import (GREEDY, check_bad_inputs, check_demo_and_budget, check_every_block_offset, check_mixed_batch,
                           check_pictures_across_chunks, check_preemption, check_repeated_prompt, check_token_prompts,
                           engine_fixtures, greedy, tiny_engine)

from mmengine import SamplingParams
from mmengine.errors import PromptTooLongError
from mmengine.kv_cache.chunked_attention import ChunkedAttentionManager
from mmengine.testing.images import make_test_image
from mmengine.testing.llama4 import TinyLlama4Spec, llama4_prompt, tiny_llama4_path

WIDE, SQUARE, SMALL = make_test_image(3, (90, 30)), make_test_image(4, (50, 70)), make_test_image(5, (20, 20))
QUESTION = "Describe the picture in detail."
LONG = "Tell me about the red square and the blue circle, then count to ten slowly, please. " * 2


@pytest.fixture(scope="module", autouse=True)
def _reference_workaround():
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MoeCausalLMOutputWithPast, "image_outputs", None, raising=False)
        yield


path, engine, uncached = engine_fixtures(tiny_llama4_path)


@pytest.mark.parametrize("pictures", [[], [WIDE], [WIDE, SQUARE]], ids=["text", "wide", "wide,square"])
def test_greedy_tokens_equal_transformers(path, engine, pictures):
    """Every prompt is longer than a chunk (16): the chunked layers' masks and the NoPE layer's temperature matter."""
    prompt = llama4_prompt(QUESTION, len(pictures))
    assert greedy(engine, prompt, pictures or None) == [hf_greedy(path, prompt, pictures, 12, ignore_eos=True)]


def test_a_maverick_like_decoder_equals_transformers():
    """Maverick's decoder choices (no QK norm, every layer MoE) with two experts a token and 8-token chunks: the
    routed inputs are scaled per chosen expert, the outputs summed."""
    spec = TinyLlama4Spec(use_qk_norm=False, interleave_moe_layer_step=1, num_experts_per_tok=2, attention_chunk_size=8,
                          attn_temperature_tuning=False)
    path = tiny_llama4_path(spec)
    prompt = llama4_prompt(QUESTION, 0)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert greedy(tiny_engine(path), prompt, None, params) == [hf_greedy(path, prompt, [], 8, ignore_eos=True)]


def test_the_chunks_and_the_temperature_matter(path):
    """The next token's log-probabilities equal transformers'; attending past the chunk, or without the NoPE
    layer's temperature, they do not (one KV pool, so a layer may drop its chunk)."""
    prompt = llama4_prompt(LONG, 1)
    want = torch.log_softmax(hf_logits(path, prompt, [WIDE]), -1).topk(5)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    engine = tiny_engine(path, enable_prefix_caching=False, sliding_kv_ratio=None)
    layers = [layer.self_attn for layer in engine.runner.model.language_model.layers]

    def top() -> torch.Tensor:
        out = engine.generate(prompt, images=[WIDE], sampling_params=params, use_tqdm=False)
        return torch.tensor([[token, logprob] for token, logprob in out[0].logprobs[0].top])

    ours = top()
    assert ours[:, 0].long().tolist() == want.indices.tolist()
    assert (ours[:, 1] - want.values).abs().max() < 1e-4
    assert sorted(layer.attn.attention_chunk for layer in layers if layer.attn.attention_chunk) == [16] * 3
    assert [layer.temperature_tuning for layer in layers] == [False, False, False, True]
    layers[3].temperature_tuning = False
    assert (top()[:, 1] - want.values).abs().max() > 1e-3
    layers[3].temperature_tuning = True
    for layer in layers:
        layer.attn.attention_chunk = None
    assert (top()[:, 1] - want.values).abs().max() > 1e-3


def test_the_triton_kernels_give_the_same_tokens(path, no_tf32):
    """The Triton prefill and split-KV decode kernels with the chunk (and the fused MoE, norm and store kernels) in
    the engine: a 24-token prompt in 16-token prefill chunks, decodes past the first chunk (the interpreter on CPU,
    compiled on a GPU)."""
    prompt = llama4_prompt("Count to ten, slowly.")
    engine = tiny_engine(path, max_num_batched_tokens=16, attn_backend="triton", **KERNEL_FP32.engine_kwargs)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = engine.generate(prompt, sampling_params=params, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > 16
    assert out.token_ids == hf_greedy(path, prompt, [], 4, KERNEL_FP32, ignore_eos=True)


def test_the_canvas_is_transformers(engine, monkeypatch):
    """transformers' canvas rule (find_supported_resolutions, get_best_fit, the resize without distortion), imported
    with torchvision stubbed out (its module needs it at import; these functions do not), picks our canvases."""
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = "transformers.models.llama4.image_processing_llama4"
    monkeypatch.setitem(sys.modules, module, None)  # restored (dropped) afterwards: the import below is the stubbed one
    del sys.modules[module]
    from transformers.image_utils import SizeDict
    hf = importlib.import_module(module)

    tiles = engine.family.tiles
    for max_patches in (1, 4, 6, 16):
        tiles.max_patches = max_patches
        resolutions = torch.tensor(hf.find_supported_resolutions.__wrapped__(max_patches, SizeDict(height=32, width=32)))
        for width, height in [(90, 30), (50, 70), (20, 20), (32, 32), (33, 31), (200, 30), (7, 300), (640, 480), (64, 96)]:
            canvas = tuple(int(v) for v in hf.get_best_fit((height, width), resolutions))
            assert tiles.canvas(height, width) == canvas
            target = (min(max(height, 32), canvas[0]), min(max(width, 32), canvas[1]))
            assert tiles.resized_size(height, width) == tuple(max(v, 1) for v in hf.get_max_res_without_distortion((height, width), target))
    tiles.max_patches = engine.family.max_tiles


def _transformers_tiles(picture, tile: int, canvas: tuple[int, int], resized: tuple[int, int]) -> torch.Tensor:
    """Llama4ImageProcessor's steps on a uint8 tensor: the resize (torchvision's resize of a uint8 picture on a CPU with
    AVX2 is torch's antialiased bilinear interpolate), the pad, the bfloat16 rescale and normalize, the split, the
    global tile."""
    import numpy as np
    import torch.nn.functional as F

    pixels = torch.from_numpy(np.asarray(picture.convert("RGB")).copy()).permute(2, 0, 1)[None]

    def normalized(x: torch.Tensor) -> torch.Tensor:
        return ((x.to(torch.bfloat16) * (1 / 255) - 0.5) / 0.5).float()

    image = F.interpolate(pixels, size=resized, mode="bilinear", antialias=True, align_corners=False)[0]
    padded = torch.zeros(3, *canvas, dtype=torch.uint8)
    padded[:, : resized[0], : resized[1]] = image
    rows, cols = canvas[0] // tile, canvas[1] // tile
    tiles = normalized(padded).view(3, rows, tile, cols, tile).permute(1, 3, 0, 2, 4).reshape(-1, 3, tile, tile)
    if rows * cols > 1:
        whole = F.interpolate(pixels, size=(tile, tile), mode="bilinear", antialias=True, align_corners=False)[0]
        tiles = torch.cat([tiles, normalized(whole)[None]])
    return tiles


def test_the_tiles_are_transformers_steps(engine):
    """Our tiles equal transformers' steps, written out here, for pictures shrunk, grown and cut into several tiles."""
    tiles = engine.family.tiles
    for index, (width, height) in enumerate([(90, 30), (50, 70), (200, 130), (20, 20), (33, 97)]):
        picture = make_test_image(index, (width, height))
        ours, _ = tiles.tiles(picture)
        assert ours.equal(_transformers_tiles(picture, 32, tiles.canvas(height, width), tiles.resized_size(height, width)))


def test_prompt_and_tiles(engine):
    """The prompt holds Llama4Processor's text for the picture (the tile separators, <|image|>, the global tile's
    run), one item from <|image_start|> to <|image_end|>; the tiles are the canvas cut row by row, then the global
    tile, in bfloat16 values."""
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    tokenizer = engine.input_processor.tokenizer
    processed = engine.input_processor.process(llama4_prompt("What?", 1), [SQUARE], GREEDY)
    (item,) = processed.mm_items
    prefix, suffix = (tokenizer(text)["input_ids"] for text in llama4_prompt("What?", 1).split("<|image|>"))
    text = Llama4Processor._prompt_split_image(None, (2, 2), 16)
    assert processed.prompt_token_ids == prefix + tokenizer(text)["input_ids"] + suffix
    assert (item.offset, item.length) == (len(prefix), len(tokenizer(text)["input_ids"]))
    pixels = item.encoder_inputs["pixel_values"]
    assert pixels.shape == (5, 3, 32, 32) and pixels.equal(pixels.bfloat16().float())
    assert engine.family.resized_size(70, 50) == (64, 64)


def test_a_token_prompt_with_one_placeholder_per_picture(engine):
    """One <|patch|> per picture in a token prompt is expanded into the picture's text, as the marker is."""
    prompt, params = llama4_prompt("Compare them.", 2), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = engine.input_processor.tokenizer(prompt.replace("<|image|>", "<|patch|>"))["input_ids"]
    check_token_prompts(engine, prompt, [WIDE, SQUARE], [ids], params)


def test_pictures_across_chunk_boundaries(path):
    """Prefill chunks of 24 tokens end inside both pictures' runs (70 and 90 tokens)."""
    items, _ = check_pictures_across_chunks(path, llama4_prompt(QUESTION, 2), [WIDE, SQUARE], 24)
    assert len(items) == 2


def test_a_mixed_batch_equals_each_prompt_alone(uncached):
    prompts = [llama4_prompt(QUESTION, 0), llama4_prompt("What is it?", 1), llama4_prompt("Compare them.", 2),
               llama4_prompt("And this one?", 1)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    check_mixed_batch(uncached, prompts, [None, [SMALL], [SQUARE, WIDE], [SQUARE]], params)


def test_a_repeated_prompt_recomputes_one_block_and_encodes_its_picture_once(path, engine):
    check_repeated_prompt(path, engine, llama4_prompt(QUESTION, 1), [make_test_image(7, (70, 40))])


def test_a_picture_at_every_offset_from_a_block_boundary(path, uncached):
    """Offsets 0, 1, 2, 3; lengths the block size divides."""
    prompts = [llama4_prompt("a " * after + "What is it?", 0).replace("\n\n", "\n\n" + "b " * before + "<|image|>", 1)
               for before, after in [(0, 1), (4, 0), (1, 0), (2, 2)]]
    assert check_every_block_offset(tiny_engine(path, encoder_cache_size=1), uncached, prompts, [WIDE]) == 1


def test_preemption_keeps_the_tokens(path, engine):
    """Two prompts that share no block, each 114 tokens (29 blocks of 4) and 32 blocks once generated, in 60 blocks:
    both are admitted and one is preempted as they grow; the tokens are each prompt's alone (the engine's are
    transformers')."""
    prompts = [text + llama4_prompt(QUESTION, 1) for text in ("One.", "Two!")]
    check_preemption(path, prompts, [WIDE], 60, expected=[greedy(engine, prompt, [WIDE])[0] for prompt in prompts])


def test_a_kv_budget_that_holds_the_context_only_with_the_chunks_freed(path):
    """The chunked layers keep only the current chunk's blocks, in a pool of their own: 282 prompt tokens and 40
    generated (81 blocks of 4) run in KV tensors of the bytes that, with every layer keeping every token, hold 31
    blocks; the tokens are transformers'. The same prompt again is a hit up to the last chunk boundary the pool allows."""
    prompt = llama4_prompt(LONG, 2)
    options = dict(max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine = tiny_engine(path, num_kv_blocks=84, sliding_kv_ratio=0.05, **options)
    runner, chunks = engine.runner, engine.scheduler.caches.windows
    assert isinstance(chunks, ChunkedAttentionManager)
    assert runner.num_window_blocks == runner.window_pool.min_blocks == 14  # null + cdiv(16 - 1 + 32, 4) + 1
    out = engine.generate(prompt, images=[WIDE, SQUARE], sampling_params=params, use_tqdm=False)[0]
    total = len(out.prompt_token_ids) + 40
    assert total == 322  # 81 blocks of 4
    assert out.token_ids == hf_greedy(path, prompt, [WIDE, SQUARE], 40, ignore_eos=True)
    assert chunks.num_freed_out_of_window >= total // 4 - 13
    assert_books_consistent(engine)
    # The same prompt again. Its prompt's last chunk (272..281) left the pool as the answer grew past 288, and those
    # blocks were reused: a hit ending inside that chunk would need them, one ending at its start (a chunk boundary)
    # needs no block of the chunked pool at all. So 272 of its 282 tokens are a hit.
    again = engine.generate(prompt, images=[WIDE, SQUARE], sampling_params=params, use_tqdm=False)[0]
    assert again.token_ids == out.token_ids and again.num_cached_tokens == 272
    assert_books_consistent(engine)
    kv_bytes = sum(group.numel() * group.element_size() for group in runner.kv_cache.groups)
    every_layer = tiny_engine(path, num_kv_blocks=kv_bytes // (runner.kv_block_bytes + runner.window_block_bytes),
                          sliding_kv_ratio=None, **options)
    assert every_layer.runner.window_pool is None and every_layer.kv_cache.num_blocks < total // 4
    with pytest.raises(PromptTooLongError, match="would not fit in the whole KV cache"):
        every_layer.generate(prompt, images=[WIDE, SQUARE], sampling_params=params, use_tqdm=False)


def test_decode_graph_steps_read_the_chunked_pool(path, engine):
    """Decode steps through the static graph buffers (on CPU the EagerCapturer stand-in), the chunked pool's slots
    and block tables among them, across chunk boundaries, give the eager steps' tokens."""
    from mmengine.runner.cuda_graphs import EagerCapturer

    graphs = tiny_engine(path, max_num_seqs=4)
    graphs.runner.capture_cuda_graphs(EagerCapturer())
    prompts = [llama4_prompt(LONG, 0), llama4_prompt(QUESTION, 1)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = greedy(graphs, prompts, [None, [WIDE]], params)
    assert graphs.runner.decode_graphs.num_replays >= 11
    assert outs == [greedy(engine, prompt, images, params)[0] for prompt, images in zip(prompts, [None, [WIDE]])]


def test_the_profiling_items_are_the_largest(engine):
    """dummy_items: a picture of the most tiles, whose encoder output fills the largest item's run."""
    (item,) = engine.family.dummy_items(1)
    (run,) = engine.runner.model.encode_items([item])
    assert run.shape == (engine.family.max_tokens_per_item(), 64) == (87, 64)


def test_bad_inputs_are_typed_errors(engine):
    check_bad_inputs(engine, llama4_prompt("What?", 1), [WIDE, SQUARE], embeds_width=64)


def test_demo_and_budget(path, tmp_path, capsys):
    shown = check_demo_and_budget("llama4", path, tmp_path, capsys)
    assert "at most 87" in shown and "3 chunked-attention layers of 16 tokens, 1 full-attention layers" in shown
    assert "4 experts a MoE layer, a token reads 1" in shown
