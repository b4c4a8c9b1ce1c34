"""Quantized weights read by slice at tensor parallelism (distributed/quantized_slices.py): a slice of a weight, with
its scales (and zeros), dequantizes to exactly the slice of the whole dequantized weight, in every format, and a
rank loading a quantized checkpoint reads only its half of each split projection."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmengine.distributed.checkpoint_slices import CheckpointSlices
from mmengine.distributed.quantized_slices import QuantizedWeightSlice, quantized_weight_slices
from mmengine.models.quantization import WeightQuantization, dequantize_fp8, dequantize_tensors, quantization_of
from mmengine.testing.quantize import quantize_checkpoint

METHODS = ["fp8", "compressed-tensors", "w4a16", "w4a16-asym", "gptq", "gptq-act-order", "awq"]


@pytest.mark.parametrize("block, scale_shape", [((32, 32), (3, 3)), ((16, 64), (6, 2)), (None, (96, 1)), (None, (1,))],
                         ids=["block32", "block16x64", "per-channel", "per-tensor"])
def test_an_fp8_slice_dequantizes_to_the_slice_of_the_whole_weight(tmp_path, block, scale_shape):
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 80, generator=generator) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(scale_shape, generator=generator) + 0.1
    save_file({"w.weight": weight}, tmp_path / "model.safetensors")
    spec = WeightQuantization("fp8", scale_name="weight_scale_inv", block=block)
    whole = dequantize_fp8(weight, scale, spec, "w.weight")
    lazy = QuantizedWeightSlice(tmp_path / "model.safetensors", "w.weight", (96, 80), {"weight_scale_inv": scale}, spec)
    assert lazy.get_shape() == [96, 80]
    assert torch.equal(lazy[...], whole)
    for rows in (slice(0, 48), slice(48, 96), slice(10, 37)):  # block-aligned halves, and a range cutting blocks
        assert torch.equal(lazy[(rows,)], whole[rows])
    for cols in (slice(0, 40), slice(40, 80), slice(17, 63)):
        assert torch.equal(lazy[(slice(None), cols)], whole[:, cols])
    with pytest.raises(TypeError, match="contiguous"):
        lazy[[1, 2]]


@pytest.mark.parametrize("method", METHODS)
def test_every_formats_slices_equal_the_slices_of_the_whole_dequantized_weight(family_checkpoint, tmp_path, method):
    """Each quantized weight of a tiny LLaVA: halves by rows and by columns, and ranges cutting int4 words and
    groups, against models/quantization.py's whole dequantization (what one process loads)."""
    path, _ = quantize_checkpoint(family_checkpoint("llava"), tmp_path / method, method, reference=False)
    spec = quantization_of(SimpleNamespace(quantization_config=json.loads((path / "config.json").read_text())["quantization_config"]))
    whole = {name: t for name, t in dequantize_tensors(
        ((n, t) for f in sorted(path.glob("*.safetensors")) for n, t in load_file(str(f)).items()), spec)}
    lazy = {name: t for name, t in quantized_weight_slices(CheckpointSlices(path), spec) if isinstance(t, QuantizedWeightSlice)}
    assert lazy and set(lazy) <= set(whole)
    for name, weight in lazy.items():
        dense = whole[name]
        assert weight.get_shape() == list(dense.shape), name
        out, inp = dense.shape
        for rows in (slice(0, out // 2), slice(out // 2, out), slice(3, out - 5)):
            assert torch.equal(weight[(rows,)], dense[rows]), (name, rows)
        for cols in (slice(0, inp // 2), slice(inp // 2, inp), slice(5, inp - 3)):
            assert torch.equal(weight[(slice(None), cols)], dense[:, cols]), (name, cols)


@pytest.mark.parametrize("method", ["fp8", "gptq"])
def test_a_rank_reads_only_its_part_of_each_quantized_weight(family_checkpoint, tmp_path, monkeypatch, method):
    """Rank 1 of 2 on a quantized LLaVA, loaded here (no collective runs): every split decoder projection reads half
    of its weight, and the rank's parameters equal the halves of the weights dequantized whole."""
    from mmengine.config import EngineConfig
    from mmengine.distributed import quantized_slices
    from mmengine.distributed.process_group import TensorParallelGroup
    from mmengine.distributed.sharded_model import tensor_parallel_family
    from mmengine.engine.startup import build_input_parts

    path, reference = quantize_checkpoint(family_checkpoint("llava"), tmp_path / method, method)
    read: dict[str, int] = {}
    original = quantized_slices.QuantizedWeightSlice.__getitem__

    def recording(self, index):
        value = original(self, index)
        read[self.name] = read.get(self.name, 0) + value.numel()
        return value

    monkeypatch.setattr(quantized_slices.QuantizedWeightSlice, "__getitem__", recording)
    family = build_input_parts(EngineConfig(str(path), max_model_len=256)).family
    ranked = tensor_parallel_family(family, TensorParallelGroup(1, 2, torch.device("cpu")))
    model = type(ranked).model_class(family.hf_config)
    model.load_weights(type("Weights", (), {"model_dir": str(path)})())

    dense = {name: t for file in sorted(Path(reference).glob("*.safetensors")) for name, t in load_file(str(file)).items()}
    decoder = {name.rpartition(".")[0] + ".weight": n for name, n in read.items() if ".layers." in name and "language_model" in name}
    assert decoder and all(n * 2 == dense[name].numel() for name, n in decoder.items()), decoder
    o_proj = next(name for name in decoder if name.endswith("self_attn.o_proj.weight"))  # row-parallel: the second half of the columns
    ours = model.get_parameter(model.checkpoint_name(o_proj)).detach()
    assert torch.equal(ours, dense[o_proj][:, dense[o_proj].shape[1] // 2 :].to(ours.dtype))
