"""LoRA adapters on the tensor-parallel projections, sharded like their base layers (vLLM's layout):

```
column-parallel (q/k/v, gate/up)  A [r, in] whole on every rank; B: this rank's rows of each piece
                                  y_local += (x A^T) B_local^T
row-parallel (o, down)            A: this rank's input columns; B [out, r] whole
                                  y += all_reduce(x_local A_local^T) B^T      (the small [tokens, r] product reduced)
```

`ParallelLoRALinear` is a LoRALinear (the runner's `lora_modules()`, `load_slot`, warm-up see it as one) around a
parallel layer; `load_slot` takes the adapter's whole A and B and keeps this rank's part. The slots, segments and
kernels are the single-process ones (`layers/lora.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from mmengine.distributed.parallel_linear import MergedColumnParallelLinear, RowParallelLinear
from mmengine.distributed.process_group import TensorParallelGroup
from mmengine.errors import UnsupportedModelError
from mmengine.layers.lora import LoRAContext, LoRALinear, LoRASlice, add_lora
from mmengine.layers.moe import SparseMoeBlock


class ParallelLoRALinear(LoRALinear):
    def __init__(self, base: nn.Module, names: list[str], context: LoRAContext, max_loras: int, max_rank: int,
                 tp: TensorParallelGroup) -> None:
        nn.Module.__init__(self)
        self.base = base
        self.tp = tp
        self.column = isinstance(base, MergedColumnParallelLinear)
        if self.column:
            self.in_features, self.out_features = base.input_size, base.output_size_per_rank
            self.slices = [LoRASlice(name, piece.offset, piece.size) for name, piece in zip(names, base.pieces)]
            self.rows_of = [(piece.start, piece.size) for piece in base.pieces]  # this rank's rows of each piece's B
        else:
            assert isinstance(base, RowParallelLinear) and len(names) == 1
            self.in_features, self.out_features = base.input_size_per_rank, base.output_size
            self.slices = [LoRASlice(names[0], 0, base.output_size)]
            self.rows_of = [(0, base.output_size)]
        self.context = context
        self.max_rank = max_rank
        width = len(self.slices) * max_rank
        factory = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.register_buffer("lora_a", torch.zeros(max_loras, width, self.in_features, **factory), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, width, **factory), persistent=False)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        segments = self.context.segments_for(x)
        if segments is None:
            return y
        rows = y.reshape(-1, self.out_features)
        inputs = x.reshape(-1, self.in_features)
        if self.column:
            add_lora(rows, inputs, self.lora_a, self.lora_b, segments, self.context.use_kernels)
            return rows.view(y.shape)
        if segments.starts is None:
            self.add_graph_rows(rows, inputs, segments.device_slots)
            return rows.view(y.shape)
        # row-parallel: each rank's shrink is a partial sum over its input columns; reduce it, then expand
        shrunk = torch.zeros(inputs.shape[0], self.lora_a.shape[1], dtype=torch.float32, device=inputs.device)
        for start, length, slot in zip(*segments.host_lists()):
            if slot >= 0:
                shrunk[start : start + length] = inputs[start : start + length].float() @ self.lora_a[slot].float().T
        self.tp.all_reduce(shrunk)
        for start, length, slot in zip(*segments.host_lists()):
            if slot >= 0:
                part = rows[start : start + length]
                rows[start : start + length] = (part.float() + shrunk[start : start + length] @ self.lora_b[slot].float().T).to(part.dtype)
        return rows.view(y.shape)

    def add_graph_rows(self, rows: torch.Tensor, inputs: torch.Tensor, row_slots: torch.Tensor) -> None:
        """The row-parallel delta of a decode graph's step: a row a segment, its slot (-1: none) in a device buffer
        that each replay reads, so no host list is read (a capture cannot): every slot's product, masked to its rows."""
        masks = [(row_slots[: rows.shape[0]] == slot).unsqueeze(1) for slot in range(self.lora_a.shape[0])]
        shrunk = torch.zeros(inputs.shape[0], self.lora_a.shape[1], dtype=torch.float32, device=inputs.device)
        for slot, mask in enumerate(masks):
            shrunk += (inputs.float() @ self.lora_a[slot].float().T) * mask
        self.tp.all_reduce(shrunk)
        delta = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        for slot, mask in enumerate(masks):
            delta += (shrunk @ self.lora_b[slot].float().T) * mask
        rows.copy_((rows.float() + delta).to(rows.dtype))

    def load_slot(self, slot: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One adapter's whole pairs (A [r, in], scaled B [out, r]) into `slot`, this rank's part of each."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        for j, (piece, (start, size)) in enumerate(zip(self.slices, self.rows_of)):
            pair = pairs.get(piece.name)
            if pair is None:
                continue
            lora_a, lora_b = pair
            rank = lora_a.shape[0]
            if not self.column:
                lora_a = lora_a[:, self.tp.rank * self.in_features : (self.tp.rank + 1) * self.in_features]
            a[j * self.max_rank : j * self.max_rank + rank].copy_(lora_a)
            b[piece.offset : piece.offset + piece.size, j * self.max_rank : j * self.max_rank + rank].copy_(lora_b[start : start + size])


def enable_parallel_lora(decoder: nn.Module, tp: TensorParallelGroup, max_loras: int, max_rank: int) -> LoRAContext:
    """DecoderModel.enable_lora for a decoder whose projections are split (`sharded_model.shard_decoder`)."""
    if any(isinstance(layer.mlp, SparseMoeBlock) for layer in decoder.layers):
        raise UnsupportedModelError("LoRA adapters are not supported on mixture-of-experts decoders yet")
    context = LoRAContext()
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = ParallelLoRALinear(attn.qkv_proj, ["q_proj", "k_proj", "v_proj"], context, max_loras, max_rank, tp)
        attn.o_proj = ParallelLoRALinear(attn.o_proj, ["o_proj"], context, max_loras, max_rank, tp)
        mlp.gate_up_proj = ParallelLoRALinear(mlp.gate_up_proj, ["gate_proj", "up_proj"], context, max_loras, max_rank, tp)
        mlp.down_proj = ParallelLoRALinear(mlp.down_proj, ["down_proj"], context, max_loras, max_rank, tp)
    return context
