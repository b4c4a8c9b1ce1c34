"""Every supported model family through the public API: greedy tokens equal transformers' own
model class's `generate` (fp32), and the encoder cache, prefix cache and scheduler hold for items of
any size (Qwen2-VL's images become 4 to 64 tokens here; LLaVA's are all the same size). The
divisible-block matrix (the image in the recomputed last block) runs on every family of conftest.FAMILIES."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from conftest import CPU_FP32, KERNEL_FP32, REPRESENTATIVE_FAMILIES, FamilyCase, hf_greedy
from mmengine import MMEngine, SamplingParams
from mmengine.core.request import MMItem
from mmengine.errors import ImageCountMismatchError, ItemTooLargeError
from mmengine.testing import make_test_image

# Sizes that the tiny Qwen processor turns into 4, 8, 8, 25, 28 and 64 tokens (LLaVA: 16 each).
SIZES = [(64, 48), (100, 60), (40, 96), (150, 150), (200, 120), (224, 224)]
IMAGES = [make_test_image(300 + i, size=size) for i, size in enumerate(SIZES)]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
FIXED = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
# The parity and scheduling checks below that each family's own test file also makes (batches, chunked prefill,
# preemption, prefix hits) run on the representative families; the divisible-block matrix and the cheap checks on all
representative = pytest.mark.parametrize("family", REPRESENTATIVE_FAMILIES, indirect=True)


def _cases(family: FamilyCase) -> list[tuple[str, list]]:
    return [
        (family.prompt("Tell me a story about a boat."), []),
        (family.prompt("What is shown here?", 1), [IMAGES[0]]),
        (family.prompt("Compare the two pictures in detail please.", 2), [IMAGES[1], IMAGES[3]]),
        (family.prompt("Describe it.", 1), [IMAGES[4]]),
        (family.prompt("Which is larger?", 2), [IMAGES[5], IMAGES[2]]),
    ]


def _expected(family: FamilyCase, cases, max_tokens: int = MAX_TOKENS, precision=CPU_FP32) -> list[list[int]]:
    return [hf_greedy(family.path, prompt, images, max_tokens, precision) for prompt, images in cases]


def _items(engine: MMEngine, cases) -> list[MMItem]:
    """The encoder-cache items of the cases' pictures (several a picture where a family tiles it)."""
    return [item for prompt, images in cases for item in engine.input_processor.process(prompt, images, GREEDY).mm_items]


@pytest.fixture(scope="module")
def shared_engine() -> Iterator[Callable[..., MMEngine]]:
    """shared_engine(family, **options): one engine per family and options for the module, for the tests that only
    prepare inputs or serve references on it (prefix caching off, or nothing generated), so no test reads what another
    left in its caches. Each engine build loads the family's processor and weights: ~0.2-0.4 s of CPU."""
    engines: dict[tuple, MMEngine] = {}

    def get(family: FamilyCase, **options) -> MMEngine:
        key = (family.name, tuple(sorted(options.items())))
        if key not in engines:
            engines[key] = MMEngine(str(family.path), **options)
        return engines[key]

    yield get
    for engine in engines.values():
        engine.shutdown()


def _generate(engine: MMEngine, cases, params: SamplingParams = GREEDY):
    return engine.generate([c[0] for c in cases], images=[c[1] for c in cases], sampling_params=params, use_tqdm=False)


@representative
def test_a_batch_of_varied_images_matches_transformers(family):
    """No image, one image, two images of different sizes in one prompt, and six sizes in one batch."""
    engine = MMEngine(str(family.path), max_model_len=512, dtype="float32", device="cpu")
    cases = _cases(family)
    outputs = _generate(engine, cases)
    assert [o.token_ids for o in outputs] == _expected(family, cases)
    lengths = {item.length for item in _items(engine, cases)}
    assert len(lengths) >= (4 if family.name != "llava" else 1)  # the batch really mixes item sizes


@representative
def test_chunked_prefill_splitting_an_image_matches_transformers(family):
    """A token budget smaller than an image: the image is encoded once and its run spans several steps."""
    cases = _cases(family)[2:]
    engine = MMEngine(str(family.path), max_model_len=512, dtype="float32", device="cpu", max_num_batched_tokens=12, block_size=4)
    outputs = _generate(engine, cases)
    assert [o.token_ids for o in outputs] == _expected(family, cases)
    items = _items(engine, cases)
    assert max(item.length for item in items) > 12
    assert engine.stats()["encoder_runs"] == len(items)


@representative
def test_preemption_matches_transformers(family):
    cases = _cases(family)[1:]
    # (without prefix grouping, whose admission gate would avoid the preemptions this test needs)
    engine = MMEngine(str(family.path), max_model_len=256, dtype="float32", device="cpu", block_size=4, num_kv_blocks=40,
                      enable_prefix_grouping=False)
    outputs = _generate(engine, cases, SamplingParams(max_tokens=24, temperature=0.0))
    assert engine.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outputs] == _expected(family, cases, max_tokens=24)


@representative
def test_a_repeated_conversation_hits_the_prefix_cache_and_matches_transformers(family):
    engine = MMEngine(str(family.path), max_model_len=512, dtype="float32", device="cpu", block_size=4)
    first = family.prompt("What is in this picture?", 1)
    (turn1,) = engine.generate(first, images=[IMAGES[3]], sampling_params=GREEDY, use_tqdm=False)
    second = family.continue_chat(first, turn1.text, "And this one?", 1)
    (turn2,) = engine.generate(second, images=[IMAGES[3], IMAGES[1]], sampling_params=GREEDY, use_tqdm=False)
    assert turn1.token_ids == hf_greedy(family.path, first, [IMAGES[3]], MAX_TOKENS)
    assert turn2.token_ids == hf_greedy(family.path, second, [IMAGES[3], IMAGES[1]], MAX_TOKENS)
    assert turn2.num_cached_tokens >= len(turn1.prompt_token_ids) // 4 * 4 - 4
    stats = engine.stats()
    assert stats["encoder_runs"] == len(_items(engine, [(second, [IMAGES[3], IMAGES[1]])]))
    assert stats["reencodes_after_prefix_hit"] == 0


@representative
def test_a_mixed_size_workload_encodes_each_distinct_image_once(family):
    """Tight KV and encoder budgets (one largest item a step), so requests wait for the encoder."""
    engine = MMEngine(str(family.path), max_model_len=512, dtype="float32", device="cpu", block_size=8,
                      max_num_batched_tokens=48, num_kv_blocks=48, encoder_cache_size=1)
    prompts, images = [], []
    for i in range(18):
        picks = [IMAGES[(i * 5) % 6], IMAGES[(i * 7 + 1) % 6]][: 1 + i % 2]
        prompts.append(family.prompt(f"Question {i % 4}: what differs?", len(picks)))
        images.append(picks)
    outputs = engine.generate(prompts, images=images, sampling_params=FIXED, use_tqdm=False)
    assert all(len(o.token_ids) == 4 for o in outputs)
    stats = engine.stats()
    assert stats["encoder_runs"] == len({item.mm_hash for item in _items(engine, list(zip(prompts, images)))})
    assert stats["reencodes_after_prefix_hit"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # no leaks
    plain = MMEngine(str(family.path), max_model_len=512, dtype="float32", device="cpu", enable_prefix_caching=False)
    reference = plain.generate(prompts, images=images, sampling_params=FIXED, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]  # no wrong reuse


@representative
def test_zero_token_steps_with_variable_items_are_harmless(family):
    """The smallest encoder budget (the largest item) and items of 64 and 28 tokens (Qwen2; Qwen3: 70 and 44): requests
    wait at their image with zero tokens, then finish with the outputs of prefix caching off."""
    sizes = [(224, 224), (200, 120)] * 3
    if family.name in ("qwen3_vl", "qwen3_5"):  # 32-pixel merged patches: thin pictures of 70 tokens, two to the budget's 98
        sizes = [(30, 3000), (32, 1400)] * 3
    images = [[make_test_image(400 + i, size=size)] for i, size in enumerate(sizes)]
    prompts = ["x" + " word" * i + family.image_marker + " Describe." for i in range(len(images))]
    kwargs = dict(max_model_len=256, block_size=8, encoder_cache_size=1, dtype="float32", device="cpu")
    cached = MMEngine(str(family.path), **kwargs)
    plain = MMEngine(str(family.path), enable_prefix_caching=False, **kwargs)
    ours = cached.generate(prompts, images=images, sampling_params=FIXED, use_tqdm=False)
    assert cached.scheduler.num_zero_token_schedules > 0
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain.generate(prompts, images=images, sampling_params=FIXED, use_tqdm=False)]
    assert cached.encoder_cache.num_referenced == 0


def _prompt_with_image_placed(engine: MMEngine, family: FamilyCase, image, block_size: int, placement: str) -> str:
    """A one-image prompt whose length is a multiple of block_size, the image (its last item, where a family
    tiles it) placed as asked. "ends_at_prompt_end": the prompt ends with the bare marker, so the picture ends
    the prompt, or ends in its last block where the family writes tokens after each picture."""
    marker = family.image_token if placement == "ends_at_prompt_end" else family.image_marker
    for pad in range(0, 60):
        for tail in ["", " x", " what", " what is it"]:
            tail = "" if placement == "ends_at_prompt_end" else tail
            prompt = "x" + " a" * pad + marker + tail
            processed = engine.input_processor.process(prompt, [image], FIXED)
            n, item = len(processed.prompt_token_ids), processed.mm_items[-1]
            if n % block_size or n < 2 * block_size:
                continue
            if placement == "ends_in_last_full_block" and n - block_size < item.end < n:
                return prompt
            if placement == "ends_at_prompt_end" and n - block_size < item.end <= n:
                return prompt
            if placement == "spans_blocks" and item.length > 2 * block_size and item.end < n:
                return prompt
    raise AssertionError(f"no prompt for placement={placement}")


@pytest.mark.parametrize("placement", ["ends_in_last_full_block", "ends_at_prompt_end", "spans_blocks"])
@pytest.mark.parametrize("copies", [2, 5])
def test_identical_requests_with_the_image_in_the_recomputed_block(family, shared_engine, placement, copies):
    """vLLM's #11895 crash, with items of any size: prompt length divisible by the block size, the
    image in (or reaching) the recomputed last block, the smallest encoder budget. No crash, the
    outputs of prefix caching off, one encode, and a later full hit."""
    image = IMAGES[3] if placement == "spans_blocks" else IMAGES[1]
    kwargs = dict(max_model_len=256, block_size=4, encoder_cache_size=1, dtype="float32", device="cpu")
    cached = MMEngine(str(family.path), **kwargs)
    plain = shared_engine(family, enable_prefix_caching=False, **kwargs)  # the reference: no cache to carry between cases
    prompt = _prompt_with_image_placed(cached, family, image, 4, placement)
    outputs = cached.generate([prompt] * copies, images=[[image]] * copies, sampling_params=FIXED, use_tqdm=False)
    again = cached.generate(prompt, images=[image], sampling_params=FIXED, use_tqdm=False)
    reference = plain.generate([prompt] * copies, images=[[image]] * copies, sampling_params=FIXED, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference] == [again[0].token_ids] * copies
    stats = cached.stats()
    assert stats["encoder_runs"] == len(_items(cached, [(prompt, [image])])) and stats["reencodes_after_prefix_hit"] == 0
    assert again[0].num_cached_tokens > 0
    assert cached.encoder_budget.compute_budget_tokens == cached.family.max_tokens_per_item()  # the smallest budget


def test_an_image_too_large_for_max_model_len_is_a_typed_error_naming_prompt_and_image(family, shared_engine):
    big = IMAGES[5]  # 64 tokens for the Qwen families, 16 for LLaVA
    probe = shared_engine(family, max_model_len=256, dtype="float32", device="cpu")  # (its input processor only)
    tokens = probe.input_processor.process(family.prompt("hi", 1), [big], FIXED).mm_items[0].length
    engine = MMEngine(str(family.path), max_model_len=tokens, dtype="float32", device="cpu")
    with pytest.raises(ItemTooLargeError) as err:
        engine.generate(["hi", family.prompt("hi", 1)], images=[[], [big]], sampling_params=FIXED, use_tqdm=False)
    message = str(err.value)
    assert "prompt 1" in message and "image 0" in message and f"max_model_len={tokens}" in message
    (ok,) = engine.generate("hi", sampling_params=FIXED, use_tqdm=False)  # the engine still serves
    assert len(ok.token_ids) == 4


def test_more_image_markers_than_images_is_a_typed_error(family, shared_engine):
    engine = shared_engine(family, max_model_len=256, dtype="float32", device="cpu")  # refused before it is scheduled
    with pytest.raises(ImageCountMismatchError, match="2 .*marker.*1 image"):
        engine.generate(family.prompt("two?", 2), images=[IMAGES[0]], sampling_params=FIXED, use_tqdm=False)


def test_chat_renders_the_family_template_and_matches_generate(family):
    engine = MMEngine(str(family.path), max_model_len=512, dtype="float32", device="cpu")
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    (chat,) = engine.chat(conversation, images=[IMAGES[3]], sampling_params=FIXED)
    prompt = engine.input_processor.apply_chat_template(conversation)
    assert prompt.count(family.image_token) == 1
    (direct,) = engine.generate(prompt, images=[IMAGES[3]], sampling_params=FIXED, use_tqdm=False)
    assert chat.token_ids == direct.token_ids and len(chat.token_ids) == 4


def test_decode_graph_steps_give_the_eager_tokens(family):
    """Decode steps through the static graph buffers (positions [N, 3] for M-RoPE, shifted by each
    request's delta) give the eager tokens. On CPU the capture is the EagerCapturer stand-in."""
    from mmengine.runner.cuda_graphs import EagerCapturer

    cases = _cases(family)
    results = {}
    for graphs in (False, True):
        engine = MMEngine(str(family.path), device="cpu", dtype="float32", max_model_len=512, max_num_seqs=8)
        if graphs:
            engine.runner.capture_cuda_graphs(EagerCapturer())
        results[graphs] = [o.token_ids for o in _generate(engine, cases, FIXED)]
        if graphs:
            assert engine.runner.decode_graphs.num_replays >= 3
    assert results[True] == results[False]


# LLaVA's: test_fused_engine.py, test_triton_engine.py; Qwen2-VL's decoder (and so its Triton path) is Qwen2.5-VL's
@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_triton_backend_with_fused_kernels_matches_transformers(family_checkpoint, exact_precision, name):
    """The Triton attention backend and the fused kernels (M-RoPE rotary + K/V store included), in
    Triton's interpreter on CPU (compiled on a GPU), against transformers."""
    if exact_precision.device == "cpu" and torch.cuda.is_available():
        pytest.skip("with a GPU present Triton compiles for CUDA: the cuda-fp32 variant runs this check")
    family = FamilyCase(name, family_checkpoint(name))
    cases = _cases(family)[1:3]
    engine = MMEngine(str(family.path), max_model_len=256, attn_backend="triton", enforce_eager=True, **exact_precision.engine_kwargs)
    outputs = _generate(engine, cases, SamplingParams(max_tokens=4, temperature=0.0))
    assert [o.token_ids for o in outputs] == _expected(family, cases, max_tokens=4, precision=exact_precision)


@representative
def test_cascade_attention_on_gives_the_tokens_of_off(family):
    """Shared-prefix groups with images in the prefix, for every family (M-RoPE rotates before the
    cascade decomposition, which only regroups attention)."""
    system = family.prompt("Look carefully at these pictures and answer briefly, please, in detail.", 2)
    prompts = [system + f" q{i} " + "word " * (i % 3) for i in range(6)]
    images = [[IMAGES[3], IMAGES[1]]] * 3 + [[IMAGES[4], IMAGES[0]]] * 3
    results = {}
    for mode in ("on", "off"):
        engine = MMEngine(str(family.path), dtype="float32", device="cpu", max_model_len=256, block_size=4,
                          cascade_attention=mode)
        results[mode] = ([o.token_ids for o in engine.generate(prompts, images=images, sampling_params=FIXED, use_tqdm=False)],
                         engine.stats())
    assert results["on"][0] == results["off"][0]
    assert results["on"][1]["cascade_steps"] > 0 and results["on"][1]["cascade_groups"] >= 2
    assert results["off"][1]["cascade_steps"] == 0


# (Qwen3-VL-MoE on the Triton kernels, experts and all, against transformers: test_moe.py; its attention is Qwen3-VL's)
@pytest.mark.parametrize("family_name", ["qwen3_5", "qwen3_5_moe"])
def test_cascade_on_the_triton_kernels_of_the_hybrid_and_moe_families(family_checkpoint, family_name, no_tf32):
    """Qwen3.5's gated attention with partial rotary, and its MoE family, on the Triton kernels (the
    interpreter on a CPU): requests sharing a prefix with a picture run cascade steps and give
    transformers' tokens."""
    family = FamilyCase(family_name, family_checkpoint(family_name))
    system = family.prompt("Look carefully at this picture and answer briefly, please, in detail.", 1)
    cases = [(system + f" q{i}", [IMAGES[3]]) for i in range(3)]
    engine = MMEngine(str(family.path), max_model_len=256, block_size=4, attn_backend="triton", cascade_attention="on",
                      enforce_eager=True, **KERNEL_FP32.engine_kwargs)
    first = _generate(engine, cases[:1], FIXED)  # its blocks are cached: the next two share them with each other
    outputs = _generate(engine, cases[1:], FIXED)
    assert [o.token_ids for o in first + outputs] == _expected(family, cases, max_tokens=4, precision=KERNEL_FP32)
    assert engine.stats()["cascade_steps"] > 0
