"""Quantized weights stay quantized on each tensor-parallel rank where the fused kernels run (the Triton backend; the
interpreter on CPU), as at TP 1: a rank's projections are TP 1's Int4Linear / Fp8Linear over exactly its slice of
the checkpoint's bits and scales, inside the parallel layer's collectives, and its dense weights never get storage.
A split that cuts an FP8 block or int4 group keeps finer scales, or is refused by name where it cannot."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from helpers import tensor_parallel_pairs
from mmengine import SamplingParams
from mmengine.config import EngineConfig
from mmengine.distributed.process_group import TensorParallelGroup
from mmengine.distributed.quantized_parallel import QuantizedColumnParallel, QuantizedRowParallel, weight_bytes
from mmengine.distributed.sharded_model import tensor_parallel_family
from mmengine.engine.startup import build_input_parts
from mmengine.errors import ConfigError
from mmengine.layers.quantized_linear import Fp8Linear, Int4Linear
from mmengine.models.loader import parameters_on_meta
from mmengine.models.quantization import PackedFp8, PackedInt4, dequantize_packed, dequantize_tensors, quantization_of, unpack_int4
from mmengine.testing import make_test_image
from mmengine.testing.quantize import quantize_checkpoint

# (method, block or group): 16 divides the tiny LLaVA's splits; FP8 blocks 48 wide cut the row-parallel inputs (32
# and 64 a rank) and are kept per 16 inputs
CASES = {"fp8": ("fp8", (16, 16)), "fp8-block16x48": ("fp8", (16, 48)), "gptq": ("gptq", 16),
         "gptq-act-order": ("gptq-act-order", 16), "awq": ("awq", 16), "w4a16-asym": ("w4a16-asym", 16)}


def _quantized(source: Path, target: Path, case: str) -> Path:
    method, size = CASES[case]
    block, group = (size, 32) if isinstance(size, tuple) else ((32, 32), size)
    return quantize_checkpoint(source, target, method, block=block, group_size=group, reference=False)[0]


def _rank_model(path: Path, rank: int, expert_parallel: bool = False) -> torch.nn.Module:
    """Rank `rank` of 2 built and loaded as the runner builds it with the fused kernels on (no collective runs)."""
    family = build_input_parts(EngineConfig(str(path), max_model_len=256)).family
    ranked = tensor_parallel_family(family, TensorParallelGroup(rank, 2, torch.device("cpu")), expert_parallel)
    with torch.device("cpu"), parameters_on_meta():
        model = type(ranked).model_class(family.hf_config)
    model.defer_quantizable_weights(torch.device("cpu"))
    packed: dict = {}
    model.load_weights(SimpleNamespace(model_dir=str(path)), quantization_of(family.hf_config), packed)
    model.swapped = model.use_quantized_weights(packed)
    return model


def _whole_dequantized(path: Path) -> dict[str, torch.Tensor]:
    spec = quantization_of(SimpleNamespace(quantization_config=json.loads((path / "config.json").read_text())["quantization_config"]))
    return dict(dequantize_tensors(((n, t) for n, t in load_file(str(path / "model.safetensors")).items()), spec))


@pytest.mark.parametrize("case", list(CASES))
def test_rank_1_holds_quantized_layers_of_exactly_its_slice(family_checkpoint, tmp_path, case):
    path = _quantized(family_checkpoint("llava"), tmp_path / case, case)
    model = _rank_model(path, 1)
    assert model.swapped == 8  # q/k/v, o, gate/up, down of both layers, as at TP 1
    assert not any(p.is_meta for p in model.parameters())
    whole, stored = _whole_dequantized(path), load_file(str(path / "model.safetensors"))
    prefix = "language_model.model"  # (the tiny LLaVA's checkpoint names)
    attn, mlp = model.language_model.layers[0].self_attn, model.language_model.layers[0].mlp
    kind = Fp8Linear if case.startswith("fp8") else Int4Linear
    for layer in (attn.qkv_proj, mlp.gate_up_proj):
        assert type(layer) is QuantizedColumnParallel and type(layer.quantized) is kind
    for layer in (attn.o_proj, mlp.down_proj):
        assert type(layer) is QuantizedRowParallel and type(layer.quantized) is kind
    # every projection's values: the rank's rows (q 32..63 of 64, k and v 16..31 of 32, gate and up 64..127 of 128) or
    # columns (o 32..63 of 64, down 64..127 of 128) of the whole dequantized weight
    rows = {"q_proj": slice(32, 64), "k_proj": slice(16, 32), "v_proj": slice(16, 32), "gate_proj": slice(64, 128),
            "up_proj": slice(64, 128)}
    expected_qkv = torch.cat([whole[f"{prefix}.layers.0.self_attn.{p}.weight"][rows[p]] for p in ("q_proj", "k_proj", "v_proj")])
    expected_gate_up = torch.cat([whole[f"{prefix}.layers.0.mlp.{p}.weight"][rows[p]] for p in ("gate_proj", "up_proj")])
    for layer, expected in ((attn.qkv_proj, expected_qkv), (mlp.gate_up_proj, expected_gate_up),
                            (attn.o_proj, whole[f"{prefix}.layers.0.self_attn.o_proj.weight"][:, 32:]),
                            (mlp.down_proj, whole[f"{prefix}.layers.0.mlp.down_proj.weight"][:, 64:])):
        assert torch.equal(_dequantized(layer.quantized), expected), layer.name
    # and the bits themselves are the checkpoint's
    o_proj = f"{prefix}.layers.0.self_attn.o_proj"
    if case.startswith("fp8"):
        assert torch.equal(attn.o_proj.quantized.weight.view(torch.uint8), stored[f"{o_proj}.weight"][:, 32:].view(torch.uint8))
        q = stored[f"{prefix}.layers.0.self_attn.q_proj.weight"][32:]
        assert torch.equal(attn.qkv_proj.quantized.weight[:32].view(torch.uint8), q.view(torch.uint8))
    elif case.startswith("gptq"):
        assert torch.equal(attn.o_proj.quantized.qweight, stored[f"{o_proj}.qweight"][4:])  # inputs 32..63: words 4..7
        assert torch.equal(attn.qkv_proj.quantized.qweight[:, :32], stored[f"{prefix}.layers.0.self_attn.q_proj.qweight"][:, 32:])
        zeros = unpack_int4(stored[f"{o_proj}.qzeros"], 1) + 1
        if case == "gptq":  # in order: groups 2 and 3 of 16 inputs
            assert torch.equal(attn.o_proj.quantized.zeros, zeros[2:].float()) and attn.o_proj.quantized.g_idx is None
        else:  # act-order: the rank's g_idx, over the groups its inputs use
            g_idx = stored[f"{o_proj}.g_idx"][32:].long()
            local = attn.o_proj.quantized.g_idx.long()
            assert torch.equal(attn.o_proj.quantized.zeros[local], zeros[g_idx].float())


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["intermediate-split", "expert-parallel"])
@pytest.mark.parametrize("method", ["fp8", "gptq"])
def test_rank_1_keeps_its_experts_quantized(family_checkpoint, tmp_path, method, expert_parallel):
    """Qwen3.5-MoE's experts (8 a layer, 32 intermediate rows, stored one tensor per expert): rank 1 holds TP 1's
    Fp8FusedExperts / Int4FusedExperts over its intermediate rows 16..31 of every expert (its down inputs: FP8 blocks 32
    wide are cut, so gate_up's and down's scales are kept per 16 inputs) or, with expert parallelism, experts 4..7
    whole, with exactly the values of the whole dequantized experts."""
    from mmengine.distributed.quantized_parallel_experts import QuantizedParallelExperts
    from mmengine.layers.moe import Fp8FusedExperts, Int4FusedExperts

    block, group = ((16, 32), 32) if method == "fp8" else ((32, 32), 16)
    path = quantize_checkpoint(family_checkpoint("qwen3_5_moe"), tmp_path / method, method, block=block, group_size=group,
                               reference=False)[0]
    model = _rank_model(path, 1, expert_parallel)
    whole = _whole_dequantized(path)
    for index, layer in enumerate(model.language_model.layers):
        experts = layer.mlp.experts
        assert type(experts) is QuantizedParallelExperts
        q = experts.quantized
        assert type(q) is (Fp8FusedExperts if method == "fp8" else Int4FusedExperts)
        assert q.group == (32 if method == "fp8" and expert_parallel else 16)  # (the split cuts 32-wide blocks)
        if method == "fp8":  # the shared expert's gate [1, 64], whole on every rank: TP 1's quantized layer too
            assert type(layer.mlp.shared_expert_gate) is Fp8Linear
        held = range(4, 8) if expert_parallel else range(8)
        rows = slice(0, 32) if expert_parallel else slice(16, 32)
        for local, e in enumerate(held):
            name = f"model.language_model.layers.{index}.mlp.experts.{e}"
            gate_up = torch.cat([whole[f"{name}.gate_proj.weight"][rows], whole[f"{name}.up_proj.weight"][rows]])
            down = whole[f"{name}.down_proj.weight"][:, rows]
            if method == "fp8":
                ours = [dequantize_packed(PackedFp8(q.gate_up_proj[local], q.gate_up_scales[local], q.group)),
                        dequantize_packed(PackedFp8(q.down_proj[local], q.down_scales[local], q.group))]
            else:
                ours = [dequantize_packed(PackedInt4(q.gate_up_proj[local], q.gate_up_scales[local], q.gate_up_zeros[local], q.group)),
                        dequantize_packed(PackedInt4(q.down_proj[local], q.down_scales[local], q.down_zeros[local], q.group))]
            assert torch.equal(ours[0], gate_up) and torch.equal(ours[1], down), (index, e)
    assert not any(p.is_meta for p in model.parameters())


def test_update_weights_refuses_a_projection_kept_quantized_by_name(family_checkpoint, tmp_path):
    """As at TP 1: a new value for a weight whose layer runs quantized is refused naming it; others load."""
    from mmengine.errors import WeightsMismatchError

    path = _quantized(family_checkpoint("llava"), tmp_path / "fp8", "fp8")
    model = _rank_model(path, 1)
    norm = "language_model.model.layers.0.input_layernorm.weight"
    loaded: list[str] = []
    model.update_weights([(norm, torch.full((64,), 2.0))], loaded)
    assert loaded == [model.checkpoint_name(norm)] and bool((model.get_parameter(loaded[0]) == 2.0).all())
    for name in ("language_model.model.layers.0.self_attn.k_proj.weight", "language_model.model.layers.1.mlp.down_proj.weight"):
        model.update_check = None
        with pytest.raises(WeightsMismatchError, match=f"{name}.*runs on quantized weights"):
            model.update_weights([(name, torch.zeros(32 if "k_proj" in name else 64, 64 if "k_proj" in name else 128))], [])


def _dequantized(layer: Fp8Linear | Int4Linear) -> torch.Tensor:
    """The layer's weight as its kernel computes it (models/quantization.py's dequantize_packed of its buffers)."""
    if isinstance(layer, Fp8Linear):
        return dequantize_packed(PackedFp8(layer.weight, layer.scales, layer.group_k))
    return dequantize_packed(PackedInt4(layer.qweight, layer.scales, layer.zeros, layer.group_size, layer.g_idx))


def test_the_rank_holds_quantized_bytes(family_checkpoint, tmp_path):
    """Rank 1 of an FP8 LLaVA holds its decoder projections in one byte a weight (plus fp32 scales per 16 inputs):
    fewer bytes than the same rank dequantizing them in fp32."""
    path = _quantized(family_checkpoint("llava"), tmp_path / "fp8", "fp8")
    kept = weight_bytes(_rank_model(path, 1))
    family = build_input_parts(EngineConfig(str(path), max_model_len=256)).family
    dense = type(tensor_parallel_family(family, TensorParallelGroup(1, 2, torch.device("cpu")))).model_class(family.hf_config)
    projections = 2 * (64 * 64 + 64 * 32 + 128 * 64 + 64 * 64)  # the rank's q/k/v, o, gate/up and down rows, both layers
    assert weight_bytes(dense) - kept == projections * 4 - projections * (1 + 4 / 16)


def test_a_split_that_cuts_a_block_into_pieces_under_8_is_refused_by_name(family_checkpoint, tmp_path):
    """FP8 blocks 36 inputs wide: rank 1's o_proj starts at input 32, inside a block, and gcd(36, 32) = 4 inputs a
    scale cannot be kept; start-up refuses, naming the layer, the sizes, the block and the TP size."""
    path = quantize_checkpoint(family_checkpoint("llava"), tmp_path / "q", "fp8", block=(16, 36), reference=False)[0]
    with pytest.raises(ConfigError, match=r"(o_proj|down_proj): input size (32|64) per rank \(tensor_parallel_size=2.*"
                                          r"cuts an FP8 block of 36 inputs into pieces of 4"):
        _rank_model(path, 1)


def test_tp2_ranks_running_the_quantized_kernels_give_tp1s_tokens(family_checkpoint, tmp_path):
    """FP8 blocks and act-order GPTQ at TP 2 with the Triton kernels (the interpreter here), against TP 1 with the same
    kernels on the same quantized weights: the same greedy tokens, log-probabilities within 1e-5 (fp32, both
    dequantizing the same bits in registers; only the order of the row-parallel sums differs, split over two ranks
    and all-reduced: about 1e-6 seen), and each rank reports its quantized bytes."""
    paths = {case: _quantized(family_checkpoint("llava"), tmp_path / case, case) for case in ("fp8", "gptq-act-order")}
    options = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 64, "max_num_seqs": 2,
               "attn_backend": "triton", "enforce_eager": True}
    greedy = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0, logprobs=1)
    prompt, picture = "USER: <image>\nWhat is it? ASSISTANT:", make_test_image(43, size=(32, 32))
    with tensor_parallel_pairs(paths, **options) as pairs:
        for case, (_, one, two) in pairs.items():
            assert one.runner.num_quantized_projections == 8
            (reference,) = one.generate(prompt, images=[picture], sampling_params=greedy, use_tqdm=False)
            (out,) = two.generate(prompt, images=[picture], sampling_params=greedy, use_tqdm=False)
            assert out.token_ids == reference.token_ids, case
            assert max(abs(a.logprob - b.logprob) for a, b in zip(reference.logprobs, out.logprobs, strict=True)) < 1e-5
            # each rank's memory report: what rank 0 built here holds (its projections quantized: test above)
            assert two.runner.weight_bytes_per_rank == [weight_bytes(_rank_model(paths[case], 0))] * 2


@pytest.mark.parametrize("case", ["fp8", "gptq"])
def test_the_budget_counts_each_ranks_quantized_bytes(family_checkpoint, tmp_path, capsys, case):
    """`mmengine budget --tensor-parallel-size 2`: a rank's parameters are the plain checkpoint's rank's, its bytes kept
    quantized fewer than dequantized (in bf16), and within 10% of what rank 0 built here holds in fp32 (the headers
    count an FP8 block's scale once, the kernel layout once a row; the last vision layer, unused, is counted)."""
    from mmengine.cli import main

    source = family_checkpoint("llava")
    path = _quantized(source, tmp_path / case, case)

    def per_rank(model: Path, dtype: str) -> dict[str, tuple[int, int]]:
        """label -> (bytes, parameters) of each `weights per rank` line."""
        main(["budget", "--model", str(model), "--device", "cpu", "--dtype", dtype, "--tensor-parallel-size", "2"])
        found = (re.match(r"  (weights per rank[^0-9]*?)\s+(\d+)\s+bytes: (\d+)", line) for line in capsys.readouterr().out.splitlines())
        return {m[1]: (int(m[2]), int(m[3])) for m in found if m}

    dense = per_rank(source, "bfloat16")["weights per rank"]
    lines = per_rank(path, "bfloat16")
    kept, dequantized = lines["weights per rank (quantized)"], lines["weights per rank (dequantized)"]
    assert kept[1] == dequantized[1] == dense[1] and dequantized[0] == dense[0]
    assert kept[0] < dequantized[0]
    in_fp32 = per_rank(path, "float32")["weights per rank (quantized)"][0]
    assert abs(in_fp32 - weight_bytes(_rank_model(path, 0))) < 0.1 * in_fp32
