"""EngineConfig: every knob of the engine, in groups that each validate themselves.

`EngineConfig(model, **options)` takes the options flat, as `MMEngine(path, **options)` and the command-line
flags do (one flag per option, named after it); each option belongs to exactly one group, and is read there:

    config.model_config       what runs, on what, in which numbers: max_model_len, device, dtype, seed, ...
    config.cache_config       the KV cache and its prefix cache, recurrent-state checkpoints, windows, the
                              encoder cache, both host tiers
    config.scheduler_config   how much work a step takes and in what order
    config.execution_config   kernels and how steps are launched: attention backend, cascade, CUDA graphs
    config.multimodal_config  media limits and preprocessing
    config.parallel_config    which processes run the engine (the engine core, tensor-parallel workers)
    config.lora_config        LoRA adapters
    config.spec_config        speculative decoding (vLLM's speculative_config)

(vLLM's EngineArgs -> VllmConfig, in one class.) A new group joins the same way: a dataclass with its own
checks, listed in GROUPS. Checks across groups are EngineConfig's own.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from mmengine.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a device or dtype is resolved: the CLI builds its flags without it
    import torch

REASONING_PARSERS = ("qwen3", "deepseek_r1")  # sample/reasoning.py: both split <think>...</think>

# Block-hash algorithms prefix caching may use (kv_cache/block_hash.py implements each).
HASH_ALGORITHMS = ("xxh3_128", "sha256")

# dtype names -> torch attribute names
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}

QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "gptq", "awq", "none")

# KV cache element types: "auto" is the model dtype; "fp8" (= "fp8_e4m3") stores e4m3 with per-layer scales
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")

# On CPU the KV cache has no free-memory probe; this caps it unless num_kv_blocks is given.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


# Image-processor settings an engine may override (transformers would silently ignore a misspelt one).
MM_PROCESSOR_KWARGS = frozenset({"min_pixels", "max_pixels"})


@dataclass
class ModelConfig:
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" | "float32" | "float16" | "bfloat16"
    seed: int = 0
    # The quantization the checkpoint is expected to have ("fp8", "compressed-tensors", "gptq", "awq" or
    # "none"): only asserted against its quantization_config, which alone decides how weights load.
    quantization: str | None = None
    # A thinking model's <think>...</think> apart from its answer (RequestOutput.reasoning_content, the
    # server's reasoning_content): "qwen3" or "deepseek_r1", as vLLM's --reasoning-parser; None: off.
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        _require(isinstance(self.device, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
                 "device", self.device, "'auto', 'cpu', 'cuda' or 'cuda:N' (a str)")
        _require(isinstance(self.dtype, str) and (self.dtype == "auto" or self.dtype in _DTYPES),
                 "dtype", self.dtype, f"'auto' or one of {sorted(_DTYPES)} (a str)")
        _require(isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed", self.seed, "an int")
        _require(self.quantization in (None, *QUANTIZATION_METHODS), "quantization", self.quantization,
                 f"None or one of {', '.join(QUANTIZATION_METHODS)}")
        _require(self.reasoning_parser in (None, *REASONING_PARSERS), "reasoning_parser", self.reasoning_parser,
                 f"None or one of {', '.join(REASONING_PARSERS)}")


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit cap on KV blocks (tests use it to force preemption)
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES
    # "fp8": the KV cache holds e4m3 values (half of bf16's bytes: twice the cached tokens), divided by
    # the checkpoint's per-layer k_scale / v_scale where it has them, else by 1.0 (a warning says so).
    kv_cache_dtype: str = "auto"
    # Hybrid models (Qwen3.5): the share of the cache memory (after the live states) that holds recurrent
    # state checkpoints for prefix hits (kv_cache/recurrent_state.py), and an explicit count instead.
    state_checkpoint_memory_fraction: float = 0.1
    num_state_checkpoints: int | None = None
    # Sliding-window layers (Gemma 4) keep only their window's blocks, in a pool of their own: its blocks
    # per block of the full-attention layers' pool (at least what one request needs at once). Lower fits
    # more long contexts and cached prefixes, higher more short requests at once; None keeps every
    # token's K/V in every layer (kv_cache/sliding_window.py, docs/caches.md).
    sliding_kv_ratio: float | None = 0.5
    enable_prefix_caching: bool = True
    # "sha256" where crafted collisions are a concern; also hashes image content (mm_hash), which
    # is part of a KV block's identity
    prefix_caching_hash_algo: str = "xxh3_128"
    prefix_caching_hash_seed: int | None = None  # None: random per process
    encoder_cache_size: int | None = None  # embeddings; None: autotuned (see encoder_cache/budget.py)
    # Host memory for encoder outputs evicted from the device (encoder_cache/host_tier.py): a later
    # request copies them back instead of encoding again. None: on CUDA a tenth of the available RAM
    # (at most 32 GiB), on CPU 0 (the device is host memory already); 0: off.
    encoder_cache_host_bytes: int | None = None
    # Host memory for prefix-cached KV blocks evicted from the device (kv_cache/host_tier.py): a later
    # hit copies them back instead of prefilling again. None and 0 as for encoder_cache_host_bytes.
    kv_cache_host_bytes: int | None = None

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1) or self.block_size > 256:
            raise ConfigError(f"block_size must be a power of two up to 256, got {self.block_size}")
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        _require(isinstance(self.gpu_memory_utilization, float | int) and 0 < self.gpu_memory_utilization <= 1,
                 "gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]")
        _positive_int("cpu_kv_cache_bytes", self.cpu_kv_cache_bytes)
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", self.kv_cache_dtype, f"one of {', '.join(KV_CACHE_DTYPES)}")
        _require(isinstance(self.num_state_checkpoints, (int, type(None))) and not isinstance(self.num_state_checkpoints, bool)
                 and (self.num_state_checkpoints or 0) >= 0, "num_state_checkpoints", self.num_state_checkpoints, "None or an int >= 0")
        _require(_is_number(self.state_checkpoint_memory_fraction) and 0 <= self.state_checkpoint_memory_fraction < 1,
                 "state_checkpoint_memory_fraction", self.state_checkpoint_memory_fraction, "a number in [0, 1)")
        _require(self.sliding_kv_ratio is None or (_is_number(self.sliding_kv_ratio) and 0 < self.sliding_kv_ratio <= 1),
                 "sliding_kv_ratio", self.sliding_kv_ratio, "None or a number in (0, 1]")
        _require(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", self.enable_prefix_caching, "a bool")
        _require(isinstance(self.prefix_caching_hash_algo, str) and self.prefix_caching_hash_algo in HASH_ALGORITHMS,
                 "prefix_caching_hash_algo", self.prefix_caching_hash_algo, f"one of {HASH_ALGORITHMS}")
        _require(self.prefix_caching_hash_seed is None or isinstance(self.prefix_caching_hash_seed, int),
                 "prefix_caching_hash_seed", self.prefix_caching_hash_seed, "None or an int")
        if self.encoder_cache_size is not None:
            _positive_int("encoder_cache_size", self.encoder_cache_size)
        for name in ("encoder_cache_host_bytes", "kv_cache_host_bytes"):
            host = getattr(self, name)
            _require(host is None or _is_int(host, 0), name, host, "None or an int >= 0")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # Batches added at once (generate()) are planned into prefix-sharing groups: queued group by
    # group, each group's shared prefix computed once and held until its last member finishes;
    # waiting requests are admitted longest cached prefix first. Needs prefix caching.
    enable_prefix_grouping: bool = True
    # The next step is scheduled and launched while the device still runs the current one, so host
    # work hides behind device work; a request's last token arrives one step() later ("auto": on
    # CUDA, where kernels run asynchronously; "on" also on CPU, where nothing overlaps).
    async_scheduling: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            _positive_int(name, getattr(self, name))
        _require(isinstance(self.enable_prefix_grouping, bool), "enable_prefix_grouping", self.enable_prefix_grouping, "a bool")
        _require(self.async_scheduling in ("auto", "on", "off"), "async_scheduling", self.async_scheduling, "'auto', 'on' or 'off'")


@dataclass
class ExecutionConfig:
    attn_backend: str = "auto"  # "auto" | "torch" | "triton"
    # Requests of a step that share KV blocks at the start attend to them together, the prefix read
    # once per group ("auto": when the saved reads pay for it, see runner/cascade_plan.py; "on":
    # whenever two requests share a block; "off"). "auto" keeps a decode-only step's CUDA graph; a
    # decode-only step that uses it ("on") runs eagerly.
    cascade_attention: str = "auto"
    # Decode-only steps replay CUDA graphs captured at start-up (CUDA + Triton kernels); True runs
    # every step eagerly (start-up is faster, steps are slower).
    enforce_eager: bool = False
    max_cuda_graph_batch_size: int | None = None  # None: max_num_seqs; larger decode batches run eagerly

    def __post_init__(self) -> None:
        _require(self.attn_backend in ("auto", "torch", "triton"), "attn_backend", self.attn_backend, "'auto', 'torch' or 'triton'")
        _require(self.cascade_attention in ("auto", "on", "off"), "cascade_attention", self.cascade_attention, "'auto', 'on' or 'off'")
        _require(isinstance(self.enforce_eager, bool), "enforce_eager", self.enforce_eager, "a bool")
        if self.max_cuda_graph_batch_size is not None:
            _positive_int("max_cuda_graph_batch_size", self.max_cuda_graph_batch_size)


@dataclass
class MultimodalConfig:
    # Items per prompt by modality; a modality left out allows none ("video", "audio": families that take them)
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 8, "video": 1, "audio": 1})
    max_image_pixels: int = 64 * 1024 * 1024  # also bounds each decoded video frame
    # Longer videos are refused before decoding (multimodal/video.py)
    max_video_seconds: float = 3600.0
    # Longer audio clips are refused (never truncated), before decoding where the container states its
    # duration (multimodal/audio.py); 30 s is Gemma 4's feature-extractor cap, which also bounds it
    max_audio_seconds: float = 30.0
    # Wall time one audio clip's or video's probing and decoding may take (multimodal/media_container.py):
    # a bound on the work any request bytes can cause in a preprocessing thread
    max_media_decode_seconds: float = 120.0
    # Preprocessed pixels kept (host memory) after their requests finish, so a repeated image is
    # neither decoded nor resized again; 0 keeps only what live requests hold.
    mm_processor_cache_bytes: int = 1 << 30
    # Worker processes that decode, hash and preprocess encoded pictures (files, bytes, data URLs) away from
    # the engine's process, their tensors coming back in shared memory (multimodal/preprocess_pool.py);
    # 0 prepares them on the engine's own threads.
    mm_processor_workers: int = 0
    # Overrides of the checkpoint's image-processor settings, e.g. {"max_pixels": 1003520} for
    # native-resolution families (Qwen2-VL): they bound each image's token count and so the encoder budget.
    mm_processor_kwargs: dict[str, int] | None = None

    def __post_init__(self) -> None:
        _positive_int("max_image_pixels", self.max_image_pixels)
        _require(isinstance(self.limit_mm_per_prompt, dict), "limit_mm_per_prompt", self.limit_mm_per_prompt, "a dict")
        for modality, limit in self.limit_mm_per_prompt.items():
            _require(modality in ("image", "video", "audio"), "limit_mm_per_prompt", modality,
                     "keys among {'image', 'video', 'audio'}")
            _require(isinstance(limit, int) and limit >= 0, f"limit_mm_per_prompt[{modality!r}]", limit, "an int >= 0")
        for name in ("max_video_seconds", "max_audio_seconds", "max_media_decode_seconds"):
            value = getattr(self, name)
            _require(_is_number(value) and value > 0, name, value, "a positive number")
        _require(_is_int(self.mm_processor_cache_bytes, 0), "mm_processor_cache_bytes", self.mm_processor_cache_bytes, "an int >= 0")
        _require(_is_int(self.mm_processor_workers, 0), "mm_processor_workers", self.mm_processor_workers, "an int >= 0")
        kwargs = self.mm_processor_kwargs
        _require(kwargs is None or isinstance(kwargs, dict), "mm_processor_kwargs", kwargs, "None or a dict")
        for key, value in (kwargs or {}).items():
            _require(key in MM_PROCESSOR_KWARGS, "mm_processor_kwargs", key, f"keys among {sorted(MM_PROCESSOR_KWARGS)}")
            _require(_is_int(value, 1), f"mm_processor_kwargs[{key!r}]", value, "an int > 0")
        if kwargs and "min_pixels" in kwargs and "max_pixels" in kwargs:
            _require(kwargs["min_pixels"] <= kwargs["max_pixels"], "mm_processor_kwargs", kwargs, "min_pixels <= max_pixels")


@dataclass
class ParallelConfig:
    # Where AsyncMMEngine runs the scheduler, the caches and the model: "thread" (a thread of the calling
    # process) or "process" (an engine-core process of its own, engine/core_process.py; the calling
    # process keeps the intake, tokenizing and preprocessing). MMEngine itself always runs in-process.
    engine_core: str = "thread"
    # Ranks the model is split over (tensor parallelism, docs/parallelism.md): above 1, that many worker
    # processes (spawned; gloo on CPU, NCCL on CUDA) hold the weights and KV blocks while this process keeps
    # the scheduler and the caches' books. A shape the size does not divide is refused at start-up.
    tensor_parallel_size: int = 1
    # How the workers are started: "mp" (processes on this machine) or "ray" (Ray actors, one placement-group
    # bundle per rank: the way to span machines; needs the `ray` extra). docs/parallelism.md says where ranks go.
    distributed_executor_backend: str = "mp"
    # The vision tower at tensor_parallel_size > 1 (vLLM's name): "weights", every rank runs it on every picture of a
    # step (the tower replicated); "data", a step's pictures are split across the ranks by size and the outputs shared
    mm_encoder_tp_mode: str = "weights"
    # MoE decoders at tensor_parallel_size > 1 (vLLM's name): each rank holds whole experts, E / tensor_parallel_size of
    # every MoE layer, instead of every expert split on its intermediate size; attention stays split by heads. Needs a
    # model with experts whose count the ranks divide (checked with the model, before any process starts).
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        _require(self.engine_core in ("thread", "process"), "engine_core", self.engine_core, "'thread' or 'process'")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _require(self.distributed_executor_backend in ("mp", "ray"), "distributed_executor_backend",
                 self.distributed_executor_backend, "'mp' or 'ray'")
        _require(self.mm_encoder_tp_mode in ("weights", "data"), "mm_encoder_tp_mode", self.mm_encoder_tp_mode, "'weights' or 'data'")
        _require(isinstance(self.enable_expert_parallel, bool), "enable_expert_parallel", self.enable_expert_parallel, "a bool")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ConfigError("enable_expert_parallel needs tensor_parallel_size > 1 (the experts are split over its ranks), "
                              "got tensor_parallel_size=1")


@dataclass
class LoRAConfig:
    # LoRA adapters (PEFT) on the language model: a step mixes requests of up to max_loras adapters
    # (device slots, loaded on demand, LRU) and base-model requests; max_cpu_loras adapters are kept
    # in host memory (None: max_loras), others are read from disk again when needed.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.enable_lora, bool), "enable_lora", self.enable_lora, "a bool")
        for name in ("max_loras", "max_lora_rank"):
            _positive_int(name, getattr(self, name))
        if self.max_cpu_loras is not None:
            _positive_int("max_cpu_loras", self.max_cpu_loras)
            _require(self.max_cpu_loras >= self.max_loras, "max_cpu_loras", self.max_cpu_loras, f">= max_loras ({self.max_loras})")


SPECULATIVE_METHODS = ("ngram", "mtp", "eagle3")
MAX_SPECULATIVE_TOKENS = 16
_COMMON_SPECULATIVE_KEYS = {"method", "num_speculative_tokens", "draft_backoff"}
_SPECULATIVE_KEYS = {"ngram": _COMMON_SPECULATIVE_KEYS | {"prompt_lookup_min", "prompt_lookup_max"},
                     "mtp": _COMMON_SPECULATIVE_KEYS,
                     "eagle3": _COMMON_SPECULATIVE_KEYS | {"model"}}
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's: n-grams of 5 tokens when neither bound is given


@dataclass
class SpeculativeConfig:
    # vLLM's speculative_config (spec/): {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    # "prompt_lookup_max": b} drafts up to k tokens a step by prompt lookup: the latest earlier occurrence of the
    # request's last n tokens (n from b down to a) proposes the tokens that followed it. {"method": "mtp",
    # "num_speculative_tokens": k}: the checkpoint's own multi-token-prediction layers (Qwen3.5's `mtp.*`) draft k
    # tokens in a chain. {"method": "eagle3", "model": draft_dir, "num_speculative_tokens": k}: an EAGLE-3 draft
    # head (models/eagle3.py) reading three of the target's layers. With greedy decoding the tokens are those of
    # decoding without it; with sampling, their distribution is. "draft_backoff" (mmengine's, default True): a
    # request whose drafts are rejected step after step stops drafting for a while (spec/backoff.py). None: off.
    speculative_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        spec = self.speculative_config
        _require(spec is None or isinstance(spec, dict), "speculative_config", spec, "None or a dict")
        if spec is None:
            return
        method = spec.get("method")
        _require(method in SPECULATIVE_METHODS, "speculative_config['method']", method, f"one of {', '.join(SPECULATIVE_METHODS)}")
        unknown = sorted(set(spec) - _SPECULATIVE_KEYS[method])
        _require(not unknown, "speculative_config", spec, f"keys among {sorted(_SPECULATIVE_KEYS[method])} (unknown: {unknown})")
        if method == "eagle3":
            model = spec.get("model")
            _require(isinstance(model, str) and model != "", "speculative_config['model']", model,
                     "the EAGLE-3 draft head's directory (method 'eagle3' drafts with a model of its own)")
        k = spec.get("num_speculative_tokens")
        _require(_is_int(k, 1) and k <= MAX_SPECULATIVE_TOKENS, "speculative_config['num_speculative_tokens']", k,
                 f"an int in [1, {MAX_SPECULATIVE_TOKENS}]")
        backoff = spec.get("draft_backoff", True)
        _require(isinstance(backoff, bool), "speculative_config['draft_backoff']", backoff, "a bool")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = spec.get(name)
            _require(value is None or _is_int(value, 1), f"speculative_config[{name!r}]", value, "None or an int >= 1")
        _require(self.prompt_lookup_min <= self.prompt_lookup_max, "speculative_config", spec,
                 "prompt_lookup_min <= prompt_lookup_max")

    @property
    def method(self) -> str | None:
        return None if self.speculative_config is None else self.speculative_config["method"]

    @property
    def draft_backoff(self) -> bool:
        return bool((self.speculative_config or {}).get("draft_backoff", True))

    @property
    def draft_model(self) -> str | None:
        """The draft head's directory (method "eagle3")."""
        return None if self.speculative_config is None else self.speculative_config.get("model")

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens a request may verify per step (0: speculative decoding is off)."""
        return 0 if self.speculative_config is None else self.speculative_config["num_speculative_tokens"]

    @property
    def prompt_lookup_max(self) -> int:
        spec = self.speculative_config or {}
        return spec.get("prompt_lookup_max") or spec.get("prompt_lookup_min") or DEFAULT_PROMPT_LOOKUP

    @property
    def prompt_lookup_min(self) -> int:
        spec = self.speculative_config or {}
        return spec.get("prompt_lookup_min") or spec.get("prompt_lookup_max") or DEFAULT_PROMPT_LOOKUP


# attribute on EngineConfig -> its group; the order is the command-line help's
GROUPS: dict[str, type] = {
    "model_config": ModelConfig,
    "scheduler_config": SchedulerConfig,
    "cache_config": CacheConfig,
    "execution_config": ExecutionConfig,
    "multimodal_config": MultimodalConfig,
    "parallel_config": ParallelConfig,
    "lora_config": LoRAConfig,
    "spec_config": SpeculativeConfig,
}


class EngineConfig:
    """The engine's options: `EngineConfig(model, **options)` with the options flat; each is read from its
    group (`config.cache_config.block_size`). An unknown option is a ConfigError that lists the known ones."""

    model: str
    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    execution_config: ExecutionConfig
    multimodal_config: MultimodalConfig
    parallel_config: ParallelConfig
    lora_config: LoRAConfig
    spec_config: SpeculativeConfig
    _OPTION_GROUPS: ClassVar[dict[str, str]] = {}  # option name -> group attribute, filled below

    def __init__(self, model: str, **options: Any) -> None:
        _require(isinstance(model, str) and model, "model", model, "a checkpoint path")
        unknown = sorted(set(options) - set(self._OPTION_GROUPS))
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(self._OPTION_GROUPS))}")
        self.model = model
        for attribute, group in GROUPS.items():
            names = {f.name for f in dataclasses.fields(group)}
            setattr(self, attribute, group(**{name: value for name, value in options.items() if name in names}))

    @classmethod
    def from_kwargs(cls, model: str, **options: Any) -> EngineConfig:
        return cls(model, **options)

    @classmethod
    def option_fields(cls) -> list[tuple[type, dataclasses.Field]]:
        """Every option as (its group's class, its dataclass field), in GROUPS' order: the command line's flags."""
        return [(group, f) for group in GROUPS.values() for f in dataclasses.fields(group)]

    def options(self) -> dict[str, Any]:
        """Every option's value, flat: `EngineConfig(config.model, **config.options())` is an equal config."""
        return {name: getattr(getattr(self, attribute), name) for name, attribute in self._OPTION_GROUPS.items()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EngineConfig) and (self.model, self.options()) == (other.model, other.options())

    def __repr__(self) -> str:
        groups = ", ".join(f"{attribute}={getattr(self, attribute)!r}" for attribute in GROUPS)
        return f"EngineConfig(model={self.model!r}, {groups})"

    def resolve_device(self) -> torch.device:
        import torch

        device_name = self.model_config.device
        if device_name == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(device_name)
        parallel = self.parallel_config
        if device.type == "cuda" and parallel.tensor_parallel_size > 1 and parallel.distributed_executor_backend == "ray":
            return torch.device("cuda")  # the ranks' GPUs are the Ray cluster's, which the placement group checks: this process needs none
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device={device_name!r} was asked for but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device={device_name!r}: there are only {torch.cuda.device_count()} CUDA device(s)")
        return device

    def resolve_dtype(self, checkpoint_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
        """'auto' is float32 on CPU and the checkpoint's dtype (fp16/bf16) on CUDA."""
        import torch

        if self.model_config.dtype != "auto":
            return getattr(torch, _DTYPES[self.model_config.dtype])
        if device.type == "cpu":
            return torch.float32
        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            return checkpoint_dtype
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        import torch

        return model_dtype if self.cache_config.kv_cache_dtype == "auto" else torch.float8_e4m3fn


def _option_groups() -> dict[str, str]:
    owners: dict[str, str] = {}
    for attribute, group in GROUPS.items():
        for f in dataclasses.fields(group):
            assert f.name not in owners and f.name != "model", f"option {f.name} is in two groups"
            owners[f.name] = attribute
    return owners


EngineConfig._OPTION_GROUPS = _option_groups()


def _require(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{name} must be {expected}, got {value!r}")


def _positive_int(name: str, value: object) -> None:
    _require(_is_int(value, 1), name, value, "a positive int")


def _is_int(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
