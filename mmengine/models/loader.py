"""Reading checkpoint tensors from safetensors files, sharded or not, and checking them strictly.

Every failure names the file at fault: an unreadable index, a truncated or garbage safetensors file,
a tensor present twice. `WeightCheck` then holds a model's loading to "every parameter it needs,
exactly once, with its shape"; what it may skip is named explicitly by the model.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from mmengine.errors import CheckpointError, MMEngineError, WeightsMismatchError

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_MAX_LISTED = 8  # tensors named in one error message


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters built inside are created in `dtype` (no float32 copy first); restored afterwards."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside move to the meta device as they are registered (one allocation at a
    time, freed at once; their initialisation then costs nothing); buffers stay where they are made,
    computed as usual. `materialize_parameters` gives them storage afterwards."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            meta = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)  # (a weight_loader set before it was registered)
            param = meta
        original(module, name, param)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def materialize_parameters(model: torch.nn.Module, device: torch.device, keep_meta: Callable[[str], bool] = lambda name: False) -> None:
    """Uninitialised storage on `device` for every meta parameter but those `keep_meta` names (a tied
    parameter stays one tensor); the checkpoint fills them."""
    made: dict[int, torch.nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            full = f"{module_name}.{name}" if module_name else name
            if param is None or not param.is_meta or keep_meta(full):
                continue
            if id(param) not in made:
                made[id(param)] = torch.nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                made[id(param)].__dict__.update(param.__dict__)  # what was set on it (a parallel layer's weight_loader)
            module._parameters[name] = made[id(param)]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / _INDEX
    if index.exists():
        files = sorted({model_dir / name for name in _weight_map(index).values()})
    elif (model_dir / _SINGLE).exists():
        files = [model_dir / _SINGLE]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors weights found in {model_dir} (.bin checkpoints are not supported)")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"the checkpoint is missing weight files: {', '.join(missing)}", index)
    return files


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"unreadable safetensors index ({err})", index) from err
    except (KeyError, TypeError) as err:
        raise CheckpointError("the safetensors index has no weight_map", index) from err
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        raise CheckpointError("the safetensors index's weight_map must map tensor names to file names", index)
    return weight_map


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Turns the safetensors library's errors for a broken file into a CheckpointError naming it."""
    try:
        yield
    except MMEngineError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"not a readable safetensors file (truncated or corrupt?): {err}", path) from err


class CheckpointFiles:
    """A checkpoint's safetensors files, which a subclass's __iter__ reads one at a time: remembers which
    file each tensor name came from (`where` names it in errors) and refuses a name two files both hold."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.files = safetensors_files(self.model_dir)
        self.file_of: dict[str, Path] = {}

    def _names(self, f: Any, path: Path) -> Iterator[str]:
        """The tensor names of the open file `f` (the one at `path`), each recorded as read from it."""
        for name in f.keys():
            if name in self.file_of:
                raise WeightsMismatchError(f"tensor {name!r} is stored twice: also in {self.file_of[name].name}", path)
            self.file_of[name] = path
            yield name

    def where(self, name: str | None = None) -> str:
        """The file a tensor came from, or (for a tensor never seen) the files it was looked for in."""
        if name is not None and name in self.file_of:
            return str(self.file_of[name])
        if len(self.files) == 1:
            return str(self.files[0])
        return f"{self.model_dir} ({', '.join(f.name for f in self.files)})"


class CheckpointTensors(CheckpointFiles):
    """The checkpoint's tensors as (name, tensor), one file open at a time (see CheckpointFiles)."""

    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        super().__init__(model_dir)
        self.device = device

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for path in self.files:
            with _reading(path), safe_open(str(path), framework="pt", device=self.device) as f:
                for name in self._names(f, path):
                    yield name, f.get_tensor(name)


def iter_checkpoint(model_dir: Path, device: str = "cpu") -> CheckpointTensors:
    """Every tensor of the checkpoint as (name, tensor), one file open at a time."""
    return CheckpointTensors(model_dir, device)


def checkpoint_headers(model_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor's shape and safetensors dtype ("BF16", "F8_E4M3", "I32", ...), from the headers alone."""
    headers: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in safetensors_files(model_dir):
        with _reading(path), safe_open(str(path), framework="pt") as f:
            headers.update({name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()})
    return headers


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the safetensors headers alone."""
    return {name: shape for name, (shape, _) in checkpoint_headers(model_dir).items()}


def checkpoint_dtype(model_dir: Path) -> torch.dtype | None:
    """The floating dtype the checkpoint stores its weights in (the first 16- or 32-bit float tensor's
    header: a quantized checkpoint's 8-bit weights and scales do not say)."""
    path = safetensors_files(model_dir)[0]
    with _reading(path), safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(f.get_slice(name).get_dtype())
            if dtype is not None and not name.endswith(("_scale", "_scale_inv")):
                return dtype
    return None


def _shape(shape: Iterable[int]) -> str:
    return f"[{', '.join(map(str, shape))}]"


class WeightCheck:
    """Holds one model load to: every expected tensor exactly once, each with its expected shape.

    `expected` maps the model's names for checkpoint tensors to their shapes; `optional` ones may be
    absent (a tied LM head). `source` is what the tensors are read from: a `CheckpointTensors` lets
    errors name the file.
    """

    def __init__(
        self,
        expected: dict[str, tuple[int, ...]],
        source: Iterable[tuple[str, torch.Tensor]],
        optional: Iterable[str] = (),
    ) -> None:
        self.expected = expected
        self.optional = set(optional)
        self._where: Callable[[str | None], str] = getattr(source, "where", lambda name=None: "the given weights")
        self.loaded: dict[str, str] = {}  # our name -> the checkpoint's name it was loaded from

    def accept(self, name: str, raw_name: str, tensor: torch.Tensor) -> None:
        """Raises unless `tensor` is the first one for an expected name and has its shape."""
        if name not in self.expected:
            raise WeightsMismatchError(f"unexpected tensor {raw_name!r} {_shape(tensor.shape)}: the model has no such parameter", self._where(raw_name))
        if name in self.loaded:
            raise WeightsMismatchError(
                f"tensor {raw_name!r} loads the same parameter as {self.loaded[name]!r} (a parameter must be loaded once)",
                self._where(raw_name),
            )
        expected = self.expected[name]
        if tuple(tensor.shape) != expected:
            raise WeightsMismatchError(
                f"tensor {raw_name!r} has shape {_shape(tensor.shape)}, expected {_shape(expected)}", self._where(raw_name)
            )
        self.loaded[name] = raw_name

    def finish(self) -> None:
        """Raises if an expected, non-optional tensor was never loaded."""
        missing = [n for n in self.expected if n not in self.loaded and n not in self.optional]
        if missing:
            listed = ", ".join(f"{n!r} {_shape(self.expected[n])}" for n in missing[:_MAX_LISTED])
            more = f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
            raise WeightsMismatchError(
                f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {listed}{more} (expected shape in brackets)",
                self._where(),
            )


_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fuse_expert_tensors(weights: Iterable[tuple[str, torch.Tensor]], num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with per-expert MLP weights (`...experts.{e}.gate_proj.weight`, the layout
    transformers saves Qwen3.5-MoE in and older MoE checkpoints use) stacked into transformers 5's fused
    ones: `...experts.gate_up_proj` [experts, 2 x inter, hidden] and `...experts.down_proj` [experts,
    hidden, inter]. A layer's stack is yielded once its last expert tensor is read; one missing or
    repeated is a WeightsMismatchError naming it. Every other tensor passes through as is."""
    pending: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    for name, tensor in weights:
        match = _PER_EXPERT.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, expert, proj = match["prefix"], int(match["expert"]), match["proj"]
        if expert >= num_experts:
            raise WeightsMismatchError(f"tensor {name!r} names expert {expert}, but the model has {num_experts}")
        group = pending.setdefault(prefix, {})
        if (proj, expert) in group:
            raise WeightsMismatchError(f"tensor {name!r} appears twice (a parameter must be loaded once)")
        group[(proj, expert)] = tensor
        if len(group) == 3 * num_experts:
            del pending[prefix]
            yield f"{prefix}.gate_up_proj", torch.stack([torch.cat([group["gate_proj", e], group["up_proj", e]]) for e in range(num_experts)])
            yield f"{prefix}.down_proj", torch.stack([group["down_proj", e] for e in range(num_experts)])
    for prefix, group in pending.items():
        missing = [f"{prefix}.{e}.{proj}.weight" for e in range(num_experts) for proj in ("gate_proj", "up_proj", "down_proj")
                   if (proj, e) not in group]
        raise WeightsMismatchError(f"the checkpoint lacks {len(missing)} expert tensor(s): {', '.join(missing[:_MAX_LISTED])}")
