"""Quantized checkpoints (models/quantization.py): FP8 with block scales (Qwen's -FP8) and
compressed-tensors float-quantized (llm-compressor's FP8), built in the documented layouts
(mmengine.testing.quantize) from the tiny checkpoints, load and give exactly the logits of the same
model with the dequantized weights; what is not supported is refused by name, and a corrupt quantized
tensor is named with what was expected, what was found and its file."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from mmengine import MMEngine, SamplingParams
from mmengine.errors import UnsupportedModelError, WeightsMismatchError
from mmengine.testing import make_test_image
from mmengine.testing.quantize import quantize_checkpoint

PICTURE = make_test_image(41, size=(64, 48))


def _logprobs(path, prompt, images) -> tuple[list[int], list]:
    engine = MMEngine(str(path), device="cpu", dtype="float32", max_model_len=256)
    (out,) = engine.generate(prompt, images=images, sampling_params=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                                                     logprobs=5), use_tqdm=False)
    return out.token_ids, [lp.top for lp in out.logprobs]


@pytest.mark.parametrize("method", ["fp8", "compressed-tensors", "w4a16", "w4a16-asym", "gptq", "gptq-act-order", "awq"])
@pytest.mark.parametrize("name", ["llava", "qwen2_5_vl"])
def test_a_quantized_checkpoint_computes_its_dequantized_weights(family_checkpoint, tmp_path, method, name):
    source = family_checkpoint(name)
    quantized, reference = quantize_checkpoint(source, tmp_path / "quantized", method)
    prompt = ("USER: <image>\nWhat is it? ASSISTANT:" if name == "llava" else
              "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n")
    ours = _logprobs(quantized, prompt, [PICTURE])
    assert ours == _logprobs(reference, prompt, [PICTURE])  # the same tokens and log-probabilities, exactly
    assert ours[1] != _source_logprobs(source, prompt)[1]  # the weights really were quantized (the logits moved)


@functools.cache
def _source_logprobs(path, prompt: str) -> tuple[list[int], list]:
    """The unquantized checkpoint's, once per family for all the methods."""
    return _logprobs(path, prompt, [PICTURE])


def test_a_block_scale_of_the_wrong_shape_is_named(family_checkpoint, tmp_path):
    quantized, _ = quantize_checkpoint(family_checkpoint("llava"), tmp_path / "q", "fp8", block=(32, 32))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [16, 16]
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsMismatchError, match=r"weight_scale_inv' \(fp8\): expected shape \[\d+, \d+\] \(one per 16x16 block of "
                                                  r"the weight .*\), found shape \[\d+, \d+\]"):
        MMEngine(str(quantized), device="cpu", dtype="float32", max_model_len=256)


DOWN_PROJ = "language_model.model.layers.0.mlp.down_proj"  # [64, 128]: 128 inputs in 4 groups of 32, 64 outputs


def _replace(name: str, make):
    return lambda tensors: tensors.__setitem__(f"{DOWN_PROJ}.{name}", make(tensors[f"{DOWN_PROJ}.{name}"]))


def _with(value: int, at: int = 0):
    def make(tensor):
        tensor = tensor.clone()
        tensor[at] = value
        return tensor
    return make


CORRUPT = [  # (method, edit, the tensor named, expected, found)
    ("gptq", _replace("scales", lambda t: t[:1]), "scales", "shape [4, 64]", "shape [1, 64]"),  # too few groups: was an IndexError
    ("gptq", _replace("g_idx", _with(4, at=5)), "g_idx", "group indices in [0, 4)", "values from 0 to 4"),  # was an IndexError
    ("gptq", _replace("g_idx", _with(-1)), "g_idx", "group indices in [0, 4)", "values from -1 to 3"),  # was loaded: group 3
    ("gptq", _replace("qzeros", lambda t: t[:, :4]), "qzeros", "shape [4, 8]", "shape [4, 4]"),
    ("gptq", _replace("qweight", lambda t: t.float()), "qweight", "an integer tensor", "torch.float32"),
    ("w4a16", _replace("weight_shape", lambda t: torch.tensor([64, 128, 1])), "weight_shape",  # was a ValueError
     "[out_features, in_features] (two positive ints)", "[64, 128, 1]"),
    ("w4a16", _replace("weight_shape", lambda t: torch.tensor([64, 256])), "weight_packed", "shape [64, 32]", "shape [64, 16]"),
    ("w4a16", _replace("weight_scale", lambda t: t[:, :1]), "weight_scale", "shape [64, 4]", "shape [64, 1]"),
    ("w4a16-asym", _replace("weight_zero_point", lambda t: t[:, :1]), "weight_zero_point", "shape [8, 4]",  # was an IndexError
     "shape [8, 1]"),
    ("w4a16-asym", _replace("weight_zero_point", lambda t: t[:1]), "weight_zero_point", "shape [8, 4]", "shape [1, 4]"),  # RuntimeError
    ("awq", _replace("scales", lambda t: t[:1]), "scales", "shape [4, 64]", "shape [1, 64]"),
    ("awq", _replace("qzeros", lambda t: t[:, :1]), "qzeros", "shape [4, 8]", "shape [4, 1]"),
    ("fp8", _replace("weight_scale_inv", lambda t: t[:1]), "weight_scale_inv", "shape [2, 4]", "shape [1, 4]"),
    ("fp8", _replace("weight_scale_inv", lambda t: t.to(torch.int32)), "weight_scale_inv", "a floating-point tensor", "torch.int32"),
    ("compressed-tensors", _replace("weight_scale", lambda t: t[:3]), "weight_scale", "one scale per output channel ([64, 1])",
     "shape [3, 1]"),
    ("compressed-tensors", _replace("weight_scale", lambda t: t.reshape(8, 8)), "weight_scale",
     "one scale per output channel ([64, 1])", "shape [8, 8]"),  # 64 scales, but not one per output channel
]


@pytest.mark.parametrize("backend", ["torch", "triton"])  # dequantized at load, or kept for the fused kernels
@pytest.mark.parametrize("method,edit,tensor,expected,found", CORRUPT,
                         ids=[f"{method}-{tensor}-{i}" for i, (method, _, tensor, _, _) in enumerate(CORRUPT)])
def test_a_corrupt_quantized_tensor_is_named_with_what_was_expected_and_its_file(family_checkpoint, tmp_path, backend, method,
                                                                                 edit, tensor, expected, found):
    from safetensors.torch import load_file, save_file

    quantized, _ = quantize_checkpoint(family_checkpoint("llava"), tmp_path / "q", method, reference=False)
    weights = quantized / "model.safetensors"
    tensors = load_file(str(weights))
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights))
    from conftest import CPU_FP32, KERNEL_FP32  # the Triton variant where its kernels run: a GPU, else the interpreter

    precision = KERNEL_FP32 if backend == "triton" else CPU_FP32
    with pytest.raises(WeightsMismatchError) as err:
        MMEngine(str(quantized), max_model_len=256, attn_backend=backend, **precision.engine_kwargs)
    assert str(err.value).startswith(f"{weights}: tensor '{DOWN_PROJ}.{tensor}'")
    assert f"expected {expected}" in str(err.value) and f"found {found}" in str(err.value)


@pytest.mark.parametrize("quantization_config,named", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size -1"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8"}, "weight_block_size None"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24"}, "format 'marlin-24'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "group"}}}}, "4-bit int weights"),
])
def test_an_unsupported_quantization_is_refused_by_name(family_checkpoint, tmp_path, quantization_config, named):
    path = tmp_path / "model"
    shutil.copytree(family_checkpoint("llava"), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=named):
        MMEngine(str(path), device="cpu", dtype="float32", max_model_len=256)


def test_int4_unpacking_follows_each_formats_documented_nibble_order():
    """Nibble i of a word is bits 4i..4i+3; GPTQ packs eight consecutive input rows in order (values
    0..7 make 0x76543210), AWQ's GEMM packing eight output columns in the order 0, 2, 4, 6, 1, 3, 5, 7
    (values 0..7 make the well-known 0x75316420)."""
    from mmengine.models.quantization import dequantize_awq, dequantize_gptq, unpack_int4

    gptq_word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_int4(gptq_word, 0).flatten().tolist() == list(range(8))
    awq_word = torch.tensor([[0x75316420]], dtype=torch.int32)
    parts = {"qweight": awq_word, "qzeros": torch.zeros(1, 1, dtype=torch.int32), "scales": torch.ones(1, 8)}
    assert dequantize_awq(parts, 1, "x").flatten().tolist() == list(range(8))  # column c holds value c
    top = torch.tensor([[-0x10000000]], dtype=torch.int32)  # 0xF0000000: the top nibble is 15 despite the sign bit
    assert unpack_int4(top, 1).flatten().tolist() == [0] * 7 + [15]
    # GPTQ v1 stores zero - 1: a stored 0 is a zero point of 1
    gptq = {"qweight": gptq_word.repeat(1, 8), "qzeros": torch.zeros(1, 1, dtype=torch.int32), "scales": torch.full((1, 8), 0.5),
            "g_idx": torch.zeros(8, dtype=torch.int32)}  # 8 inputs (values 0..7 in every column), 8 outputs, one group
    assert dequantize_gptq(gptq, 8, "x")[3].tolist() == [(v - 1) * 0.5 for v in range(8)]


def test_unpacking_equals_compressed_tensors_own_packer_along_both_dims():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from mmengine.models.quantization import unpack_int4

    values = torch.randint(-8, 8, (5, 40), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_to_int32(values, 4), 1)[:, :40] - 8, values.int())
    assert torch.equal(unpack_int4(pack_to_int32(values, 4, packed_dim=0), 0)[:5] - 8, values.int())


def test_quantization_only_asserts_what_the_checkpoint_says(family_checkpoint, tmp_path):
    from mmengine.errors import ConfigError

    quantized, _ = quantize_checkpoint(family_checkpoint("llava"), tmp_path / "q", "gptq")
    MMEngine(str(quantized), device="cpu", dtype="float32", max_model_len=256, quantization="gptq")
    with pytest.raises(ConfigError, match="quantization='awq', but the checkpoint's quantization_config says 'gptq'"):
        MMEngine(str(quantized), device="cpu", dtype="float32", max_model_len=256, quantization="awq")
    with pytest.raises(ConfigError, match="quantization='fp8', but the checkpoint's quantization_config says 'none'"):
        MMEngine(str(family_checkpoint("llava")), device="cpu", dtype="float32", max_model_len=256, quantization="fp8")
    with pytest.raises(ConfigError, match="quantization"):
        MMEngine(str(quantized), quantization="int3")


@pytest.mark.parametrize("method,swapped,layer", [("gptq", 8, "Int4Linear"), ("awq", 8, "Int4Linear"), ("gptq-act-order", 8, "Int4Linear"),
                                                   ("w4a16", 8, "Int4Linear"), ("w4a16-asym", 8, "Int4Linear"),
                                                   ("fp8", 8, "Fp8Linear"), ("compressed-tensors", 8, "Fp8Linear")])
def test_quantized_weights_stay_quantized_where_the_fused_kernels_run(family_checkpoint, tmp_path, no_tf32, method, swapped, layer):
    """With the Triton backend (the interpreter on CPU), GPTQ (act-order too: the kernel reads g_idx), AWQ
    and compressed-tensors W4A16 projections become Int4Linear layers and FP8 ones Fp8Linear layers (q/k/v
    and gate/up fused; 4 a layer, 2 layers), and give the dequantized model's tokens."""
    from conftest import KERNEL_FP32

    from mmengine.layers import quantized_linear

    quantized, reference = quantize_checkpoint(family_checkpoint("llava"), tmp_path / "q", method)
    prompt = "USER: <image>\nWhat is it? ASSISTANT:"
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine = MMEngine(str(quantized), max_model_len=256, attn_backend="triton", enforce_eager=True, **KERNEL_FP32.engine_kwargs)
    assert engine.runner.num_quantized_projections == swapped
    down_proj = engine.runner.model.language_model.layers[0].mlp.down_proj
    assert type(down_proj) is (torch.nn.Linear if layer is None else getattr(quantized_linear, layer))
    ours = engine.generate(prompt, images=[PICTURE], sampling_params=params, use_tqdm=False)[0].token_ids
    plain = MMEngine(str(reference), max_model_len=256, **KERNEL_FP32.engine_kwargs)
    assert ours == plain.generate(prompt, images=[PICTURE], sampling_params=params, use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("method", ["fp8", "gptq", "w4a16"])
def test_the_budget_shows_the_weights_kept_quantized_and_dequantized(family_checkpoint, tmp_path, capsys, method):
    from mmengine.cli import main

    source = family_checkpoint("llava")
    quantized, _ = quantize_checkpoint(source, tmp_path / "q", method)
    main(["budget", "--model", str(quantized), "--device", "cpu", "--dtype", "bfloat16"])
    lines = {line.split("  ")[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("weights")}
    main(["budget", "--model", str(source), "--device", "cpu", "--dtype", "bfloat16"])
    dense = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("weights")][0]
    assert lines["weights (dequantized at load)"][4:6] == dense[1:3]  # the same parameters and bytes as the source
    kept = int(lines["weights (kept quantized)"][3])
    assert kept < int(dense[1])  # the projections in 8 or 4 bits


def test_a_sharded_checkpoint_quantizes_shard_by_shard(tmp_path):
    """The GPU suite's path for 7B checkpoints: shards quantized one at a time, no reference written,
    an index naming every quantized tensor's shard; it computes what the single-file copy computes."""
    from mmengine.testing import TinyLlavaSpec, build_tiny_llava

    single, sharded = build_tiny_llava(tmp_path / "one", TinyLlavaSpec()), build_tiny_llava(tmp_path / "many", TinyLlavaSpec(),
                                                                                             max_shard_size="200KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    one, _ = quantize_checkpoint(single, tmp_path / "one-q", "gptq")
    many, reference = quantize_checkpoint(sharded, tmp_path / "many-q", "gptq", reference=False)
    assert reference is None and not (tmp_path / "many-q-dequantized").exists()
    index = json.loads((many / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(name.endswith(".qweight") for name in index) and set(index.values()) == {p.name for p in many.glob("*.safetensors")}
    prompt = "USER: <image>\nWhat is it? ASSISTANT:"
    assert _logprobs(many, prompt, [PICTURE]) == _logprobs(one, prompt, [PICTURE])


@pytest.mark.parametrize("method,kept,dtype", [("fp8", "Fp8FusedExperts", torch.float8_e4m3fn), ("gptq", "Int4FusedExperts", torch.int32),
                                              ("gptq-act-order", None, None)])
def test_quantized_experts_stay_quantized_where_the_fused_kernels_run(family_checkpoint, tmp_path, no_tf32, method, kept, dtype):
    """Qwen3.5-MoE's experts, stored one tensor per expert (as Qwen's -FP8 releases store them) in FP8 or
    int4: dequantized and stacked on CPU they compute the dequantized copy exactly; with the fused kernels
    every MoE layer keeps them quantized (act-order int4 experts, each with its own input order, are
    dequantized) and gives the dequantized copy's tokens."""
    from conftest import KERNEL_FP32

    from mmengine.layers import moe

    quantized, reference = quantize_checkpoint(family_checkpoint("qwen3_5_moe"), tmp_path / "q", method)
    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n"
    if method == "fp8":
        assert _logprobs(quantized, prompt, [PICTURE]) == _logprobs(reference, prompt, [PICTURE])
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine = MMEngine(str(quantized), max_model_len=256, attn_backend="triton", enforce_eager=True, **KERNEL_FP32.engine_kwargs)
    layers = engine.runner.model.language_model.layers
    assert all(type(layer.mlp.experts) is getattr(moe, kept or "FusedExperts") for layer in layers)
    if kept is not None:
        assert layers[0].mlp.experts.gate_up_proj.dtype == dtype
    # every other linear layer keeps its bits too: the gated attention's (q_proj carries the output gate), the
    # Gated DeltaNet's in_proj_* and out_proj, the shared expert's; in int4 those the packing cannot take stay
    # dense (4 and 1 outputs; the shared expert's down_proj has 48 inputs, not whole groups of 32)
    dense = {path for layer in layers for path, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    assert dense == (set() if method == "fp8" else {"linear_attn.in_proj_a", "linear_attn.in_proj_b", "mlp.shared_expert_gate",
                                                    "mlp.shared_expert.down_proj"})
    linear = 3 * 5 + 4 + 4 * 3 if method == "fp8" else 3 * 3 + 4 + 4 * 1  # 3 Gated DeltaNet layers, 1 attention, 4 shared experts
    assert engine.runner.num_quantized_projections == linear + 4 * (kept is not None)
    ours = engine.generate(prompt, images=[PICTURE], sampling_params=params, use_tqdm=False)[0].token_ids
    plain = MMEngine(str(reference), max_model_len=256, **KERNEL_FP32.engine_kwargs)  # the dequantized copy on the torch path
    assert ours == plain.generate(prompt, images=[PICTURE], sampling_params=params, use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("method", ["fp8", "gptq"])
def test_kept_quantized_the_dense_projection_weights_never_take_memory(family_checkpoint, tmp_path, method):
    """Built with its parameters on meta, the model gives storage to everything but the projections a
    quantized layer takes: their dense weights are never dequantized nor allocated."""
    from conftest import KERNEL_FP32

    quantized, _ = quantize_checkpoint(family_checkpoint("llava"), tmp_path / "q", method)
    engine = MMEngine(str(quantized), max_model_len=256, attn_backend="triton", enforce_eager=True, **KERNEL_FP32.engine_kwargs)
    model = engine.runner.model
    skipped = model._skipped_dense
    assert len(skipped) == 2 * 7  # q, k, v, o, gate, up, down of both layers: loaded as kernel layouts only
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())


def test_a_projection_whose_shards_disagree_is_dequantized_into_its_dense_weight(family_checkpoint, tmp_path, no_tf32):
    """Layer 0's k_proj left unquantized (as a checkpoint's ignore list may leave it): q and v came as kernel
    layouts only, so the fused q/k/v cannot run quantized and they are dequantized into it; the tokens are
    the dequantized copy's."""
    from conftest import KERNEL_FP32
    from safetensors.torch import load_file, save_file

    quantized, reference = quantize_checkpoint(family_checkpoint("llava"), tmp_path / "q", "fp8")
    tensors, dense = load_file(str(quantized / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    k_proj = next(name for name in tensors if name.startswith("language_model.") and name.endswith(".layers.0.self_attn.k_proj.weight"))
    tensors[k_proj] = dense[k_proj]
    del tensors[k_proj.removesuffix("weight") + "weight_scale_inv"]
    save_file(tensors, str(quantized / "model.safetensors"))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = "USER: <image>\nWhat is it? ASSISTANT:"
    engine = MMEngine(str(quantized), max_model_len=256, attn_backend="triton", enforce_eager=True, **KERNEL_FP32.engine_kwargs)
    assert engine.runner.num_quantized_projections == 7  # all but layer 0's q/k/v
    assert isinstance(engine.runner.model.language_model.layers[0].self_attn.qkv_proj, torch.nn.Linear)
    ours = engine.generate(prompt, images=[PICTURE], sampling_params=params, use_tqdm=False)[0].token_ids
    plain = MMEngine(str(reference), max_model_len=256, **KERNEL_FP32.engine_kwargs)
    assert ours == plain.generate(prompt, images=[PICTURE], sampling_params=params, use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("method", ["compressed-tensors", "w4a16", "w4a16-asym"])
def test_greedy_tokens_equal_transformers_running_the_same_checkpoint(family_checkpoint, tmp_path, method):
    """Where transformers runs a quantized checkpoint on CPU itself (compressed-tensors' formats: the
    compressed-tensors library decompresses them at load, run_compressed=False; its compressed CPU path
    gives token 0 throughout), mmengine's greedy tokens are transformers'."""
    from transformers import AutoModelForImageTextToText
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from mmengine.models.registry import load_hf_processor

    quantized, _ = quantize_checkpoint(family_checkpoint("llava"), tmp_path / "q", method)
    prompt = "USER: <image>\nWhat is it? ASSISTANT:"
    engine = MMEngine(str(quantized), device="cpu", dtype="float32", max_model_len=256)
    ours = engine.generate(prompt, images=[PICTURE], sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                           use_tqdm=False)[0].token_ids
    model = AutoModelForImageTextToText.from_pretrained(str(quantized), dtype=torch.float32,
                                                        quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    inputs = load_hf_processor(quantized)(text=prompt, images=[PICTURE.convert("RGB")], return_tensors="pt")
    with torch.inference_mode():
        theirs = model.generate(**inputs, do_sample=False, max_new_tokens=8, eos_token_id=None)[0, inputs["input_ids"].shape[1]:]
    assert ours == theirs.tolist()
