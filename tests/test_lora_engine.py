"""LoRA adapters end to end: for each family, three PEFT adapters of different ranks and target
modules (built here with `peft` itself, random non-zero weights) give the greedy tokens of
transformers + PEFT's own generate, in one batch that mixes all three with base-model requests,
through chunked prefill, preemption and prefix hits; the caches keep adapters apart (prefill counts)
while the encoder cache is shared (encoder-run counts); more adapters than slots queue and load."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from conftest import CPU_FP32, KERNEL_FP32, REPRESENTATIVE_FAMILIES, FamilyCase, Precision, _hf_inputs, _hf_model

# Qwen3.5's hybrid decoder refuses LoRA at start-up (test_lora_on_a_hybrid_decoder_is_refused_by_name)
LORA_FAMILIES = [name for name in REPRESENTATIVE_FAMILIES if name != "qwen3_5"]  # SmolVLM's: test_smolvlm.py
from mmengine import LoRARequest, MMEngine, SamplingParams
from mmengine.testing import make_test_image

IMAGES = [make_test_image(900 + i, size=size) for i, size in enumerate([(64, 48), (100, 60), (40, 96)])]
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# Greedy tokens are compared exactly: mmengine runs where and in the dtype transformers + PEFT run (fp32;
# the engine's default would be the checkpoint's bf16 on a GPU)
ON_CPU = CPU_FP32.engine_kwargs


@functools.cache
def _peft_model(base_path: Path, adapter_dir: Path, precision: Precision = CPU_FP32):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(str(base_path), dtype=precision.dtype).eval()
    return PeftModel.from_pretrained(base, str(adapter_dir)).to(precision.device).eval()


def hf_lora_greedy(base_path: Path, adapter_dir: Path | None, prompt: str, images: list, max_new_tokens: int,
                   precision: Precision = CPU_FP32) -> list[int]:
    """transformers + PEFT's greedy tokens for one prompt (the base model's when adapter_dir is None)."""
    model = _peft_model(base_path, adapter_dir, precision) if adapter_dir is not None else _hf_model(base_path, precision)[0]
    inputs = _hf_inputs(_hf_model(base_path, precision)[1], prompt, images, precision)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _cases(family: FamilyCase) -> list[tuple[str, list, str | None]]:
    """(prompt, images, adapter) rows: every adapter and the base model, with and without pictures."""
    return [
        (family.prompt("Describe the picture in a few words.", 1), [IMAGES[0]], "qv4"),
        (family.prompt("Describe the picture in a few words.", 1), [IMAGES[0]], "all8"),
        (family.prompt("Tell me a story about a boat on the sea.", 0), [], "mlp2"),
        (family.prompt("Describe the picture in a few words.", 1), [IMAGES[0]], None),
        (family.prompt("Compare these two pictures.", 2), [IMAGES[1], IMAGES[2]], "all8"),
        (family.prompt("Compare these two pictures.", 2), [IMAGES[1], IMAGES[2]], "mlp2"),
        (family.prompt("Tell me a story about a boat on the sea.", 0), [], None),
    ]


def _run(engine: MMEngine, cases, adapters: dict[str, Path]) -> list[list[int]]:
    loras = [LoRARequest(name, str(adapters[name])) if name else None for _, _, name in cases]
    outs = engine.generate([c[0] for c in cases], images=[c[1] for c in cases], sampling_params=GREEDY,
                           lora=loras, use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("family_name", LORA_FAMILIES)
def test_mixed_adapter_batch_matches_transformers_and_peft(family_checkpoint, lora_adapters, family_name):
    family = FamilyCase(family_name, family_checkpoint(family_name))
    adapters = lora_adapters(family_name)
    cases = _cases(family)
    expected = [hf_lora_greedy(family.path, adapters[name] if name else None, prompt, images, MAX_TOKENS)
                for prompt, images, name in cases]
    assert len({tuple(e) for e in expected[:2] + [expected[3]]}) == 3, "the adapters must change the output"
    engine = MMEngine(str(family.path), max_model_len=512, enable_lora=True, max_loras=3, max_lora_rank=8, **ON_CPU)
    assert _run(engine, cases, adapters) == expected
    stats = engine.stats()
    assert stats["lora_adapters_registered"] == 3 and stats["lora_slot_loads"] == 3
    # chunked prefill that splits images gives the same tokens (with async scheduling too)
    chunked = MMEngine(str(family.path), max_model_len=512, enable_lora=True, max_loras=3, max_lora_rank=8,
                       max_num_batched_tokens=16, block_size=8, async_scheduling="on", **ON_CPU)
    assert _run(chunked, cases, adapters) == expected
    # and so does preemption on a tight KV cache (without prefix grouping, whose gate would avoid it)
    tight = MMEngine(str(family.path), max_model_len=512, enable_lora=True, max_loras=3, max_lora_rank=8,
                     block_size=4, num_kv_blocks=40, enable_prefix_grouping=False, **ON_CPU)
    assert _run(tight, cases, adapters) == expected
    assert tight.stats()["num_preemptions"] > 0
    # a second round hits the prefix cache under each adapter and still matches
    again = _run(engine, cases, adapters)
    assert again == expected and engine.stats()["prefix_cache_hits"] > 0


def test_adapters_never_share_kv_blocks_but_share_encoder_outputs(family_checkpoint, lora_adapters):
    path = family_checkpoint("llava")
    adapters = lora_adapters("llava")
    family = FamilyCase("llava", path)
    prompt = family.prompt("Describe the picture in a few words, please, with all the details you see.", 1)
    engine = MMEngine(str(path), max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=8,
                      enable_prefix_grouping=False)

    def prefill(lora) -> int:
        before = engine.stats()["prefill_tokens_computed"]
        engine.generate(prompt, images=[IMAGES[0]], sampling_params=GREEDY, lora=lora, use_tqdm=False)
        return engine.stats()["prefill_tokens_computed"] - before

    full = prefill(LoRARequest("qv4", str(adapters["qv4"])))
    assert prefill("qv4") == 1  # the same adapter: a full prefix hit recomputes the last token only
    assert prefill(LoRARequest("all8", str(adapters["all8"]))) == full  # another adapter: computed again
    assert prefill(None) == full  # the base model never sees an adapter's blocks
    assert engine.stats()["encoder_runs"] == 1  # language-model adapters share the picture's encoder output


def test_more_adapters_than_slots_queue_and_load_in_turn(family_checkpoint, lora_adapters):
    path = family_checkpoint("qwen2_vl")
    adapters = lora_adapters("qwen2_vl")
    family = FamilyCase("qwen2_vl", path)
    cases = _cases(family)
    expected = [hf_lora_greedy(path, adapters[name] if name else None, prompt, images, MAX_TOKENS)
                for prompt, images, name in cases]
    engine = MMEngine(str(path), max_model_len=512, enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=2, **ON_CPU)
    assert _run(engine, cases, adapters) == expected
    stats = engine.stats()
    assert stats["lora_slot_loads"] >= 3 and stats["lora_slot_evictions"] >= 2 and stats["lora_slots_used"] == 1
    assert stats["lora_disk_reads"] > 3  # three adapters through two host copies: one was read again


def test_the_triton_path_matches_transformers(family_checkpoint, lora_adapters, no_tf32):
    """The Triton attention backend (Triton's interpreter on a CPU, compiled on a GPU) takes the
    segmented LoRA kernels in the engine: the same tokens as transformers + PEFT, both in fp32 (true
    fp32: TF32 off) on the device the kernels run on."""
    family = FamilyCase("qwen2_5_vl", family_checkpoint("qwen2_5_vl"))
    adapters = lora_adapters("qwen2_5_vl")
    cases = _cases(family)[:4]
    expected = [hf_lora_greedy(family.path, adapters[name] if name else None, prompt, images, 4, KERNEL_FP32)
                for prompt, images, name in cases]
    engine = MMEngine(str(family.path), max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8,
                      attn_backend="triton", max_num_batched_tokens=24, **KERNEL_FP32.engine_kwargs)
    assert engine.runner.lora_context.use_kernels
    loras = [LoRARequest(name, str(adapters[name])) if name else None for _, _, name in cases]
    outs = engine.generate([c[0] for c in cases], images=[c[1] for c in cases],
                           sampling_params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), lora=loras, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected


def test_decode_steps_with_adapters_replay_the_lora_graph_variant(family_checkpoint, lora_adapters):
    """With decode graphs (the CPU stand-in for CUDA graphs), a decode step whose rows run adapters
    replays its bucket's LoRA variant (per-row slots in a persistent buffer, -1 for base rows and
    padding), a step without adapters replays the base variant, and the tokens equal eager steps'."""
    from mmengine.runner.cuda_graphs import EagerCapturer

    family = FamilyCase("llava", family_checkpoint("llava"))
    adapters = lora_adapters("llava")
    cases = _cases(family)
    results = {}
    for graphs in (False, True):
        engine = MMEngine(str(family.path), device="cpu", max_model_len=512, max_num_seqs=8, enable_lora=True, max_loras=3,
                          max_lora_rank=8)
        if graphs:
            engine.runner.capture_cuda_graphs(EagerCapturer())
            assert engine.runner.decode_graphs.variants(4) == [(False, False), (False, True)]
        results[graphs] = _run(engine, cases, adapters)
        if graphs:
            decode_graphs = engine.runner.decode_graphs
            assert decode_graphs.num_lora_replays >= MAX_TOKENS - 2  # the mixed batch decodes in the LoRA variant
            replays, lora_replays = decode_graphs.num_replays, decode_graphs.num_lora_replays
            engine.generate(cases[-1][0], sampling_params=GREEDY, use_tqdm=False)  # the base model alone
            assert decode_graphs.num_replays - replays >= MAX_TOKENS - 2
            assert decode_graphs.num_lora_replays == lora_replays  # base-only steps take the base variant
    assert results[True] == results[False]


# LoRA on the vision side too: layers of the tower, the projector (merger) and one decoder projection.
VISION_TARGETS = {
    "llava": r".*(vision_tower.*\.(q_proj|fc1)|multi_modal_projector\.linear_1|language_model.*\.v_proj)",
    "qwen2_vl": r".*(visual\.blocks.*\.(qkv|fc2)|visual\.merger\.mlp\.0|language_model.*\.q_proj)",
    "qwen2_5_vl": r".*(visual\.blocks.*\.(qkv|down_proj)|visual\.merger\.mlp\.2|language_model.*\.q_proj)",
    # Qwen3-VL: a DeepStack merger too, so the adapter changes the levels the decoder layers add
    "qwen3_vl": r".*(visual\.blocks.*\.(qkv|linear_fc2)|visual\.deepstack_merger_list\.0\.linear_fc1|language_model.*\.q_proj)",
}


@pytest.mark.parametrize("family_name", LORA_FAMILIES)
def test_an_adapter_on_the_vision_side_matches_peft_and_keys_its_own_encoder_outputs(
    family_checkpoint, lora_adapters, tmp_path, family_name
):
    from conftest import save_peft_adapter

    family = FamilyCase(family_name, family_checkpoint(family_name))
    vision_dir = save_peft_adapter(family.path, tmp_path / "vision", 4, 8, False, VISION_TARGETS[family_name], seed=11)
    adapters = {**lora_adapters(family_name), "vis": vision_dir}
    prompt = family.prompt("Describe the picture in a few words.", 1)
    cases = [(prompt, [IMAGES[0]], "vis"), (prompt, [IMAGES[0]], None), (prompt, [IMAGES[0]], "qv4"),
             (family.prompt("Compare these two pictures.", 2), [IMAGES[1], IMAGES[0]], "vis")]
    expected = [hf_lora_greedy(family.path, adapters[name] if name else None, p, images, MAX_TOKENS)
                for p, images, name in cases]
    engine = MMEngine(str(family.path), max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=8, **ON_CPU)
    assert _run(engine, cases, adapters) == expected
    stats = engine.stats()
    assert stats["lora_adapters_on_vision"] == 1
    # IMAGES[0] once for the base model and the language-model adapter together, once under "vis";
    # IMAGES[1] once, under "vis"
    assert stats["encoder_runs"] == 3
    assert _run(engine, cases, adapters) == expected and engine.stats()["encoder_runs"] == 3  # all cached now


def test_lora_on_a_hybrid_decoder_is_refused_by_name(family_checkpoint):
    from mmengine.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="LoRA adapters are not supported on Qwen3.5"):
        MMEngine(str(family_checkpoint("qwen3_5")), enable_lora=True, max_loras=1, max_lora_rank=8)
