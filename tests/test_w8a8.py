"""The W8A8 FP8 path (kernels/w8a8.py, layers/fp8_dispatch.py): activations quantized per token and
multiplied with the e4m3 weights by torch._scaled_mm (torch's CPU implementation runs it, so it is
checked here), equal to that quantization's fp32 reference and near the dense product; which calls
take it (checkpoints declaring dynamic activations, FP8 GPUs, 16-bit models, per-channel or per-tensor
scales, shapes in 16s) and that Fp8Linear and the engine route every call there, decode and prefill alike."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import KERNEL_FP32
from mmengine.kernels import w8a8
from mmengine.kernels.w8a8 import quantize_per_token, w8a8_matmul
from mmengine.layers import quantized_linear
from mmengine.layers.fp8_dispatch import why_not_w8a8

ROWS = 64
from mmengine.models.quantization import PackedFp8, WeightQuantization, fp8_for_kernel, quantization_of

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not FP8_GPU, reason="needs a GPU of compute capability 8.9+"))]
PER_CHANNEL = WeightQuantization("compressed-tensors", activations_dynamic=True)


def _case(m: int, k: int, n: int, per_tensor: bool, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, PackedFp8]:
    """Rows of different magnitudes (each its own scale) and a weight in the FP8 GEMM's layout."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * (torch.rand(m, 1, generator=gen) * 4 + 0.01)).to(dtype)
    weight = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand((1,) if per_tensor else (n, 1), generator=gen) * 1e-3 + 1e-4
    return x, fp8_for_kernel(weight, scale, PER_CHANNEL)


def _reference(x: torch.Tensor, packed: PackedFp8) -> torch.Tensor:
    """Each row quantized to e4m3 with amax / 448 and dequantized, times the dequantized weight, in fp32."""
    rows = x.float()
    scales = rows.abs().amax(dim=1, keepdim=True) / 448
    dequantized = (rows / scales).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scales
    return dequantized @ (packed.weight.float() * packed.scales).t()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("per_tensor", [False, True], ids=["channel", "tensor"])
@pytest.mark.parametrize("m,k,n", [(65, 48, 80), (130, 272, 208), (97, 1040, 16), (3, 16, 400)])
def test_w8a8_equals_per_token_quantization_and_is_near_the_dense_product(m, k, n, per_tensor, dtype, device):
    x, packed = _case(m, k, n, per_tensor, dtype, seed=m * 7 + n)
    got = w8a8_matmul(x.to(device), packed.weight.to(device), packed.scales.to(device)).cpu()
    assert got.dtype == dtype and got.shape == (m, n)
    expected = _reference(x, packed)
    # one rounding to the output dtype (fp32 sums in another order on a GPU: within one step of it)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), expected, rtol=eps, atol=eps * float(expected.abs().max()))
    # against the dense product (x as it is): e4m3 keeps 3 mantissa bits, a relative step of 2**-3 at
    # most, so each activation moves by up to 6%; over a row's sum that is under 4% of its norm
    dense = x.float() @ (packed.weight.float() * packed.scales).t()
    assert float((got.float() - dense).norm() / dense.norm()) < 0.04


@pytest.mark.parametrize("per_tensor", [False, True], ids=["channel", "tensor"])
def test_without_row_scales_on_the_cpu_the_fallback_equals_per_token_quantization(monkeypatch, per_tensor):
    """torch 2.11's CPU _scaled_mm takes one scale per operand only: the probe says so, and the product is then
    taken from the dequantized operands, as exact as the reference."""
    scaled_mm = torch._scaled_mm

    def per_tensor_only(a, b, *, scale_a, scale_b, **kwargs):
        if scale_a.numel() != 1 or scale_b.numel() != 1:
            raise RuntimeError("Now _scaled_mm only supports per-tensor scaling for CPU backend.")
        return scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", per_tensor_only)
    w8a8.cpu_scaled_mm_takes_row_scales.cache_clear()
    try:
        assert not w8a8.cpu_scaled_mm_takes_row_scales()
        x, packed = _case(65, 48, 80, per_tensor, torch.bfloat16, seed=3)
        got = w8a8_matmul(x, packed.weight, packed.scales)
    finally:
        w8a8.cpu_scaled_mm_takes_row_scales.cache_clear()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, _reference(x, packed).to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_per_token_quantization_is_the_same_bits_on_every_device(device):
    """scale = amax / 448 exactly, then x / scale rounded to e4m3: on a GPU as on the CPU (a scale one ulp
    off moves near-ties of x / scale to the other e4m3 neighbour)."""
    x, _ = _case(130, 272, 16, False, torch.bfloat16, seed=1)
    q, scales = quantize_per_token(x.to(device))
    assert torch.equal(scales.cpu(), x.float().abs().amax(dim=1, keepdim=True) / 448)
    assert torch.equal(q.cpu().view(torch.uint8), quantize_per_token(x)[0].view(torch.uint8))


def test_per_token_quantization_saturates_and_keeps_zero_rows():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -3.0, 0.5], [65504.0, -65504.0, 1.0]], dtype=torch.float16)
    q, scales = quantize_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (3, 1) and scales.dtype == torch.float32
    values = q.float()
    assert not values.isnan().any() and torch.equal(values[0], torch.zeros(3))
    assert values[1, 1] == -448 and values[2, 0] == 448 and values[2, 1] == -448  # the row's amax lands on ±448
    assert scales[1, 0] == torch.tensor(3.0 / 448)
    # within half a step: 2**-4 relative for normal values, 2**-10 of the scale for subnormal ones (row 2's 1.0)
    assert ((values * scales - x.float()).abs() <= x.float().abs() * 2**-4 + scales * 2**-10).all()


def test_a_layout_w8a8_cannot_take_is_named():
    x, packed = _case(4, 64, 32, False, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="one fp32 scale per output channel"):
        w8a8_matmul(x, packed.weight, packed.scales.repeat(1, 2))  # two groups along K: block scales
    with pytest.raises(ValueError, match="is not an e4m3"):
        w8a8_matmul(x, packed.weight.to(torch.bfloat16), packed.scales)


HOPPER, ADA, AMPERE = (9, 0), (8, 9), (8, 0)


@pytest.mark.parametrize("capability,dtype,k,n,group_k,dynamic,refused", [
    (HOPPER, torch.bfloat16, 4096, 12288, 4096, True, None),
    (ADA, torch.float16, 64, 128, 64, True, None),
    (HOPPER, torch.bfloat16, 64, 128, 128, True, None),  # one block wider than K: a scale per output channel
    (HOPPER, torch.bfloat16, 4096, 12288, 4096, False, "dynamic activation"),  # static input scales, or weight-only
    (AMPERE, torch.bfloat16, 4096, 12288, 4096, True, "compute capability 8.9"),
    (None, torch.bfloat16, 4096, 12288, 4096, True, "compute capability 8.9"),  # CPU
    (HOPPER, torch.float32, 4096, 12288, 4096, True, "correctness run"),
    (HOPPER, torch.bfloat16, 4096, 12288, 128, True, "block-scaled"),  # Qwen's 128 x 128 blocks
    (HOPPER, torch.bfloat16, 4104, 12288, 4104, True, "multiples of 16"),
    (HOPPER, torch.bfloat16, 4096, 4, 4096, True, "multiples of 16"),  # e.g. a Gated DeltaNet's in_proj_a
])
def test_the_dispatch_table(capability, dtype, k, n, group_k, dynamic, refused):
    reason = why_not_w8a8(capability, dtype, k, n, group_k, dynamic)
    assert reason is None if refused is None else refused in reason


@pytest.mark.parametrize("config,dynamic", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}, True),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, True),  # transformers' default
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, False),
    *[({"quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}, "input_activations": act}}}, dynamic)
      for act, dynamic in [({"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}, True),
                           ({"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}, False),  # static: input_scale
                           (None, False)]],  # FP8 weights only
])
def test_the_checkpoint_says_whether_activations_are_dynamic(config, dynamic):
    spec = quantization_of(SimpleNamespace(quantization_config=config))
    assert spec.activations_dynamic is dynamic
    weight = torch.zeros(256, 256).to(torch.float8_e4m3fn)
    scale = torch.ones(2, 2) if spec.block else torch.ones(256, 1)
    assert fp8_for_kernel(weight, scale, spec).activations_dynamic is dynamic


def _fp8_layer(monkeypatch, capability, dtype: torch.dtype) -> tuple[quantized_linear.Fp8Linear, dict[str, int]]:
    """An Fp8Linear built as the loader builds one (two fused shards) on a device of `capability`, with
    each GEMM it calls counted."""
    calls = {"w8a8": 0, "w8a16": 0}
    w8a8, w8a16 = quantized_linear.w8a8_matmul, quantized_linear.fp8_matmul

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    monkeypatch.setattr(quantized_linear, "compute_capability", lambda device: capability)
    monkeypatch.setattr(quantized_linear, "w8a8_matmul", counted("w8a8", w8a8))
    monkeypatch.setattr(quantized_linear, "fp8_matmul", counted("w8a16", lambda x, w, s, g: torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype)))
    shards = [_case(1, 64, n, False, dtype, n)[1] for n in (32, 48)]
    layer = quantized_linear.fuse_shards(shards, torch.arange(80, dtype=dtype), torch.device("cpu"), dtype)
    return layer, calls


def test_fp8_linear_routes_every_call_to_w8a8(monkeypatch):
    layer, calls = _fp8_layer(monkeypatch, HOPPER, torch.bfloat16)
    assert isinstance(layer, quantized_linear.Fp8Linear) and layer.w8a8
    x = torch.randn(ROWS + 1, 64).to(torch.bfloat16)
    out = layer(x.view(1, -1, 64))
    assert calls == {"w8a8": 1, "w8a16": 0}
    torch.testing.assert_close(out.view(-1, 80), w8a8_matmul(x, layer.weight, layer.scales) + layer.bias)  # the bias added
    layer(x[:1])  # decode-shaped too: a row's numbers never depend on its step's size
    assert calls == {"w8a8": 2, "w8a16": 0}


@pytest.mark.parametrize("capability,dtype", [(None, torch.bfloat16), (AMPERE, torch.bfloat16), (HOPPER, torch.float32)])
def test_fp8_linear_stays_on_w8a16_where_the_dispatch_says_so(monkeypatch, capability, dtype):
    layer, calls = _fp8_layer(monkeypatch, capability, dtype)
    assert not layer.w8a8
    layer(torch.randn(2 * ROWS, 64).to(dtype))
    assert calls == {"w8a8": 0, "w8a16": 1}


def test_the_engine_runs_prefill_and_decode_w8a8(family_checkpoint, tmp_path, monkeypatch):
    """An FP8-Dynamic checkpoint (compressed-tensors, per channel) in bf16: every projection may take
    W8A8, and the prompt's prefill and the decode steps (one row) do. It runs where the Triton kernels
    run: on a GPU, or on the CPU with the capability faked (the Triton kernels in the interpreter,
    torch._scaled_mm on the CPU)."""
    from mmengine import MMEngine, SamplingParams
    from mmengine.testing import make_test_image
    from mmengine.testing.quantize import quantize_checkpoint

    device = KERNEL_FP32.device
    if device == "cuda" and not FP8_GPU:
        pytest.skip("W8A8 needs a GPU of compute capability 8.9+")
    if device == "cpu":
        monkeypatch.setattr(quantized_linear, "compute_capability", lambda d: HOPPER)
    calls = {"w8a8": 0, "w8a16": 0}
    w8a8, w8a16 = quantized_linear.w8a8_matmul, quantized_linear.fp8_matmul
    monkeypatch.setattr(quantized_linear, "w8a8_matmul", lambda *a: calls.__setitem__("w8a8", calls["w8a8"] + 1) or w8a8(*a))
    monkeypatch.setattr(quantized_linear, "fp8_matmul", lambda *a: calls.__setitem__("w8a16", calls["w8a16"] + 1) or w8a16(*a))
    quantized, _ = quantize_checkpoint(family_checkpoint("llava"), tmp_path / "q", "compressed-tensors")
    engine = MMEngine(str(quantized), device=device, dtype="bfloat16", max_model_len=256, attn_backend="triton", enforce_eager=True)
    layers = [m for m in engine.runner.model.modules() if isinstance(m, quantized_linear.Fp8Linear)]
    assert len(layers) == 8 and all(m.w8a8 for m in layers)
    calls.update(w8a8=0, w8a16=0)  # (start-up's warm-up runs too)
    prompt = "USER: <image>\nWhat is it? ASSISTANT:"
    (out,) = engine.generate(prompt, images=[make_test_image(41, size=(64, 48))], use_tqdm=False,
                             sampling_params=SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 3
    assert calls == {"w8a8": 3 * 8, "w8a16": 0}  # one prefill step, two decode steps, 8 projections each
