"""The FP8 KV cache (kv_cache_dtype="fp8"): e4m3 values divided by per-layer scales (the checkpoint's,
else 1.0). The store kernels write the bits torch's cast writes; the attention kernels read it as the
reference does; logits stay within a stated tolerance of the full-precision cache; the checkpoint's
scales are used; the same memory holds twice bf16's blocks; the host tier carries FP8 blocks."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import KERNEL_FP32
from mmengine import MMEngine, SamplingParams
from mmengine.errors import ConfigError, WeightsMismatchError
from mmengine.kernels.kv_quant import quantize_e4m3
from mmengine.kernels.kv_store import store_kv
from mmengine.kernels.rotary import rotary_store_kv
from mmengine.layers.rotary import build_cos_sin_table
from mmengine.testing import make_test_image

# FP8 against the fp32 cache on the tiny fp32 models. e4m3 keeps 3 mantissa bits (bf16 keeps 7), so each
# K/V element moves by up to 6%. Measured on CPU over 16 greedy steps (logits of spread ~1.6, magnitude
# up to ~6): max abs differences up to 0.82 (LLaVA), 0.69 (Qwen2.5-VL), 0.59 (Qwen3-VL), 0.013 (Qwen3.5,
# whose attention is 1 layer of 4); means up to 0.18. A different picture moves them by mean ~1.5.
FP8_MAX_ABS = 1.2
FP8_MEAN_ABS = 0.3
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PICTURE = make_test_image(3, size=(64, 48))


def _prompt(name: str) -> str:
    if name == "llava":
        return "USER: <image>\nWhat is in the picture, tell me in detail please? ASSISTANT:"
    return ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in the picture, tell me in detail "
            "please?<|im_end|>\n<|im_start|>assistant\n")


def _greedy_logits(path, name: str, kv_cache_dtype: str, picture=PICTURE) -> tuple[MMEngine, list[int], list[torch.Tensor]]:
    """The greedy tokens and each step's logits (fp32 on CPU)."""
    engine = MMEngine(str(path), device="cpu", dtype="float32", max_model_len=256, kv_cache_dtype=kv_cache_dtype)
    captured: list[torch.Tensor] = []
    compute_logits = engine.runner.model.compute_logits
    engine.runner.model.compute_logits = lambda h: captured.append(compute_logits(h)) or captured[-1]
    (out,) = engine.generate(_prompt(name), images=[picture], sampling_params=GREEDY, use_tqdm=False)
    return engine, out.token_ids, [rows[-1] for rows in captured]


def assert_within_fp8_tolerance(ours: list[torch.Tensor], reference: list[torch.Tensor], tokens: list[int],
                                reference_tokens: list[int]) -> None:
    """Every step up to the first token that differs: logits within the tolerance."""
    agree = next((i for i, (a, b) in enumerate(zip(tokens, reference_tokens)) if a != b), len(tokens))
    for step in range(min(agree + 1, len(tokens))):
        diff = (ours[step] - reference[step]).abs()
        assert diff.max() <= FP8_MAX_ABS and diff.mean() <= FP8_MEAN_ABS, (step, diff.max().item(), diff.mean().item())


@pytest.mark.parametrize("name", ["llava", "qwen2_5_vl", "qwen3_5"])
def test_the_fp8_cache_stays_within_its_tolerance_of_the_full_cache(family_checkpoint, name, caplog):
    path = family_checkpoint(name)
    _, reference_tokens, reference = _greedy_logits(path, name, "auto")
    with caplog.at_level(logging.WARNING):
        engine, tokens, ours = _greedy_logits(path, name, "fp8")
    assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert "use 1.0" in caplog.text  # the tiny checkpoints have no scales: the choice is named
    assert not torch.equal(ours[0], reference[0])  # the cache really is coarser
    assert_within_fp8_tolerance(ours, reference, tokens, reference_tokens)


def test_the_tolerance_catches_a_wrong_picture(family_checkpoint):
    path = family_checkpoint("llava")
    _, reference_tokens, reference = _greedy_logits(path, "llava", "auto")
    _, tokens, wrong = _greedy_logits(path, "llava", "auto", picture=make_test_image(4, size=(64, 48)))
    with pytest.raises(AssertionError):
        assert_within_fp8_tolerance(wrong, reference, tokens, reference_tokens)


@pytest.mark.parametrize("bits", [False, True], ids=["e4m3", "bits"])
def test_the_kernels_read_and_write_the_fp8_cache_as_the_reference_does(family_checkpoint, monkeypatch, bits):
    """The Triton path (fused rotary store, prefill, split-KV decode, cascade prefix pass) against the
    PyTorch reference, both on an FP8 cache: the same tokens and logits to fp32 rounding; the kernels
    reading e4m3, or its bits (the path before compute capability 8.9)."""
    _use_bits(monkeypatch, bits)
    path = family_checkpoint("qwen2_5_vl")
    prompts = [_prompt("qwen") + "A", _prompt("qwen") + "B"]  # a shared prefix: one cascade group
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=3)
    results = []
    for backend in ("torch", "triton"):
        engine = MMEngine(str(path), max_model_len=256, kv_cache_dtype="fp8", attn_backend=backend, cascade_attention="on",
                          enable_prefix_grouping=False, **KERNEL_FP32.engine_kwargs)
        outs = engine.generate(prompts, images=[[PICTURE], [PICTURE]], sampling_params=params, use_tqdm=False)
        results.append([(o.token_ids, [[lp for _, lp in step.top] for step in o.logprobs]) for o in outs])
        if backend == "triton":
            assert engine.stats()["cascade_groups"] > 0
    (torch_out, triton_out) = results
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(torch_out, triton_out):
        assert tokens_a == tokens_b
        torch.testing.assert_close(torch.tensor(lps_b), torch.tensor(lps_a), rtol=1e-4, atol=1e-4)


def _use_bits(monkeypatch, bits: bool) -> None:
    """The kernels take the FP8 cache as its bits (uint8) when `bits`, as on a GPU without Triton's e4m3."""
    from mmengine.kernels import e4m3

    if bits:
        monkeypatch.setattr(e4m3, "has_fp8_type", lambda device: False)
    elif torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's e4m3 type needs compute capability 8.9+; this GPU takes the bits (the `bits` cases)")


@pytest.mark.parametrize("bits", [False, True], ids=["e4m3", "bits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_store_kernels_write_the_bits_torch_writes(dtype, monkeypatch, bits):
    _use_bits(monkeypatch, bits)
    torch.manual_seed(0)
    device = KERNEL_FP32.device
    tokens, heads, head_dim, blocks, block_size = 11, 2, 16, 4, 4
    key = (torch.randn(tokens, heads, head_dim) * 300).to(dtype).to(device)  # beyond ±448 after scaling: saturates
    value = torch.randn(tokens, heads, head_dim).to(dtype).to(device)
    slots = torch.tensor([0, 1, 2, 5, 6, -1, 8, 9, 12, 13, 15], device=device)
    k_scale, v_scale = 0.5, 1 / 64
    cache = torch.zeros(2, blocks, block_size, heads, head_dim, dtype=torch.float8_e4m3fn, device=device)
    store_kv(key, value, cache, slots, k_scale, v_scale)
    valid = slots >= 0
    flat_k, flat_v = cache[0].view(-1, heads, head_dim), cache[1].view(-1, heads, head_dim)
    assert torch.equal(flat_k[slots[valid]].view(torch.uint8), quantize_e4m3(key[valid], 1 / k_scale).view(torch.uint8))
    assert torch.equal(flat_v[slots[valid]].view(torch.uint8), quantize_e4m3(value[valid], 1 / v_scale).view(torch.uint8))
    assert flat_k.float().abs().max() == 448  # saturated, not inf or nan

    # the fused rotary store: the rotated keys it writes to an fp32 cache, quantized, are what it writes to an FP8 one
    q = torch.randn(tokens, 4, head_dim).to(dtype).to(device)
    positions = torch.arange(tokens, device=device)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    table = build_cos_sin_table(inv_freq, 1.0, 64, dtype).to(device)
    caches = {}
    for cache_dtype in (dtype, torch.float8_e4m3fn):
        caches[cache_dtype] = torch.zeros(2, blocks, block_size, heads, head_dim, dtype=cache_dtype, device=device)
        rotary_store_kv(q.clone(), key.clone(), value, positions, table, caches[cache_dtype], slots, k_scale=k_scale, v_scale=v_scale)
    full, fp8 = caches[dtype], caches[torch.float8_e4m3fn]
    assert torch.equal(fp8[0].view(torch.uint8), quantize_e4m3(full[0], 1 / k_scale).view(torch.uint8))
    assert torch.equal(fp8[1].view(torch.uint8), quantize_e4m3(full[1], 1 / v_scale).view(torch.uint8))


def _with_kv_scales(source, target, k_scale: float, v_scale: float, layers: int = 2, shape=()) -> None:
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    for layer in range(layers):
        tensors[f"language_model.model.layers.{layer}.self_attn.k_scale"] = torch.full(shape, k_scale)
        tensors[f"language_model.model.layers.{layer}.self_attn.v_scale"] = torch.full(shape, v_scale)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})


def test_the_checkpoints_kv_scales_are_used(family_checkpoint, tmp_path, caplog):
    """Scales of 1/64 make every stored value 64 times larger: logits stay within the tolerance only if
    the key scale joins the softmax scale and the value scale multiplies the output."""
    source = family_checkpoint("llava")
    _with_kv_scales(source, tmp_path / "scaled", 1 / 64, 1 / 32)
    _, reference_tokens, reference = _greedy_logits(source, "llava", "auto")
    with caplog.at_level(logging.WARNING):
        engine, tokens, ours = _greedy_logits(tmp_path / "scaled", "llava", "fp8")
    assert "use 1.0" not in caplog.text
    layers = engine.runner.model.language_model.attention_layers()
    assert [(a.k_scale, a.v_scale) for a in layers] == [(1 / 64, 1 / 32)] * len(layers)
    assert engine.runner.kv_cache.float_values().abs().max() > 64  # stored divided by the scales
    assert_within_fp8_tolerance(ours, reference, tokens, reference_tokens)
    # the scales are for an FP8 cache only: the full-precision cache ignores them
    _, auto_tokens, auto = _greedy_logits(tmp_path / "scaled", "llava", "auto")
    assert auto_tokens == reference_tokens and torch.equal(auto[0], reference[0])


def test_a_malformed_kv_scale_is_named(family_checkpoint, tmp_path):
    _with_kv_scales(family_checkpoint("llava"), tmp_path / "bad", 0.5, 0.5, layers=1, shape=(4,))
    with pytest.raises(WeightsMismatchError, match=r"layers\.0\.self_attn\.k_scale.*one positive number"):
        MMEngine(str(tmp_path / "bad"), device="cpu", dtype="float32", max_model_len=256, kv_cache_dtype="fp8")


def test_an_unknown_kv_cache_dtype_is_refused_by_name(family_checkpoint):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, got 'int8'"):
        MMEngine(str(family_checkpoint("llava")), device="cpu", kv_cache_dtype="int8")


@pytest.mark.parametrize("dtype,ratio", [("bfloat16", 2), ("float32", 4)])
def test_the_same_memory_holds_more_blocks_each_half_of_bf16s(family_checkpoint, dtype, ratio):
    path = str(family_checkpoint("qwen2_5_vl"))
    options = dict(device="cpu", dtype=dtype, max_model_len=4096, max_num_seqs=64, cpu_kv_cache_bytes=1 << 24,
                   encoder_cache_size=256)
    runners = {kv: MMEngine(path, kv_cache_dtype=kv, **options).runner for kv in ("auto", "fp8")}
    assert runners["auto"].kv_block_bytes == ratio * runners["fp8"].kv_block_bytes
    # each block also pays for its pinned share of the encoder cache (block_size embeddings), the same in both
    per_block = {kv: r.kv_block_bytes + r.block_size * r.embedding_bytes for kv, r in runners.items()}
    blocks = {kv: r.kv_cache.num_blocks for kv, r in runners.items()}
    assert runners["fp8"].kv_cache.dtype == torch.float8_e4m3fn
    used = {kv: blocks[kv] * per_block[kv] for kv in runners}
    assert abs(used["fp8"] - used["auto"]) < max(per_block.values())  # the same memory...
    assert blocks["fp8"] > blocks["auto"]  # ...in more blocks: ratio x as many, less the encoder's share


def test_the_budget_shows_the_kv_cache_under_its_dtype(family_checkpoint, capsys):
    from mmengine.cli import main

    path = str(family_checkpoint("qwen2_5_vl"))
    lines = {}
    for kv in ("auto", "fp8"):
        assert main(["budget", "--model", path, "--device", "cpu", "--dtype", "bfloat16", "--kv-cache-dtype", kv]) == 0
        lines[kv] = [line for line in capsys.readouterr().out.splitlines() if "one token" in line or "KV cache (" in line]
    engine = MMEngine(path, device="cpu", dtype="bfloat16", max_model_len=256, kv_cache_dtype="fp8")
    per_token = engine.runner.kv_block_bytes // engine.runner.block_size
    assert lines["fp8"][0] == "KV cache (float8_e4m3fn: --kv-cache-dtype fp8)"
    assert lines["fp8"][1].split()[2] == str(per_token) and lines["auto"][1].split()[2] == str(2 * per_token)
