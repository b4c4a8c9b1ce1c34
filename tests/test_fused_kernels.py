"""The decoder's fused kernels (rotary + K/V store, RMSNorm with and without the residual add,
SiLU-and-mul) against their PyTorch references: in Triton's interpreter on CPU (fp32, fp16), on
CUDA in fp16 and bf16 when a GPU is present; and the shared cos/sin table against transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from mmengine.kernels.activation import silu_and_mul
from mmengine.kernels.decode_attention import decode_attention
from mmengine.kernels.kv_store import store_kv
from mmengine.kernels.rms_norm import fused_add_rms_norm, rms_norm
from mmengine.kernels.rotary import rotary_store_kv
from mmengine.layers.activation import GatedActivation, silu_and_mul_reference
from mmengine.layers.kernel_dispatch import use_fused_kernels
from mmengine.layers.norm import fused_add_rms_norm_reference, rms_norm_reference
from mmengine.layers.rotary import RotaryEmbedding, build_cos_sin_table, rope_inv_freq, rotary_reference

CUDA = torch.cuda.is_available()
NEEDS_GPU = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# Without a GPU the kernels run in Triton's interpreter on CPU tensors (conftest.py turns it on);
# with one, the same fp32/fp16 cases run compiled on CUDA tensors (the interpreter is off there).
KERNEL_DEVICE, MODE = ("cuda", "compiled") if CUDA else ("cpu", "interp")
DEVICES = [
    pytest.param(KERNEL_DEVICE, torch.float32, id=f"{MODE}-fp32"),
    pytest.param(KERNEL_DEVICE, torch.float16, id=f"{MODE}-fp16"),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=NEEDS_GPU),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=NEEDS_GPU),
]
# fp32 sums of squares are reduced in another order than torch's, and a GPU may contract a*b+c into
# one FMA: allow a few ulps there. 16-bit results round at the same places as the reference.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _randn(*shape: int, device: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


# -- the cos/sin table ----------------------------------------------------------------------------

ROPE_PARAMETERS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},  # scales cos/sin
]


@pytest.mark.parametrize("rope_parameters", ROPE_PARAMETERS, ids=lambda p: p["rope_type"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_table_rows_equal_transformers_cos_sin(rope_parameters, dtype):
    """Every row, up to the last position, is exactly what transformers computes per call."""
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=4096, rope_parameters=rope_parameters)
    head_dim = 32
    inv_freq, scaling = rope_inv_freq(config, head_dim)
    table = build_cos_sin_table(inv_freq, scaling, config.max_position_embeddings, dtype)
    positions = torch.tensor([[0, 1, 7, 1000, 2047, 3000, 4095]])
    cos, sin = LlamaRotaryEmbedding(config)(torch.empty(1, dtype=dtype), positions)
    assert torch.equal(table[positions[0], :head_dim], cos[0]) and torch.equal(table[positions[0], head_dim:], sin[0])
    assert (scaling != 1.0) == (rope_parameters["rope_type"] == "yarn")
    if dtype == torch.float32:  # the module builds the same table, in the default dtype
        assert torch.equal(RotaryEmbedding(config, head_dim).cos_sin, table)


def test_one_table_shared_by_every_layer(checkpoint_dir):
    from mmengine import MMEngine

    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    decoder = engine.runner.model.language_model
    tables = [m for m in decoder.modules() if isinstance(m, RotaryEmbedding)]
    assert tables == [decoder.rotary]
    assert decoder.rotary.cos_sin.shape == (decoder.config.max_position_embeddings, 2 * 16)
    assert decoder.rotary.cos_sin.dtype == engine.runner.dtype


# -- fused rotary + K/V store ---------------------------------------------------------------------

ROTARY_CASES = [
    # (num_heads, num_kv_heads, head_dim)
    (4, 4, 64),
    (8, 2, 80),
    (6, 2, 96),  # GQA group 3
    (8, 1, 128),
    (40, 8, 64),  # more query heads than one tile holds
]


def _qkv(num_tokens, num_heads, num_kv_heads, head_dim, device, dtype, seed=0):
    """q, k, v as strided views of one fused QKV output, as the decoder produces them."""
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device, dtype=dtype, seed=seed)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", ROTARY_CASES)
def test_rotary_kernel_rotates_and_stores_like_the_reference(device, dtype, num_heads, num_kv_heads, head_dim):
    max_positions, block_size = 64, 16
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    table = build_cos_sin_table(inv_freq, 1.0, max_positions, dtype).to(device)
    q, k, v = _qkv(7, num_heads, num_kv_heads, head_dim, device, dtype)
    positions = torch.tensor([0, 63, 5, 40, 17, 62, 1], device=device)  # scattered, up to the table's last row
    slots = torch.tensor([3, -1, 17, 63, 0, -1, 40], device=device)
    sentinel = 7.0
    cache = torch.full((2, 4, block_size, num_kv_heads, head_dim), sentinel, device=device, dtype=dtype)
    ref_q, ref_k = rotary_reference(q.clone(), k.clone(), positions, table)
    v_before = v.clone()

    rotary_store_kv(q, k, v, positions, table, cache, slots)

    tol = dict(atol=0, rtol=0) if device == "cpu" else TOL[dtype]
    torch.testing.assert_close(q, ref_q, **tol)  # rotated in place, through the strided views
    torch.testing.assert_close(k, ref_k, **tol)
    assert torch.equal(v, v_before)
    flat_k, flat_v = cache[0].view(-1, num_kv_heads, head_dim), cache[1].view(-1, num_kv_heads, head_dim)
    written = [s for s in slots.tolist() if s >= 0]
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(flat_k[slot], ref_k[row], **tol)
            assert torch.equal(flat_v[slot], v[row])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert bool((flat_k[untouched.to(device)] == sentinel).all()) and bool((flat_v[untouched.to(device)] == sentinel).all())


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_rotary_kernel_without_a_cache_only_rotates(device, dtype):
    head_dim = 80
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    table = build_cos_sin_table(inv_freq, 1.0, 32, dtype).to(device)
    q, k, _ = _qkv(5, 8, 2, head_dim, device, dtype, seed=1)
    positions = torch.tensor([31, 0, 9, 9, 30], device=device)
    ref_q, ref_k = rotary_reference(q.clone(), k.clone(), positions, table)
    rotary_store_kv(q, k, None, positions, table)
    tol = dict(atol=0, rtol=0) if device == "cpu" else TOL[dtype]
    torch.testing.assert_close(q, ref_q, **tol)
    torch.testing.assert_close(k, ref_k, **tol)


def test_rotary_takes_the_table_row_of_each_position():
    """A position's rotation comes from its own row: rotating at position p equals rotating at 0
    with row p copied to row 0 (guards against reading the row of the token index instead)."""
    head_dim = 64
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    table = build_cos_sin_table(inv_freq, 1.0, 64, torch.float32)
    table = table.to(KERNEL_DEVICE)
    q, k, _ = _qkv(1, 4, 2, head_dim, KERNEL_DEVICE, torch.float32, seed=2)
    q2, k2 = q.clone(), k.clone()
    rotary_store_kv(q, k, None, torch.tensor([50], device=KERNEL_DEVICE), table)
    moved = table.clone()
    moved[0] = table[50]
    rotary_store_kv(q2, k2, None, torch.tensor([0], device=KERNEL_DEVICE), moved)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    assert not torch.equal(table[50], table[0])


def test_positions_beyond_a_small_table_raise():
    head_dim = 64
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    table = build_cos_sin_table(inv_freq, 1.0, 16, torch.float32)
    q, k, v = _qkv(3, 4, 2, head_dim, "cpu", torch.float32)
    beyond = torch.tensor([3, 16, 2])
    with pytest.raises(IndexError, match=r"covers \[0, 16\)"):
        rotary_reference(q, k, beyond, table)
    cache = torch.zeros(2, 2, 16, 2, head_dim)
    with pytest.raises(IndexError, match=r"covers \[0, 16\)"):
        rotary_store_kv(q, k, v, beyond, table, cache, torch.tensor([0, 1, 2]))
    assert not cache.any()  # nothing was written


def test_rotary_kernel_rejects_mismatched_shapes():
    table = torch.zeros(8, 2 * 64)
    q, k, v = _qkv(2, 4, 2, 64, "cpu", torch.float32)
    with pytest.raises(ValueError, match="rotary shapes"):
        rotary_store_kv(q, k, v, torch.tensor([0, 1]), torch.zeros(8, 2 * 32))
    with pytest.raises(ValueError, match="slot mapping"):
        rotary_store_kv(q, k, v, torch.tensor([0, 1]), table, torch.zeros(2, 1, 16, 2, 64))


# -- RMSNorm ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("num_rows,hidden", [(1, 64), (7, 96), (3, 80), (2, 4096)])
def test_rms_norm_matches_the_reference(device, dtype, num_rows, hidden):
    x = _randn(num_rows, hidden, device=device, dtype=dtype) * 3
    weight = _randn(hidden, device=device, dtype=dtype, seed=1)
    out = rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("num_rows,hidden", [(1, 64), (7, 96), (2, 4096)])
def test_fused_add_rms_norm_matches_the_reference(device, dtype, num_rows, hidden):
    x = _randn(num_rows, hidden, device=device, dtype=dtype)
    residual = _randn(num_rows, hidden, device=device, dtype=dtype, seed=1) * 4
    weight = _randn(hidden, device=device, dtype=dtype, seed=2)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, ref_residual)  # the add is rounded to the model dtype, like transformers'
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs are not written


@pytest.mark.skipif(CUDA, reason="bit-exact rounding is checked in the interpreter; compiled on a GPU the sum of "
                    "squares is reduced in another order than torch's (the DEVICES cases compare within a tolerance)")
def test_rms_norm_rounds_like_transformers_in_half_precision():
    """In fp16 the normalised row is rounded before the weight multiplies it (transformers'
    `weight * h.to(dtype)`): the kernel agrees with that reference exactly, not with a single rounding."""
    x = _randn(16, 96, device="cpu", dtype=torch.float16, seed=3)
    weight = _randn(96, device="cpu", dtype=torch.float16, seed=4)
    out = rms_norm(x, weight, 1e-6)
    assert torch.equal(out, rms_norm_reference(x, weight, 1e-6))
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert not torch.equal(out, (weight.float() * h).half())


def test_rms_norm_rejects_a_weight_of_another_size_or_dtype():
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(64, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, torch.zeros(3, 64), torch.ones(64), 1e-6)


# -- SiLU-and-mul ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("num_rows,inter", [(1, 64), (5, 80), (3, 352), (2, 1500)])  # 1500: two column blocks
def test_silu_and_mul_matches_the_reference(device, dtype, num_rows, inter):
    gate_up = _randn(num_rows, 2 * inter, device=device, dtype=dtype) * 4
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up), **TOL[dtype])


def test_other_activations_stay_on_the_reference_path():
    gate_up = _randn(3, 2 * 48, device="cpu", dtype=torch.float32)
    gelu = GatedActivation("gelu")
    assert not gelu.fusable
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(gelu(gate_up, use_kernel=True), torch.nn.functional.gelu(gate) * up)
    assert GatedActivation("silu").fusable


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_empty_batches_launch_nothing(device, dtype):
    weight = torch.ones(64, device=device, dtype=dtype)
    empty = torch.empty(0, 64, device=device, dtype=dtype)
    assert rms_norm(empty, weight, 1e-6).shape == (0, 64)
    out, residual = fused_add_rms_norm(empty, empty, weight, 1e-6)
    assert out.shape == residual.shape == (0, 64)
    assert silu_and_mul(empty).shape == (0, 32)
    q, k, v = (torch.empty(0, h, 64, device=device, dtype=dtype) for h in (4, 2, 2))
    rotary_store_kv(q, k, v, torch.empty(0, dtype=torch.long, device=device), torch.zeros(8, 128, device=device, dtype=dtype),
                    torch.zeros(2, 1, 16, 2, 64, device=device, dtype=dtype), torch.empty(0, dtype=torch.long, device=device))


# -- dispatch and CUDA graphs ---------------------------------------------------------------------


def test_dispatch_uses_kernels_on_cuda_and_for_the_triton_backend_only(monkeypatch):
    assert use_fused_kernels(torch.device("cuda"), "torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_fused_kernels(torch.device("cpu"), "triton")
    assert not use_fused_kernels(torch.device("cpu"), "torch")
    assert not use_fused_kernels(torch.device("cpu"), None)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not use_fused_kernels(torch.device("cpu"), "triton")


@NEEDS_GPU
def test_fused_kernels_replay_in_a_cuda_graph():
    """No host syncs or value-dependent allocations: the four launches capture into one graph, and a
    replay on new inputs (copied into the static buffers) gives the reference's results."""
    device, dtype, heads, kv_heads, head_dim, hidden = "cuda", torch.bfloat16, 8, 2, 128, 256
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    table = build_cos_sin_table(inv_freq, 1.0, 128, dtype).to(device)
    qkv = torch.zeros(4, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype)
    positions = torch.zeros(4, dtype=torch.long, device=device)
    slots = torch.zeros(4, dtype=torch.long, device=device)
    x = torch.zeros(4, hidden, device=device, dtype=dtype)
    residual = torch.zeros_like(x)
    weight = torch.ones(hidden, device=device, dtype=dtype)
    cache = torch.zeros(2, 4, 16, kv_heads, head_dim, device=device, dtype=dtype)

    def step():
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        rotary_store_kv(q.view(4, heads, head_dim), k.view(4, kv_heads, head_dim), v.view(4, kv_heads, head_dim),
                        positions, table, cache, slots)
        normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
        return normed, new_residual, silu_and_mul(torch.cat([normed, new_residual], dim=-1))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()

    new_qkv = _randn(4, qkv.shape[1], device=device, dtype=dtype, seed=5)
    qkv.copy_(new_qkv)
    positions.copy_(torch.tensor([3, 100, 7, 127]))
    slots.copy_(torch.tensor([0, -1, 17, 33]))
    x.copy_(_randn(4, hidden, device=device, dtype=dtype, seed=6))
    residual.copy_(_randn(4, hidden, device=device, dtype=dtype, seed=7))
    graph.replay()
    torch.cuda.synchronize()

    q, k, _ = (t.view(4, -1, head_dim) for t in new_qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    ref_q, ref_k = rotary_reference(q, k, positions, table)
    torch.testing.assert_close(qkv[:, : heads * head_dim].view(4, heads, head_dim), ref_q, **TOL[dtype])
    torch.testing.assert_close(cache[0].view(-1, kv_heads, head_dim)[17], ref_k[2], **TOL[dtype])
    ref_normed, ref_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    torch.testing.assert_close(outputs[0], ref_normed, **TOL[dtype])
    torch.testing.assert_close(outputs[1], ref_residual, **TOL[dtype])
    torch.testing.assert_close(outputs[2], silu_and_mul_reference(torch.cat([ref_normed, ref_residual], dim=-1)), **TOL[dtype])


def _launch_keys(monkeypatch, launch) -> list[tuple]:
    """What Triton would compile for each launch `launch()` makes (recorded, not run): its constexprs and
    launch options, and for each plain int argument outside the kernel's do_not_specialize Triton's own
    specialization of it (the value 1, a multiple of 16)."""
    import triton.runtime.interpreter as interpreter

    keys = []

    def record(self, *args, grid, warmup, **kwargs):
        loose = set(self.kwargs.get("do_not_specialize", ()))
        ints = tuple((name, value == 1, value % 16 == 0) for name, value in zip(self.arg_names, args)
                     if isinstance(value, int) and not isinstance(value, bool) and name not in loose)
        keys.append((self.fn.__name__, tuple(sorted(kwargs.items())), ints))

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", record)
    launch()
    return keys


@pytest.mark.skipif(CUDA, reason="records the interpreter's launches (without a GPU)")
def test_every_token_count_launches_what_one_compiled_kernel_serves(monkeypatch):
    """The fused kernels (and the K/V store, the decode reduction) take a block of tokens per program, fixed by the
    layer's shape, and the token count as an unspecialized int: no step's token count compiles a kernel of its own
    (warm-up compiles them all; a CUDA graph replays a bucket's launch)."""
    head_dim, heads, kv_heads, hidden = 16, 4, 2, 64
    table = torch.zeros(64, 2 * head_dim)
    cache = torch.zeros(2, 8, 16, kv_heads, head_dim)

    def step(tokens: int):
        def launch():
            q, k, v = _qkv(tokens, heads, kv_heads, head_dim, "cpu", torch.float32)
            positions = torch.zeros(tokens, dtype=torch.long)
            rotary_store_kv(q, k, v, positions, table, cache, positions)
            x = torch.zeros(tokens, hidden)
            rms_norm(x, torch.ones(hidden), 1e-6)
            fused_add_rms_norm(x, x, torch.ones(hidden), 1e-6)
            silu_and_mul(torch.zeros(tokens, 2 * hidden))
            store_kv(k, v, cache, positions)
            decode_attention(q, cache, positions.int() + 1, torch.zeros(tokens, 1, dtype=torch.int32), 0.25, num_splits=4)
        return _launch_keys(monkeypatch, launch)

    first = step(1)
    assert len(first) == 7  # (decode: the split kernel and the reduction)
    for tokens in (2, 3, 16, 17, 64, 100):
        assert step(tokens) == first, tokens
