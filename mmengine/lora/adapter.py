"""Reading a PEFT LoRA adapter from disk (`adapter_config.json` + `adapter_model.safetensors`), strictly.

Keys are accepted in the layouts transformers and PEFT produce for the supported families, e.g.
`base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_A.weight` (transformers 5)
and `base_model.model.language_model.model.layers.3...` or `base_model.model.model.layers.3...`
(older layouts): what matters is the decoder layer, the projection and A or B. LoRA on the vision
side (any linear layer of the tower or the projector, e.g. `...vision_tower...q_proj`, `...visual.
blocks.0.attn.qkv`, `...multi_modal_projector.linear_1`, Idefics3's `...connector.modality_projection.
proj`) is mapped onto the model's layer through the family's checkpoint names. Anything else is an AdapterError naming the file and the tensor or field:
a layer or projection the model lacks, a shape that does not fit, a rank above max_lora_rank, and
features mmengine does not run (DoRA, modules_to_save, trained biases, per-module rank or alpha
patterns, LoRA on the embeddings or the LM head) are refused by name rather than ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmengine.errors import AdapterError

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>[a-z_]+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$"
)
_VISION_MARKERS = ("vision_tower", "vision_model", "visual", "multi_modal_projector", "merger", "connector")
_VISION_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<path>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
# adapter_config.json fields that change what the weights mean; a set value is refused by name.
_REFUSED_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained copies of modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)",
    "lora_bias": "trained LoRA biases (lora_bias)",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "use_bdlora",
    "arrow_config": "Arrow routing (arrow_config)",
    "monteclora_config": "monteclora_config",
    "velora_config": "velora_config",
    "kasa_config": "kasa_config",
}


@dataclass(frozen=True)
class DecoderShape:
    """What an adapter must fit: the decoder's layers and each projection's (in, out) features."""

    num_layers: int
    features: dict[str, tuple[int, int]]  # projection -> (in_features, out_features)

    @classmethod
    def of(cls, text_config: object, head_dim: int) -> "DecoderShape":
        hidden = text_config.hidden_size
        q_size = text_config.num_attention_heads * head_dim
        kv_size = text_config.num_key_value_heads * head_dim
        inter = text_config.intermediate_size
        return cls(
            text_config.num_hidden_layers,
            {
                "q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size), "o_proj": (q_size, hidden),
                "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
            },
        )


@dataclass(frozen=True)
class VisionTargets:
    """The vision side's linear layers an adapter may target, by the model's module name, with their
    (in, out) features, and the family's map from a checkpoint tensor name to the model's."""

    features: dict[str, tuple[int, int]]
    checkpoint_name: Callable[[str], str]
    is_unused: Callable[[str], bool] = lambda name: False  # a checkpoint tensor the model knows and skips

    def module_of(self, path: str) -> str | None:
        """The model's module for an adapter key's path; "" for a layer the model does not build
        because its output is never used (e.g. a LLaVA tower's layers past the selected feature layer)."""
        name = self.checkpoint_name(path + ".weight")
        if name.removesuffix(".weight") in self.features:
            return name.removesuffix(".weight")
        return "" if self.is_unused(name) else None


@dataclass
class LoRAAdapter:
    """One adapter in host memory: per (layer, projection) its A [r, in] and scaled B [out, r], in fp32."""

    name: str
    path: str
    key: str  # identity in the caches: the name and a digest of the files, so new weights never hit old blocks
    rank: int
    scaling: float
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    vision_pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # by module name

    @property
    def touches_vision(self) -> bool:
        """Whether the adapter changes the vision side, so its encoder outputs are its own."""
        return bool(self.vision_pairs)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in [*self.pairs.values(), *self.vision_pairs.values()])

    def layer_pairs(self, layer: int, projections: tuple[str, ...]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {p: self.pairs[(layer, p)] for p in projections if (layer, p) in self.pairs}


def load_adapter(name: str, path: str | Path, shape: DecoderShape, max_rank: int, vision: VisionTargets | None = None) -> LoRAAdapter:
    directory = Path(path)
    config_path = directory / "adapter_config.json"
    weights_path = directory / "adapter_model.safetensors"
    if not directory.is_dir():
        raise AdapterError(f"adapter {name!r}: {directory} is not a directory")
    if not config_path.is_file():
        raise AdapterError(f"adapter {name!r}: {config_path} is missing")
    if not weights_path.is_file():
        hint = " (only adapter_model.bin, a pickle: save it with safe_serialization=True)" if (directory / "adapter_model.bin").exists() else ""
        raise AdapterError(f"adapter {name!r}: {weights_path} is missing{hint}")
    config = _read_config(name, config_path)
    rank = config["r"]
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r}: {config_path}: rank r={rank} exceeds max_lora_rank={max_rank}")
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_tensors(name, weights_path)
    vision_tensors = {k: t for k, t in tensors.items() if any(marker in k for marker in _VISION_MARKERS)}
    vision_pairs = _vision_pairs(name, weights_path, vision_tensors, vision, rank, scaling)
    pairs = _pairs(name, weights_path, {k: t for k, t in tensors.items() if k not in vision_tensors}, shape, rank, scaling,
                   allow_empty=bool(vision_tensors))
    digest = hashlib.sha256(config_path.read_bytes() + weights_path.read_bytes()).hexdigest()[:16]
    return LoRAAdapter(name, str(directory), f"{name}#{digest}", rank, scaling, pairs, vision_pairs)


def _read_config(name: str, path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise AdapterError(f"adapter {name!r}: {path} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {path} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: {path}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    for field, what in _REFUSED_FIELDS.items():
        if config.get(field):
            raise AdapterError(f"adapter {name!r}: {path}: {what} is not supported ({field}={config[field]!r})")
    if config.get("bias", "none") not in (None, "none"):
        raise AdapterError(f"adapter {name!r}: {path}: trained biases are not supported (bias={config['bias']!r})")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"adapter {name!r}: {path}: r must be a positive int, got {rank!r}")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise AdapterError(f"adapter {name!r}: {path}: lora_alpha must be a positive number, got {alpha!r}")
    return config


def _read_tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise AdapterError(f"adapter {name!r}: {path} is not a readable safetensors file: {err}") from err


def _vision_pairs(
    name: str, path: Path, tensors: dict[str, torch.Tensor], vision: VisionTargets | None, rank: int, scaling: float
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The vision side's (A, scaled B) by the model's module name."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        where = f"adapter {name!r}: {path}: tensor {key}"
        match = _VISION_KEY.match(key)
        module = vision.module_of(match["path"]) if match is not None and vision is not None else None
        if module is None:
            raise AdapterError(f"{where} is not a LoRA weight of a linear layer of this model's vision tower or projector")
        if module == "":
            continue  # its layer's output is never used, so neither is its delta
        half = halves.setdefault(module, {})
        if match["ab"] in half:
            raise AdapterError(f"{where}: lora_{match['ab']} of this layer is given twice")
        half[match["ab"]] = tensor
    return {module: _checked_pair(name, path, module, half, vision.features[module], rank, scaling) for module, half in halves.items()}


def _checked_pair(
    name: str, path: Path, where: str, half: dict[str, torch.Tensor], features: tuple[int, int], rank: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"adapter {name!r}: {path}: {where}"
    if set(half) != {"A", "B"}:
        raise AdapterError(f"{where}: lora_{'B' if 'A' in half else 'A'} is missing")
    in_features, out_features = features
    a, b = half["A"], half["B"]
    if tuple(a.shape) != (rank, in_features):
        raise AdapterError(f"{where}.lora_A has shape {tuple(a.shape)}, expected {(rank, in_features)} for this base model")
    if tuple(b.shape) != (out_features, rank):
        raise AdapterError(f"{where}.lora_B has shape {tuple(b.shape)}, expected {(out_features, rank)} for this base model")
    return a.float().contiguous(), (b.float() * scaling).contiguous()


def _pairs(
    name: str, path: Path, tensors: dict[str, torch.Tensor], shape: DecoderShape, rank: int, scaling: float,
    allow_empty: bool = False,
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        where = f"adapter {name!r}: {path}: tensor {key}"
        if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
            raise AdapterError(f"{where}: LoRA on the embeddings or the LM head is not supported")
        if key.endswith(".bias"):
            raise AdapterError(f"{where}: trained biases are not supported")
        match = _KEY.match(key)
        if match is None or match["proj"] not in PROJECTIONS:
            raise AdapterError(f"{where} is not a LoRA weight of a decoder projection ({', '.join(PROJECTIONS)})")
        layer = int(match["layer"])
        if layer >= shape.num_layers:
            raise AdapterError(f"{where}: layer {layer} does not exist (the base model has {shape.num_layers})")
        half = halves.setdefault((layer, match["proj"]), {})
        if match["ab"] in half:
            raise AdapterError(f"{where}: lora_{match['ab']} of this projection is given twice")
        half[match["ab"]] = tensor
    if not halves and not allow_empty:
        raise AdapterError(f"adapter {name!r}: {path} holds no LoRA weights")
    return {
        (layer, proj): _checked_pair(name, path, f"layers.{layer}.{proj}", half, shape.features[proj], rank, scaling)
        for (layer, proj), half in sorted(halves.items())
    }
