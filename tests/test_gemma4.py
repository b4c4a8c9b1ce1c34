"""Gemma 4 end to end against transformers (fp32, CPU): the tiny checkpoint has a window of 8 with
sliding and global layers of different shapes, K = V global layers, KV-shared layers, per-layer inputs
and pictures attended both ways on the sliding layers. Greedy tokens equal transformers' generate for
text past the window, one and two pictures, small prefill chunks (a chunk never ends inside a picture),
prefix hits and preemption, a prefix-sharing group in the smallest window pool; dropping the window or the
bidirectional spans changes the logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from books import assert_books_consistent
from conftest import KERNEL_FP32, hf_greedy, hf_logits
from types import SimpleNamespace
from unittest.mock import patch

from mmengine import MMEngine, SamplingParams
from mmengine.errors import CascadeLayoutError, ConfigError, PromptTooLongError
from mmengine.kernels.tiling import CascadeTileMismatch
from mmengine.layers import triton_attention
from mmengine.layers.attention import Attention
from mmengine.runner.cascade_plan import cascade_layer_shape
from mmengine.runner.cuda_graphs import EagerCapturer
from mmengine.testing.gemma4 import gemma4_prompt
from mmengine.testing.images import make_test_image

LONG_TEXT = "Tell me about the red square and the blue circle, then count to ten slowly, please."
PICTURES = [make_test_image(3, (64, 40)), make_test_image(4, (30, 90))]


@pytest.fixture(scope="module")
def path(family_checkpoint):
    return family_checkpoint("gemma4")


def _engine(path, **kwargs) -> MMEngine:
    options = dict(device="cpu", dtype="float32", max_model_len=512, enforce_eager=True)
    return MMEngine(str(path), **{**options, **kwargs})


def _greedy(engine: MMEngine, prompt: str, images: list, max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return engine.generate(prompt, images=images or None, sampling_params=params, use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_greedy_tokens_equal_transformers(path, num_images):
    """Prompts longer than the window, and 40 tokens generated past it."""
    prompt = gemma4_prompt(LONG_TEXT, num_images)
    images = PICTURES[:num_images]
    engine = _engine(path)
    assert _greedy(engine, prompt, images, 40) == hf_greedy(path, prompt, images, 40, ignore_eos=True)


def test_chunks_never_end_inside_a_picture(path):
    """A token budget of 80 would end the first chunk inside the second picture: the scheduler ends it
    at the picture's start instead, and the tokens are transformers'."""
    prompt = gemma4_prompt(LONG_TEXT, 2)
    engine = _engine(path, max_num_batched_tokens=80)
    assert _greedy(engine, prompt, PICTURES, 12) == hf_greedy(path, prompt, PICTURES, 12, ignore_eos=True)


def test_the_triton_kernels_give_the_same_tokens(path, no_tf32):
    """The Triton prefill (window, spans) and split-KV decode (window) kernels in the engine: two pictures
    in 80-token chunks (the interpreter on CPU, compiled on a GPU)."""
    prompt = gemma4_prompt(LONG_TEXT, 2)
    engine = _engine(path, max_num_batched_tokens=80, attn_backend="triton", **KERNEL_FP32.engine_kwargs)
    assert _greedy(engine, prompt, PICTURES, 6) == hf_greedy(path, prompt, PICTURES, 6, KERNEL_FP32, ignore_eos=True)


def test_cascade_on_the_triton_kernels_gives_transformers_tokens(path, no_tf32):
    """Cascade reaches only the global layers (the sliding ones are windowed), whose GQA group differs from
    the sliding layers' (1 KV head against 2): the step's layout is tiled for the global layers, which run
    the prefix pass; this used to stop every cascade step on a tile assertion. Three prompts share 32
    tokens (four blocks of 8), one goes on to a picture: eager prefill steps and decodes in cascade decode
    graphs (the CPU stand-in for the capture) give transformers' tokens (cascade off gives them too:
    test_the_triton_kernels_give_the_same_tokens)."""
    shared = "<bos><|turn>user\n" + "Q" * 26  # 32 tokens
    prompts = [shared + " please count to ten<turn|>\n<|turn>model\n", shared + " name a colour<turn|>\n<|turn>model\n",
               shared + "\n\n<|image|>\n\nwhat is this<turn|>\n<|turn>model\n"]
    images = [[], [], PICTURES[:1]]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine = _engine(path, attn_backend="triton", block_size=8, max_num_batched_tokens=100, max_num_seqs=4,
                     cascade_attention="auto", enforce_eager=False, **KERNEL_FP32.engine_kwargs)
    engine.runner.capture_cuda_graphs(EagerCapturer())
    steps, prefix_passes = [], []
    prepare, prefix_pass = engine.runner.inputs.prepare, triton_attention.cascade_prefix_attention

    def spied_prepare(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        steps.append((bool(inputs.cascade_groups), inputs.graph_cascade))
        return inputs

    def counted(query, *args, **kwargs):
        prefix_passes.append(tuple(query.shape[1:]))
        return prefix_pass(query, *args, **kwargs)

    engine.runner.inputs.prepare = spied_prepare
    with patch.object(triton_attention, "cascade_prefix_attention", counted), \
            patch("mmengine.runner.cascade_plan.MIN_SAVED_BYTES_PER_LAYER", 0):  # tiny K/V: always worth it
        outputs = engine.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [hf_greedy(path, p, i, 3, KERNEL_FP32, ignore_eos=True)
                                              for p, i in zip(prompts, images)]
    assert (True, False) in steps and (True, True) in steps  # eager cascade steps and cascade graph replays
    assert set(prefix_passes) == {(4, 32)}  # the global layers' heads and head size only


def test_the_cascade_layout_is_tiled_for_the_layers_that_take_it():
    """Gemma 4's shapes: the windowed layers (2 KV heads of 16) never take cascade, the global ones (1 of
    32) do, so the tile is theirs (4 query heads over 1: 16 tokens); without windows the layers holding
    the most K/V bytes decide, and a layer of another tile runs the step without cascade."""
    layout = [(2, 16), (2, 16), (1, 32), (2, 16)]
    shape = cascade_layer_shape(4, layout, [8, 8, None, 8], element_bytes=4)
    assert (shape.tokens_per_tile, shape.kv_bytes_per_token, shape.num_kv_heads) == (16, 2 * 32 * 4, 1)
    assert cascade_layer_shape(4, layout, [None] * 4, element_bytes=4).tokens_per_tile == 32  # 3 x 32 values per token against 32
    mismatch = CascadeTileMismatch("the layout's tiles hold 32 tokens, the kernel's 16")
    layer = Attention(4, 1, 32, scale=1.0)
    layer.layer_index, layer.kv_cache = 5, torch.zeros(2, 2, 8, 1, 32)
    layer.backend = type("Backend", (), {"forward": lambda *a, **k: (_ for _ in ()).throw(mismatch)})()
    metadata = SimpleNamespace(cascade=None, span_ends=None)
    with pytest.raises(CascadeLayoutError, match="attention layer 5: the layout's tiles hold 32"):
        layer._attend(torch.zeros(1, 4, 32), metadata, layer)


def test_a_budget_smaller_than_a_picture_is_refused(path):
    with pytest.raises(ConfigError, match="max_num_batched_tokens=32 cannot hold a whole picture of 70 tokens"):
        _engine(path, max_num_batched_tokens=32)


def test_prefix_hits_and_preemption_keep_the_tokens(path):
    prompt = gemma4_prompt(LONG_TEXT, 1)
    expected = hf_greedy(path, prompt, PICTURES[:1], 12, ignore_eos=True)
    engine = _engine(path, block_size=4)
    assert _greedy(engine, prompt, PICTURES[:1], 12) == expected
    assert engine.runner.num_encoder_runs == 1
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    again = engine.generate(prompt, images=PICTURES[:1], sampling_params=params, use_tqdm=False)[0]
    assert again.token_ids == expected and engine.runner.num_encoder_runs == 1  # the picture is not encoded again
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 4  # at most the last block recomputed
    # Two prompts that share no block, each 35 blocks of 4 and 38 once generated: both are admitted
    # into 72 blocks, and one is preempted as they grow
    prompts = [f"<bos>{text}<|turn>user\n\n\n<|image|>\n\n{LONG_TEXT}<turn|>\n<|turn>model\n" for text in ("One.", "Two!")]
    tight = _engine(path, block_size=4, num_kv_blocks=72, max_num_seqs=4)
    outs = tight.generate(prompts, images=[PICTURES[:1]] * 2, sampling_params=params, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    assert_books_consistent(tight)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, PICTURES[:1], 12, ignore_eos=True)


def test_a_kv_budget_that_holds_the_context_only_with_the_window_freed(path):
    """The sliding layers keep only their window's blocks, in a pool of their own: 134 prompt tokens and 40
    generated (44 blocks of 4) run in KV tensors of the bytes that, with every layer keeping every token,
    hold 29 blocks; the tokens are transformers'."""
    prompt = gemma4_prompt(LONG_TEXT, 1)
    options = dict(block_size=4, max_num_batched_tokens=80)
    engine = _engine(path, num_kv_blocks=44, sliding_kv_ratio=0.05, **options)
    runner, windows = engine.runner, engine.scheduler.caches.windows
    assert runner.num_window_blocks == runner.window_pool.min_blocks == 24  # null + cdiv(8 - 1 + 80, 4) + 1
    kv_bytes = sum(group.numel() * group.element_size() for group in runner.kv_cache.groups)
    assert _greedy(engine, prompt, PICTURES[:1], 40) == hf_greedy(path, prompt, PICTURES[:1], 40, ignore_eos=True)
    assert windows.num_freed_out_of_window >= 44 - 23
    assert_books_consistent(engine)
    every_layer = _engine(path, num_kv_blocks=kv_bytes // (runner.kv_block_bytes + runner.window_block_bytes),
                          sliding_kv_ratio=None, **options)
    assert every_layer.runner.window_pool is None and every_layer.kv_cache.num_blocks == 29
    with pytest.raises(PromptTooLongError, match="would not fit in the whole KV cache"):
        _greedy(every_layer, prompt, PICTURES[:1], 40)


def test_a_prefix_sharing_group_in_the_smallest_window_pool_finishes(path, monkeypatch):
    """The window pool at its minimum (the null block, a window of 8 and a 70-token chunk: 6 blocks of 16)
    and prefix-sharing groups on: two prompts share their first 32 tokens, the second goes on to a picture
    of 70 tokens at 44 (its chunk needs all 6 window blocks) and a clip. The group's hold on the window
    before the shared prefix's end gives way; it used to make the member preempt itself, be readmitted
    from its cached prefix, retake the hold and need the picture again, so generate() never returned.
    Now the batch takes 17 steps, and its tokens are those of the batch without grouping and transformers'."""
    clip = np.sin(2 * np.pi * 440 * np.arange(12_800) / 16_000).astype(np.float32) * 0.3  # 0.8 s: 20 tokens
    shared = "<bos><|turn>user\n" + "Q" * 26  # 32 tokens
    prompts = [shared + " please count to ten<turn|>\n<|turn>model\n",
               shared + "W" * 9 + "\n\n<|image|>\n\n\n\n<|audio|>\n\nwhat is this<turn|>\n<|turn>model\n"]
    picture = make_test_image(3, (100, 70))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runs = {}
    for grouping in (True, False):
        engine = _engine(path, block_size=16, num_kv_blocks=114, sliding_kv_ratio=0.01, max_num_batched_tokens=70,
                         enable_prefix_grouping=grouping, limit_mm_per_prompt={"image": 1, "audio": 1}, max_audio_seconds=2)
        assert engine.runner.num_window_blocks == engine.runner.window_pool.min_blocks == 1 + 6
        steps, schedule = 0, engine.scheduler.schedule

        def bounded_schedule():
            nonlocal steps
            steps += 1
            assert steps <= 40, "the batch makes no progress"
            return schedule()

        monkeypatch.setattr(engine.scheduler, "schedule", bounded_schedule)
        outs = engine.generate(prompts, images=[None, [picture]], audios=[None, [(clip, 16_000)]], sampling_params=params,
                               use_tqdm=False)
        items = engine.input_processor.process(prompts[1], [picture], params, audios=[(clip, 16_000)]).mm_items
        assert [(item.modality, item.offset, item.length) for item in items] == [("image", 44, 70), ("audio", 120, 20)]
        assert steps == 17 and engine.scheduler.num_preemptions == 0
        assert_books_consistent(engine)
        stats = engine.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["prefix_group_blocks_held"] == 0
        assert stats["prefix_groups_planned"] == grouping and stats["prefix_group_holds_released_early"] == grouping
        runs[grouping] = [out.token_ids for out in outs]
    assert runs[True] == runs[False]
    assert runs[True][0] == hf_greedy(path, prompts[0], [], 8, ignore_eos=True)
    assert runs[True][1] == hf_greedy(path, prompts[1], [picture], 8, ignore_eos=True, audios=[clip])


def test_budget_shows_each_pool_and_what_the_window_saves(path, capsys):
    from mmengine.cli import main

    assert main(["budget", "--model", str(path), "--device", "cpu", "--max-model-len", "512", "--block-size", "4",
                 "--sliding-kv-ratio", "0.25"]) == 0
    shown = capsys.readouterr().out
    # float32: sliding layers 3 x 2 KV heads x 16, the global layer 1 x 32, K and V
    assert "3 sliding-window layers of 8 tokens, 1 full-attention layers" in shown
    assert "full-attention pool, a token           256" in shown and "sliding-window pool, a token           768" in shown
    # a GiB holds 2**30 / (256 + 0.25 * 768) tokens of context against 2**30 / 1024
    assert f"tokens of context per GiB          {2**30 // 448}   (2.29x the {2**30 // 1024}" in shown
    assert "decoding at 512 tokens              140288   bytes a request holds (against 524288" in shown  # 512 x 256 + 12 x 768


def test_host_tier_hits_restore_the_full_layers_beside_the_window_pool(path):
    """The host tier keeps the full-attention pool's blocks: a prompt evicted from the device by three
    others comes back from host memory, its window from the window pool, with transformers' tokens."""
    engine = _engine(path, block_size=4, num_kv_blocks=60, kv_cache_host_bytes=1 << 22, max_num_batched_tokens=80)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = gemma4_prompt(LONG_TEXT, 0)
    first = engine.generate(prompt, sampling_params=params, use_tqdm=False)[0]
    for i in range(3):
        engine.generate(gemma4_prompt(f"Other {i}: {LONG_TEXT[::-1]}", 0), sampling_params=params, use_tqdm=False)
    again = engine.generate(prompt, sampling_params=params, use_tqdm=False)[0]
    assert engine.stats()["kv_host_hits"] > 0 and again.num_cached_tokens > len(again.prompt_token_ids) // 2
    assert first.token_ids == again.token_ids == hf_greedy(path, prompt, [], 6, ignore_eos=True)


def test_decode_graph_steps_read_the_window_pool(path):
    """Decode steps through the static graph buffers (on CPU the EagerCapturer stand-in), the window pool's
    slots and block tables among them, give transformers' tokens past the window."""
    from mmengine.runner.cuda_graphs import EagerCapturer

    engine = _engine(path, block_size=4, max_num_seqs=4)
    engine.runner.capture_cuda_graphs(EagerCapturer())
    prompts = [gemma4_prompt(LONG_TEXT, n) for n in (0, 1)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, images=[None, PICTURES[:1]], sampling_params=params, use_tqdm=False)
    assert engine.runner.decode_graphs.num_replays >= 10
    for n, out in enumerate(outs):
        assert out.token_ids == hf_greedy(path, prompts[n], PICTURES[:n], 12, ignore_eos=True)


@pytest.mark.parametrize("drop", ["window", "spans"])
def test_dropping_the_window_or_the_spans_changes_the_logits(path, monkeypatch, drop):
    """The next token's top-5 log-probabilities equal transformers'; without the window (or the
    bidirectional spans) on the sliding layers they do not."""
    prompt = gemma4_prompt(LONG_TEXT, 1)
    want = torch.log_softmax(hf_logits(path, prompt, PICTURES[:1]), -1).topk(5)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)

    def top5(engine: MMEngine) -> tuple[list[int], torch.Tensor]:
        top = engine.generate(prompt, images=PICTURES[:1], sampling_params=params, use_tqdm=False)[0].logprobs[0].top
        return [token for token, _ in top], torch.tensor([logprob for _, logprob in top])

    tokens, logprobs = top5(_engine(path))
    assert tokens == want.indices.tolist() and (logprobs - want.values).abs().max() < 1e-4
    engine = _engine(path)
    for module in engine.runner.model.modules():
        if isinstance(module, Attention):
            monkeypatch.setattr(module, "sliding_window" if drop == "window" else "bidirectional_spans", None if drop == "window" else False)
    tokens, logprobs = top5(engine)
    assert tokens != want.indices.tolist() or (logprobs - want.values).abs().max() > 1e-3


def test_a_picture_at_every_offset_from_a_block_boundary(path):
    """The divisible-block matrix with a picture whose tokens attend both ways: the picture starts at each
    offset from a block boundary, prompts whose length the block size divides included; identical
    requests twice and once more after, against prefix caching off. One encoder run, no re-encode after
    a prefix hit, and the same tokens."""
    kwargs = dict(block_size=4, encoder_cache_size=1)
    cached, plain = _engine(path, **kwargs), _engine(path, enable_prefix_caching=False, **kwargs)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    offsets, lengths = set(), set()
    for pad in range(8):
        prompt = "<bos>" + "x" * pad + gemma4_prompt("What is it?", 1).removeprefix("<bos>")
        first = cached.generate([prompt] * 2, images=[PICTURES[:1]] * 2, sampling_params=params, use_tqdm=False)
        again = cached.generate(prompt, images=PICTURES[:1], sampling_params=params, use_tqdm=False)
        reference = plain.generate(prompt, images=PICTURES[:1], sampling_params=params, use_tqdm=False)
        assert [o.token_ids for o in first + again] == [reference[0].token_ids] * 3
        assert again[0].num_cached_tokens > 0
        item = cached.input_processor.process(prompt, PICTURES[:1], params).mm_items[0]
        offsets.add(item.offset % 4)
        lengths.add(len(reference[0].prompt_token_ids) % 4)
    assert offsets == {0, 1, 2, 3} and 0 in lengths
    stats = cached.stats()
    assert stats["encoder_runs"] == 1 and stats["reencodes_after_prefix_hit"] == 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_moe_block_equals_transformers(backend, no_tf32, monkeypatch):
    """Gemma 4's mixture-of-experts block beside the dense MLP (the router reads the residual and scales
    each chosen expert): on the PyTorch experts path, and on the fused MoE kernel with GELU-tanh experts."""
    from dataclasses import replace

    from mmengine.testing.gemma4 import TinyGemma4Spec, tiny_gemma4_path

    path = tiny_gemma4_path(replace(TinyGemma4Spec(), enable_moe_block=True))
    prompt = gemma4_prompt(LONG_TEXT, 1 if backend == "torch" else 0)  # (the Triton kernels' pictures: the test above)
    precision = KERNEL_FP32 if backend == "triton" else None
    engine = _engine(path, attn_backend=backend, **(precision.engine_kwargs if precision else {}))
    layer = engine.runner.model.language_model.layers[0]
    assert layer.has_moe and layer.experts.num_experts > 1
    pictures, steps = (PICTURES[:1], 12) if backend == "torch" else ([], 4)
    expected = hf_greedy(path, prompt, pictures, steps, *([precision] if precision else []), ignore_eos=True)
    from mmengine.kernels import fused_moe as kernel_module

    calls, original = [], kernel_module.fused_moe
    monkeypatch.setattr(kernel_module, "fused_moe", lambda *a, **k: calls.append(k.get("activation")) or original(*a, **k))
    assert _greedy(engine, prompt, pictures, steps) == expected
    assert set(calls) == ({"gelu_pytorch_tanh"} if backend == "triton" else set())
