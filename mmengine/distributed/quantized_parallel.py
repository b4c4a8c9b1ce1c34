"""A tensor-parallel rank's projections kept quantized, as TP 1 keeps them where the fused kernels run.

Where TP 1 swaps a dense projection for Int4Linear or Fp8Linear (models/vlm.py's use_quantized_weights: the fused
kernels in use, no LoRA), each rank swaps its parallel linear for the same quantized layer over ITS slice of the
checkpoint's bits (quantized_rank_layout.py), inside the parallel layer's collectives:

```
ColumnParallelLinear (QKV, gate/up)  QuantizedColumnParallel  Int4Linear / Fp8Linear of the rank's outputs, pieces
                                                              concatenated as TP 1 concatenates q/k/v and gate/up
RowParallelLinear (o, down)          QuantizedRowParallel     the quantized GEMM over the rank's inputs, then the
                                                              all-reduce, the bias added once after it
(Expert)ParallelFusedExperts         QuantizedParallelExperts Fp8FusedExperts / Int4FusedExperts of the rank's
                                                              intermediate share or whole experts, all-reduced
                                                              (quantized_parallel_experts.py)
```

The rank's dense weight is never given storage: built under the runner's `parameters_on_meta`, it stays on meta
(`deferred_weights`) and the load keeps the rank's kernel layout instead (`keep_quantized`). A weight TP 1 would
dequantize (a layout the kernels do not take, shards that disagree, a checkpoint storing q/k/v fused) is
dequantized into the rank's dense weight here too, which then gets its storage.
"""

from __future__ import annotations

import torch
from torch import nn

from mmengine.distributed.parallel_linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from mmengine.distributed.quantized_parallel_experts import (
    ParallelExperts,
    QuantizedParallelExperts,
    expert_rank_layout,
    load_dequantized,
    local_expert,
    quantized_experts,
)
from mmengine.distributed.quantized_rank_layout import RankSlice, rank_layout
from mmengine.distributed.quantized_slices import QuantizedWeightSlice
from mmengine.errors import WeightsMismatchError
from mmengine.layers.moe import QuantizedFusedExperts
from mmengine.layers.quantized_linear import QuantizedLinear, fuse_shards
from mmengine.models.llama import STACKED_PROJECTIONS
from mmengine.models.quantization import PackedFp8, PackedInt4, dequantize_packed

ParallelLinear = (ColumnParallelLinear, RowParallelLinear)
Projection = (ColumnParallelLinear, RowParallelLinear, nn.Linear)  # nn.Linear: one every rank holds whole (replicated)
_DECODER = "language_model.layers."
Layouts = dict[str, dict[int, PackedFp8 | PackedInt4]]  # a parallel linear's path -> its pieces' rank layouts


class QuantizedColumnParallel(nn.Module):
    """A column-parallel projection over the rank's outputs, kept quantized (`quantized`, with the bias)."""

    def __init__(self, quantized: QuantizedLinear, dense: ColumnParallelLinear) -> None:
        super().__init__()
        self.quantized = quantized
        self.tp, self.name, self.gather_output = dense.tp, dense.name, dense.gather_output
        self.input_size, self.output_size, self.output_size_per_rank = dense.input_size, dense.output_size, dense.output_size_per_rank

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size_per_rank}/{self.output_size}, tp={self.tp.rank}/{self.tp.size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quantized(x)
        return self.tp.all_gather_last_dim(y) if self.gather_output else y


class QuantizedRowParallel(nn.Module):
    """A row-parallel projection over the rank's inputs, kept quantized (`quantized`, no bias): the partial sums
    all-reduced, then the bias (every rank holds it) added once."""

    def __init__(self, quantized: QuantizedLinear, dense: RowParallelLinear) -> None:
        super().__init__()
        self.quantized = quantized
        self.tp, self.name = dense.tp, dense.name
        self.input_size, self.output_size, self.input_size_per_rank = dense.input_size, dense.output_size, dense.input_size_per_rank
        self.input_is_parallel, self.reduce_results = dense.input_is_parallel, dense.reduce_results
        self.bias = dense.bias

    def extra_repr(self) -> str:
        return f"in={self.input_size_per_rank}/{self.input_size}, out={self.output_size}, tp={self.tp.rank}/{self.tp.size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = x.narrow(-1, self.tp.rank * self.input_size_per_rank, self.input_size_per_rank)
        y = self.quantized(x)
        if not self.reduce_results:  # the caller reduces: the bias goes with rank 0's partial sum alone
            return y + self.bias if self.bias is not None and self.tp.rank == 0 else y
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y


def deferred_weights(model: nn.Module) -> set[str]:
    """The decoder's parallel projections' weights and SiLU experts' a quantized layer may replace (left on meta at
    build)."""
    deferred = set()
    for path, module in model.named_modules():
        if path.startswith(_DECODER) and isinstance(module, Projection):
            deferred.add(f"{path}.weight")
        elif path.startswith(_DECODER) and isinstance(module, ParallelExperts) and module.act.fusable:
            deferred |= {f"{path}.gate_up_proj", f"{path}.down_proj"}
    return deferred


class RankQuantizedLoad:
    """The rank's load of a quantized checkpoint with the fused kernels on: `target` says, for each checkpoint
    tensor and the parameter it loads into, whether its slice was kept as a kernel layout (None) or which
    parameter (given storage if it had none) to load it into."""

    def __init__(self, model: nn.Module, layouts: Layouts) -> None:
        self.model = model
        self.layouts = layouts
        self.owners = {id(module.weight): (path, module) for path, module in model.named_modules()
                       if path.startswith(_DECODER) and isinstance(module, Projection)}

    def expert(self, prefix: str, expert: int, projection: str, tensor: object) -> bool:
        """Whether one expert's projection (stored apart) was kept as the rank's kernel layout; if not, the layer's
        experts have storage for load_expert."""
        module = self.model.get_submodule(prefix)
        layout = None
        if isinstance(module, ParallelExperts) and isinstance(tensor, QuantizedWeightSlice) and module.act.fusable:
            held = getattr(module, "holds", lambda e: True)(expert)
            layout = expert_rank_layout(module, expert, projection, tensor) if held else None
        if layout is None:
            for param in (module.gate_up_proj, module.down_proj):
                materialized(self.model, param)
            return False
        self.layouts.setdefault(prefix, {})[(local_expert(module, expert), projection)] = layout
        return True

    def target(self, parameter: nn.Parameter, tensor: object, piece: object) -> nn.Parameter | None:
        owner = self.owners.get(id(parameter))
        if owner is None or not isinstance(tensor, QuantizedWeightSlice):
            return materialized(self.model, parameter)
        path, module = owner
        found = _rank_slices(module, piece, tensor)
        layouts = {index: rank_layout(tensor, part) for index, part in found.items()}
        if not layouts or any(layout is None for layout in layouts.values()):
            return materialized(self.model, parameter)
        self.layouts.setdefault(path, {}).update(layouts)
        return None


def _rank_slices(module: nn.Module, piece: object, weight: QuantizedWeightSlice) -> dict[int, RankSlice]:
    """The rank's rows or columns of `weight`, by the index of the piece they fill: one piece, or each piece of a
    checkpoint tensor holding them all one after another (Gated DeltaNet's in_proj_qkv); none for a tensor already
    cut to some shard (dequantized)."""
    out, inp = weight.shape
    if isinstance(module, nn.Linear):  # replicated: the whole weight, as at TP 1
        return {0: RankSlice(0, out, 0, inp, "a replicated projection", 1)}
    tp = module.tp
    if isinstance(module, RowParallelLinear):
        size = module.input_size_per_rank
        return {0: RankSlice(0, out, tp.rank * size, (tp.rank + 1) * size, module.name, tp.size)}
    if isinstance(module, MergedColumnParallelLinear):
        if piece is not None:
            p = module.pieces[module.shard_ids[piece]]
            return {module.shard_ids[piece]: RankSlice(p.start, p.start + p.size, 0, inp, f"{module.name}[{piece!r}]", tp.size)}
        if out != sum(p.full for p in module.pieces):
            return {}
        starts = [sum(p.full for p in module.pieces[:i]) for i in range(len(module.pieces))]
        return {i: RankSlice(at + p.start, at + p.start + p.size, 0, inp, module.name, tp.size)
                for i, (at, p) in enumerate(zip(starts, module.pieces))}
    size = module.output_size_per_rank
    return {0: RankSlice(tp.rank * size, (tp.rank + 1) * size, 0, inp, module.name, tp.size)}


def materialized(model: nn.Module, parameter: nn.Parameter) -> nn.Parameter:
    """`parameter`, given storage on the model's device where it is on meta (its weight_loader kept)."""
    if not parameter.is_meta:
        return parameter
    device = model.language_model.embed_tokens.weight.device  # never deferred
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is parameter:
                made = nn.Parameter(torch.empty_like(param, device=device), requires_grad=False)
                made.__dict__.update(param.__dict__)
                module._parameters[name] = made
                return made
    raise WeightsMismatchError("a deferred parameter belongs to no module")


def use_rank_quantized_weights(model: nn.Module, layouts: Layouts) -> int:
    """Swaps each parallel projection whose pieces all came as kernel layouts of one format for its quantized
    layer; the rest are dequantized into their dense weights. Returns how many were swapped."""
    embed = model.language_model.embed_tokens.weight  # the device and the model's dtype
    swapped = 0
    for path, module in list(model.named_modules()):
        pieces = layouts.pop(path, None)
        if pieces is None:
            continue
        if isinstance(module, ParallelExperts):
            experts = quantized_experts(module, pieces, embed.device)
            if experts is None:  # as TP 1: dequantized into the dense experts
                for param in (module.gate_up_proj, module.down_proj):
                    materialized(model, param)
                load_dequantized(module, pieces)
            else:
                parent_name, _, attr = path.rpartition(".")
                setattr(model.get_submodule(parent_name), attr, experts)
                swapped += 1
            continue
        count = len(module.pieces) if isinstance(module, MergedColumnParallelLinear) else 1
        parts = [pieces.get(i) for i in range(count)]
        is_row = isinstance(module, RowParallelLinear)
        bias = None if is_row or module.bias is None else module.bias.data
        quantized = fuse_shards(parts, bias, embed.device, embed.dtype) if all(p is not None for p in parts) else None
        if quantized is None:  # as TP 1: dequantized into the dense weight
            weight = materialized(model, module.weight)
            with torch.no_grad():
                for index, layout in pieces.items():
                    dense = dequantize_packed(layout).to(device=embed.device, dtype=embed.dtype)
                    if isinstance(module, nn.Linear):
                        weight.copy_(dense)
                    else:
                        module.weight_loader(weight, dense, index) if count > 1 else module.weight_loader(weight, dense)
            continue
        parent_name, _, attr = path.rpartition(".")
        if isinstance(module, nn.Linear):  # replicated: TP 1's layer as it is, no collective
            if (quantized.in_features, quantized.out_features) != (module.in_features, module.out_features):
                raise WeightsMismatchError(f"{path}: its quantized weight makes a {quantized.in_features} x "
                                           f"{quantized.out_features} projection, expected {module.in_features} x {module.out_features}")
            setattr(model.get_submodule(parent_name), attr, quantized)
            swapped += 1
            continue
        rank_in = module.input_size_per_rank if is_row else module.input_size
        rank_out = module.output_size if is_row else module.output_size_per_rank
        if (quantized.in_features, quantized.out_features) != (rank_in, rank_out):
            raise WeightsMismatchError(f"{module.name}: the rank's quantized slices make a {quantized.in_features} x "
                                       f"{quantized.out_features} projection, expected {rank_in} x {rank_out}")
        wrapper = QuantizedRowParallel(quantized, module) if is_row else QuantizedColumnParallel(quantized, module)
        setattr(model.get_submodule(parent_name), attr, wrapper)
        swapped += 1
    left = [name for name, param in model.named_parameters() if param.is_meta]
    if left:
        raise RuntimeError(f"parameters left without storage after loading: {', '.join(left[:8])}")
    return swapped


def runs_quantized(model: nn.Module, name: str) -> bool:
    """Whether the checkpoint weight `name` (ours) loaded into a projection now kept quantized (which update_weights
    cannot replace, as at TP 1)."""
    parts = name.split(".")[:-1]
    if parts and parts[-1] in STACKED_PROJECTIONS:
        parts[-1] = STACKED_PROJECTIONS[parts[-1]][0]
    module = model
    for part in parts:  # (an expert's projection: the experts above it)
        module = getattr(module, part, None)
        if isinstance(module, (QuantizedColumnParallel, QuantizedRowParallel, QuantizedParallelExperts, QuantizedLinear)):
            return True
    return False


def weight_bytes(model: nn.Module) -> int:
    """The bytes of a model's weights: its parameters and its quantized layers' buffers (bits, scales, zeros)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedFusedExperts)):
            total += sum(b.numel() * b.element_size() for b in module.buffers(recurse=False))
    return total
