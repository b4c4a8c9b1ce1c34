"""FP8 weights read by slice at tensor parallelism (distributed/fp8_slices.py): a slice of a weight, with the
scales of the blocks it covers, dequantizes to exactly the slice of the whole dequantized weight, and a rank
loading an FP8 checkpoint reads only its half of each split projection."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mmengine.distributed.fp8_slices import Fp8WeightSlice
from mmengine.models.quantization import WeightQuantization, dequantize_fp8


@pytest.mark.parametrize("block, scale_shape", [((32, 32), (3, 3)), ((16, 64), (6, 2)), (None, (96, 1)), (None, (1,))],
                         ids=["block32", "block16x64", "per-channel", "per-tensor"])
def test_a_slice_dequantizes_to_the_slice_of_the_whole_weight(tmp_path, block, scale_shape):
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 80, generator=generator) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(scale_shape, generator=generator) + 0.1
    save_file({"w.weight": weight}, tmp_path / "model.safetensors")
    spec = WeightQuantization("fp8", scale_name="weight_scale_inv", block=block)
    whole = dequantize_fp8(weight, scale, spec, "w.weight")
    lazy = Fp8WeightSlice(tmp_path / "model.safetensors", "w.weight", weight.shape, scale, spec)
    assert lazy.get_shape() == [96, 80]
    assert torch.equal(lazy[...], whole)
    for rows in (slice(0, 48), slice(48, 96), slice(10, 37)):  # block-aligned halves, and a range cutting blocks
        assert torch.equal(lazy[(rows,)], whole[rows])
    for cols in (slice(0, 40), slice(40, 80), slice(17, 63)):
        assert torch.equal(lazy[(slice(None), cols)], whole[:, cols])
    with pytest.raises(TypeError, match="contiguous"):
        lazy[[1, 2]]


def test_a_rank_reads_only_its_part_of_each_fp8_weight(family_checkpoint, tmp_path, monkeypatch):
    """Rank 1 of 2 on an FP8 LLaVA, loaded here (no collective runs): every split decoder projection reads half of
    its weight, the replicated ones (the vision tower's) the whole, and the rank's parameters equal the halves of
    the weights dequantized whole."""
    from mmengine.config import EngineConfig
    from mmengine.distributed import fp8_slices
    from mmengine.distributed.process_group import TensorParallelGroup
    from mmengine.distributed.sharded_model import tensor_parallel_family
    from mmengine.engine.startup import build_input_parts
    from mmengine.testing.quantize import quantize_checkpoint

    path, reference = quantize_checkpoint(family_checkpoint("llava"), tmp_path / "fp8", "fp8")
    read: dict[str, int] = {}
    original = fp8_slices.Fp8WeightSlice.__getitem__

    def recording(self, index):
        value = original(self, index)
        read[self.name] = read.get(self.name, 0) + value.numel()
        return value

    monkeypatch.setattr(fp8_slices.Fp8WeightSlice, "__getitem__", recording)
    family = build_input_parts(EngineConfig(str(path), max_model_len=256)).family
    ranked = tensor_parallel_family(family, TensorParallelGroup(1, 2, torch.device("cpu")))
    model = type(ranked).model_class(family.hf_config)
    model.load_weights(type("Weights", (), {"model_dir": str(path)})())

    from safetensors.torch import load_file

    dense = {name: t for file in sorted(Path(reference).glob("*.safetensors")) for name, t in load_file(str(file)).items()}
    decoder = {name for name in read if ".layers." in name and "language_model" in name}
    assert decoder and all(read[name] * 2 == dense[name].numel() for name in decoder), {n: read[n] for n in decoder}
    o_proj = next(name for name in decoder if name.endswith("self_attn.o_proj.weight"))  # row-parallel: the second half of the columns
    ours = model.get_parameter(model.checkpoint_name(o_proj)).detach()
    assert torch.equal(ours, dense[o_proj][:, dense[o_proj].shape[1] // 2 :].to(ours.dtype))
