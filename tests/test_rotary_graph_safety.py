"""A rotary step makes no host tensor: a CUDA graph being captured refuses any copy from an unpinned
host tensor to the GPU, and the decode graphs capture every family's forward, rotary step included
(Qwen3.5 rotates on the PyTorch path even on a GPU; Qwen2-VL / Qwen3-VL do where the fused kernels are
off; Gemma 4 always). Checked without a GPU: the rotary tables are moved to (or built on) the meta
device, and a dispatch mode records every op that touches a host tensor while the step runs."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig

from mmengine.layers.rotary import RotaryEmbedding, RotaryStep, build_cos_sin_table
from mmengine.models.gemma4_text import layer_attention, rope_inv_freq_of
from mmengine.models.llama import head_dim_of
from mmengine.models.qwen3_5_model import rotary_dim_of

QWEN = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"]


class HostTensors(TorchDispatchMode):
    """Records the ops that take or make a host tensor (0-d ones aside: Python scalars wrapped as
    tensors are no host-to-device copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves((args, kwargs, out)):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" and leaf.dim() > 0:
                self.seen.append(f"{func} with a host tensor of shape {tuple(leaf.shape)}")
        return out


def _text_config(path):
    return AutoConfig.from_pretrained(path).text_config


def _decoder_rotary(name: str, config) -> RotaryEmbedding:
    """The RotaryEmbedding the family's decoder builds (models/llama.py, models/qwen3_5.py)."""
    return RotaryEmbedding(config, rotary_dim_of(config) if name == "qwen3_5" else head_dim_of(config))


@pytest.mark.parametrize("name", QWEN)
def test_an_mrope_step_on_the_device_makes_no_host_tensor(family_checkpoint, name):
    config = _text_config(family_checkpoint(name))
    rotary = _decoder_rotary(name, config).to("meta")  # moved to the model's device: here a stand-in for the GPU
    assert rotary.mrope_section is not None
    positions = torch.zeros(5, 3, dtype=torch.long, device="meta")
    with HostTensors() as host:
        step = rotary.step(positions, use_kernel=False)  # the reference path: it gathers cos/sin by section
    assert step.cos is not None and step.cos.is_meta and step.cos.shape == (5, 1, rotary.head_dim)
    assert host.seen == []


@pytest.mark.parametrize("name", QWEN)
def test_the_mrope_columns_move_with_the_model(family_checkpoint, name):
    rotary = _decoder_rotary(name, _text_config(family_checkpoint(name)))
    assert rotary.mrope_cols.device == rotary.cos_sin.device
    columns = rotary.mrope_cols.clone()
    rotary.to("meta")
    assert rotary.mrope_cols.is_meta and rotary.cos_sin.is_meta
    assert "mrope_cols" not in rotary.state_dict()  # built from the config, never read from a checkpoint
    assert columns.shape == (2 * rotary.head_dim,) and set(columns.tolist()) == {0, 1, 2}


@pytest.mark.parametrize("kind", ["sliding_attention", "full_attention"])
def test_a_gemma4_step_on_the_device_makes_no_host_tensor(family_checkpoint, kind):
    config = _text_config(family_checkpoint("gemma4"))
    (head_dim,) = {layer.head_dim for layer in layer_attention(config) if layer.kind == kind}
    with torch.device("meta"):  # as Gemma4TextModel builds its tables
        table = build_cos_sin_table(rope_inv_freq_of(config, kind, head_dim).to(torch.get_default_device()), 1.0,
                                    config.max_position_embeddings, torch.get_default_dtype())
    positions = torch.zeros(5, dtype=torch.long, device="meta")
    with HostTensors() as host:
        step = RotaryStep.gather(positions, table, use_kernel=False)  # as its forward does, for each kind
    assert step.cos is not None and step.cos.is_meta and step.cos.shape == (5, 1, head_dim)
    assert host.seen == []
