"""Gemma 3 end to end against transformers (fp32, CPU): the tiny checkpoint has six sliding layers of a
window of 8 and one global layer with linearly scaled RoPE, a query scale that is not the head size's, a
SigLIP tower whose 8x8 patches pool to 16 soft tokens, attended both ways on every layer. Greedy tokens
equal transformers' generate for text, one and two pictures, pictures across prefill-chunk boundaries, a
mixed batch, prefix hits and preemption, pan-and-scan crops (each an item of its own); the top
log-probabilities need the window and the spans; the window pool frees the blocks that left the window;
the published key layout loads, strictly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from books import assert_books_consistent
from conftest import KERNEL_FP32, hf_greedy, hf_logits
from family_checks import (check_bad_inputs, check_demo_and_budget, check_every_block_offset, check_key_layout, check_mixed_batch,
                           check_pictures_across_chunks, check_preemption, check_repeated_prompt, engine_fixtures, greedy,
                           nested_tower_name, tiny_engine)

from mmengine import SamplingParams
from mmengine.errors import ConfigError, ImageCountMismatchError, InvalidInputError, PromptTooLongError
from mmengine.layers.attention import Attention
from mmengine.testing.gemma3 import TinyGemma3Spec, gemma3_prompt, tiny_gemma3_path
from mmengine.testing.images import make_test_image

LONG_TEXT = "Tell me about the red square and the blue circle, then count to ten slowly, please."
PICTURES = [make_test_image(3, (64, 40)), make_test_image(4, (30, 90))]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


path, engine, uncached = engine_fixtures(tiny_gemma3_path)


def _greedy(engine, prompts, images, params: SamplingParams = GREEDY) -> list[list[int]]:
    return greedy(engine, prompts, images, params)


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_greedy_tokens_equal_transformers(path, engine, num_images):
    """Prompts past the window (68, 90 and 112 tokens), two pictures of different sizes, 16 tokens."""
    prompt = gemma3_prompt(LONG_TEXT, num_images)
    images = PICTURES[:num_images]
    assert _greedy(engine, prompt, images or None) == [hf_greedy(path, prompt, images, 16, ignore_eos=True)]


def test_the_chat_template_and_token_prompts_give_the_same_tokens(path, engine):
    """engine.chat writes the template's <start_of_image>; a token prompt holding the processor's expanded ids
    (each picture's 16 soft tokens), or one placeholder for the picture, gives the same tokens as the text."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    prompt = engine.input_processor.apply_chat_template(messages)
    assert prompt == gemma3_prompt("What is it?", 1)
    expected = hf_greedy(path, prompt, PICTURES[1:], 16, ignore_eos=True)
    chat = engine.chat(messages, images=[PICTURES[1]], sampling_params=GREEDY, use_tqdm=False)[0]
    assert chat.token_ids == expected
    ids = engine.input_processor.hf_processor(text=prompt, images=PICTURES[1:])["input_ids"][0]
    tokens = engine.generate({"prompt_token_ids": list(ids), "multi_modal_data": {"image": PICTURES[1]}}, sampling_params=GREEDY,
                             use_tqdm=False)[0]
    assert tokens.prompt_token_ids == chat.prompt_token_ids and tokens.token_ids == expected
    # one placeholder for the picture, without <start_of_image> / <end_of_image>: expanded with them
    config = engine.family.hf_config
    start = list(ids).index(config.boi_token_id)
    single = [*ids[:start], config.image_token_id, *ids[start + 18:]]
    tokens = engine.generate({"prompt_token_ids": single, "multi_modal_data": {"image": PICTURES[1]}}, sampling_params=GREEDY,
                             use_tqdm=False)[0]
    assert tokens.prompt_token_ids == chat.prompt_token_ids and tokens.token_ids == expected


def test_pictures_across_chunk_boundaries(path):
    """A budget of 24 tokens would end the first chunk inside the first picture (9..25) and the next inside
    the second (31..47): each ends at the picture's start instead, the picture is computed whole in the
    next chunk, and the tokens are transformers'."""
    items, chunks = check_pictures_across_chunks(path, gemma3_prompt(LONG_TEXT, 2), PICTURES, 24, min_split=0, params=GREEDY)
    assert [(item.offset, item.length) for item in items] == [(9, 16), (31, 16)]
    for item in items:
        assert any(end == item.offset and end - start < 24 for start, end in chunks)  # ended short, at the picture
        assert any(start <= item.offset and item.end <= end for start, end in chunks)  # then the picture whole
    with pytest.raises(ConfigError, match="max_num_batched_tokens=12 cannot hold a whole picture of 16 tokens"):
        tiny_engine(path, max_num_batched_tokens=12)


def test_a_mixed_batch_equals_each_prompt_alone(uncached):
    prompts = [gemma3_prompt(LONG_TEXT, 0), gemma3_prompt("What is it?", 1), gemma3_prompt("Compare them.", 2),
               gemma3_prompt("And this one?", 1)]
    check_mixed_batch(uncached, prompts, [None, PICTURES[:1], PICTURES, PICTURES[1:]], GREEDY)


def test_a_repeated_prompt_recomputes_one_block_and_encodes_its_picture_once(path, engine):
    check_repeated_prompt(path, engine, gemma3_prompt("Describe the picture in detail.", 1), [make_test_image(7, (50, 50))], GREEDY)


def test_a_picture_at_every_offset_from_a_block_boundary(path, uncached):
    """The divisible-block matrix with a picture attended both ways."""
    prompts = ["<bos>" + "x" * pad + gemma3_prompt("What is it?", 1).removeprefix("<bos>") for pad in range(8)]
    assert check_every_block_offset(tiny_engine(path, encoder_cache_size=16), uncached, prompts, PICTURES[:1]) == 1


def test_preemption_keeps_the_tokens(path):
    """Two prompts that share no block, each 23 blocks of 4 and 26 once generated, in 48 blocks: both are
    admitted and one is preempted as they grow."""
    prompts = [f"<bos>{text}" + gemma3_prompt(LONG_TEXT, 1).removeprefix("<bos>") for text in ("One.", "Two!")]
    check_preemption(path, prompts, PICTURES[:1], 48, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))


def test_a_kv_budget_that_holds_the_context_only_with_the_window_freed(path):
    """The sliding layers keep only their window's blocks, in a pool of their own: 90 prompt tokens and 40
    generated (33 blocks of 4) run in KV tensors of the bytes that, with every layer keeping every token,
    hold 16 blocks; the tokens are transformers'."""
    prompt = gemma3_prompt(LONG_TEXT, 1)
    options = dict(max_num_batched_tokens=40)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine = tiny_engine(path, num_kv_blocks=33, sliding_kv_ratio=0.05, **options)
    runner, windows = engine.runner, engine.scheduler.caches.windows
    assert runner.num_window_blocks == runner.window_pool.min_blocks == 14  # null + cdiv(8 - 1 + 40, 4) + 1
    kv_bytes = sum(group.numel() * group.element_size() for group in runner.kv_cache.groups)
    assert _greedy(engine, prompt, PICTURES[:1], params) == [hf_greedy(path, prompt, PICTURES[:1], 40, ignore_eos=True)]
    assert windows.num_freed_out_of_window >= 33 - 13
    assert_books_consistent(engine)
    every_layer = tiny_engine(path, num_kv_blocks=kv_bytes // (runner.kv_block_bytes + runner.window_block_bytes),
                          sliding_kv_ratio=None, **options)
    assert every_layer.runner.window_pool is None and every_layer.kv_cache.num_blocks == 16
    with pytest.raises(PromptTooLongError, match="would not fit in the whole KV cache"):
        _greedy(every_layer, prompt, PICTURES[:1], params)


def test_the_triton_kernels_give_the_same_tokens(path, no_tf32, monkeypatch):
    """The fused path: the rotary kernel rotates with each layer kind's table and stores K/V, the prefill
    kernel takes the window and the picture's span, the decode kernel the window (the interpreter on CPU,
    compiled on a GPU)."""
    from mmengine.kernels import rotary

    tables, store = [], rotary.rotary_store_kv
    monkeypatch.setattr(rotary, "rotary_store_kv", lambda *a, **k: tables.append(a[4].data_ptr()) or store(*a, **k))
    prompt = gemma3_prompt("What is it?", 1)
    engine = tiny_engine(path, attn_backend="triton", block_size=16, **KERNEL_FP32.engine_kwargs)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    assert _greedy(engine, prompt, PICTURES[:1], params) == [hf_greedy(path, prompt, PICTURES[:1], 2, KERNEL_FP32, ignore_eos=True)]
    assert len(tables) == 2 * 7 and len(set(tables)) == 2  # two steps of 7 layers, sliding and global tables


def test_decode_graph_steps_read_the_window_pool(path):
    """Decode steps through the static graph buffers (on CPU the EagerCapturer stand-in), the window pool's
    slots and block tables among them, give transformers' tokens past the window."""
    from mmengine.runner.cuda_graphs import EagerCapturer

    engine = tiny_engine(path, max_num_seqs=4)
    engine.runner.capture_cuda_graphs(EagerCapturer())
    prompts = [gemma3_prompt(LONG_TEXT, n) for n in (0, 1)]
    assert _greedy(engine, prompts, [None, PICTURES[:1]]) == [hf_greedy(path, prompts[n], PICTURES[:n], 16, ignore_eos=True)
                                                              for n in (0, 1)]
    assert engine.runner.decode_graphs.num_replays >= 10


@pytest.mark.parametrize("drop", [None, "window", "spans"])
def test_top_logprobs_need_the_window_and_the_spans(path, uncached, monkeypatch, drop):
    """The next token's top-5 log-probabilities equal transformers'; without the window on the sliding
    layers (or the pictures' bidirectional spans) they do not."""
    prompt = gemma3_prompt(LONG_TEXT, 2)
    want = torch.log_softmax(hf_logits(path, prompt, PICTURES), -1).topk(5)
    if drop is not None:
        for module in uncached.runner.model.modules():
            if isinstance(module, Attention):
                monkeypatch.setattr(module, "sliding_window" if drop == "window" else "bidirectional_spans",
                                    None if drop == "window" else False)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    top = uncached.generate(prompt, images=PICTURES, sampling_params=params, use_tqdm=False)[0].logprobs[0].top
    tokens, logprobs = [token for token, _ in top], torch.tensor([logprob for _, logprob in top])
    close = tokens == want.indices.tolist() and (logprobs - want.values).abs().max() < 1e-4
    assert close == (drop is None)


def test_bad_inputs_are_typed_errors(engine):
    check_bad_inputs(engine, gemma3_prompt("What is it?", 1), PICTURES, count_match="1 <start_of_image> marker")
    with pytest.raises(ImageCountMismatchError):
        engine.generate(gemma3_prompt("What is it?", 2), images=PICTURES[:1], sampling_params=GREEDY, use_tqdm=False)


def test_the_published_key_layout_loads_strictly(path, engine, tmp_path):
    """The hub's files name tensors `language_model.model.*`, `vision_tower.vision_model.*` and
    `multi_modal_projector.*` (the tiny checkpoint's tower is saved as `vision_tower.*`): they load to the same
    tokens; a missing tensor is named."""
    check_key_layout(path, engine, tmp_path, nested_tower_name, gemma3_prompt("What is it?", 1), PICTURES[:1],
                     "multi_modal_projector.mm_soft_emb_norm.weight", "mm_soft_emb_norm", GREEDY)


@pytest.fixture(scope="module")
def pan_and_scan_path():
    return tiny_gemma3_path(replace(TinyGemma3Spec(), do_pan_and_scan=True))


def test_pan_and_scan_crops_are_items_of_their_own(pan_and_scan_path):
    """With do_pan_and_scan in the checkpoint's settings a 200x60 picture is cut into 3 crops (a 50x50 one
    into none): the prompt is transformers' processor's given the settings, each crop is an item and
    an encoder-cache entry of its own, the tokens are transformers', and a repeated prompt encodes nothing."""
    from transformers import AutoProcessor

    path = pan_and_scan_path
    wide, square = make_test_image(5, (200, 60)), make_test_image(7, (50, 50))
    prompt = gemma3_prompt("Compare them.", 2)
    engine = tiny_engine(path)
    processed = engine.input_processor.process(prompt, [wide, square], GREEDY)
    # (transformers' processor hands the image processor its own pan-and-scan defaults: the saved ones given)
    reference = AutoProcessor.from_pretrained(str(path))(
        text=prompt, images=[wide, square], do_pan_and_scan=True, pan_and_scan_min_crop_size=32, pan_and_scan_max_num_crops=4,
        pan_and_scan_min_ratio_to_activate=1.2)
    assert processed.prompt_token_ids == list(reference["input_ids"][0])
    assert [item.length for item in processed.mm_items] == [16] * 5 and len({item.mm_hash for item in processed.mm_items}) == 5
    expected = hf_greedy(path, prompt, [wide, square], 16, ignore_eos=True)
    assert _greedy(engine, prompt, [wide, square]) == [expected]
    stats = engine.stats()
    assert stats["encoder_runs"] == 5 and stats["encoder_cache_entries"] == 5
    assert _greedy(engine, prompt, [wide, square]) == [expected] and engine.stats()["encoder_runs"] == 5
    with pytest.raises(InvalidInputError, match="pan-and-scan crops"):
        engine.generate({"prompt_token_ids": [2, engine.family.image_token_id, 5], "multi_modal_data": {"image": wide}},
                        sampling_params=GREEDY, use_tqdm=False)


def test_demo_and_budget(path, tmp_path, capsys):
    shown = check_demo_and_budget("gemma3", path, tmp_path, capsys)
    assert "average-pooled to mm_tokens_per_image 16; every image the same" in shown
    assert "6 sliding-window layers of 8 tokens, 1 full-attention layers" in shown
