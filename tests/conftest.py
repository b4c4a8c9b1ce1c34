"""Shared fixtures: tiny random-weight checkpoints built with transformers, and transformers' own
greedy output and logits on a pinned device and dtype."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import PIL.Image
import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter; the variable must be set before
# any kernel is decorated, i.e. before mmengine.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import AutoModelForImageTextToText, PreTrainedModel

# Under pytest-xdist the workers share the cores: one torch thread pool each, not one per core each.
# The processes tests start (benchmark scripts, the GPU suite's dry-run parts, servers) inherit the same
# bound through OMP_NUM_THREADS: OpenMP threads outnumbering the cores spin-wait for one another, which
# made a tiny model's steps up to a hundred times slower on a 2-core machine running both workers.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))

from mmengine.models.registry import load_hf_processor
from mmengine.testing import TinyLlavaSpec, tiny_llava_path
from mmengine.testing.families import tiny_checkpoint_path

import chat_formats
from helpers import LocalRay


# Under pytest-xdist (`-n 2 --dist loadfile`) each file runs on one worker, handed out in collection order:
# the longest files go first, so that neither worker is left running one alone at the end.
_LONGEST_FILES_FIRST = ("test_fuzz_triton.py", "test_kernel_cross_compile.py", "test_ray_batch.py", "test_ray_tensor_parallel.py",
                        "test_serve_processes.py", "test_ray_serve.py", "test_tensor_parallel.py", "test_benchmarks.py",
                        "test_gemma4.py", "test_quantized_checkpoints.py", "test_preprocess_pool.py", "test_distributed_executor.py",
                        "test_tensor_parallel_families.py", "test_gpu_suite.py", "test_tensor_parallel_quantized_layers.py",
                        "test_family_engine.py", "test_fuzz.py", "test_engine_core_process.py", "test_tensor_parallel_graphs.py",
                        "test_tensor_parallel_draft_heads.py", "test_soak_benchmark.py", "test_cascade_engine.py",
                        "test_attention_masks.py", "test_broken_checkpoints.py", "test_cascade_kernels.py", "test_fused_moe_kernel.py",
                        "test_expert_parallel.py", "test_tensor_parallel_quantized.py")


def pytest_configure(config: pytest.Config) -> None:
    # xdist's scheduler (the controller's) would otherwise re-sort the files by their number of tests, which
    # leaves the longest files, that hold few tests, for the end
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(_LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the other files keep their order
    misnamed = sorted({item.path.name for item in items
                       if "ray_cluster" in item.fixturenames and not item.path.name.startswith(_RAY_FILE_PREFIX)})
    if misnamed:
        raise pytest.UsageError(f"{misnamed} use the ray_cluster fixture: name them {_RAY_FILE_PREFIX}*.py, so that "
                                "they run on the worker that runs the other Ray files (pytest_xdist_make_scheduler)")


_RAY_FILE_PREFIX = "test_ray_"


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under `--dist loadfile`, the Ray files are one work unit: one worker runs them back to back and starts
    one Ray cluster for them all (ray_cluster), where the per-file split started one on each worker."""
    if config.option.dist != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RayFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "ray files" if Path(scope).name.startswith(_RAY_FILE_PREFIX) else scope

    return RayFilesTogether(config, log)


# -- Ray ------------------------------------------------------------------------------------------

_local_ray: LocalRay | None = None


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster (LocalRay.OPTIONS) for a Ray test module. Ray modules run one after another in a process
    share it (a start is Ray's servers, agents and workers: seconds of CPU, more of waiting); it is shut, its processes
    gone, before a test of a module without it runs (pytest_runtest_teardown)."""
    global _local_ray
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install mmengine-vlm[ray])")
    if _local_ray is None:
        _local_ray = LocalRay.start()
    yield


def _ray_modules(session: pytest.Session) -> set[Path]:
    if not hasattr(session, "_ray_modules"):
        session._ray_modules = {item.path for item in session.items if "ray_cluster" in item.fixturenames}
    return session._ray_modules


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # the module's own fixtures (its replicas, servers, engines) are gone first
    global _local_ray
    if _local_ray is not None and (nextitem is None or nextitem.path not in _ray_modules(item.session)):
        _local_ray, stopping = None, _local_ray
        stopping.stop()


@dataclass(frozen=True)
class Precision:
    """Where and in which dtype a parity test runs mmengine and transformers alike."""

    device: str  # "cpu" | "cuda"
    dtype: torch.dtype

    @property
    def engine_kwargs(self) -> dict[str, str]:
        return {"device": self.device, "dtype": str(self.dtype).removeprefix("torch.")}

    @property
    def exact(self) -> bool:
        """fp32: greedy tokens must equal transformers'. In bf16 near-ties flip legitimately, so
        parity is judged on logits within a tolerance instead."""
        return self.dtype == torch.float32


CPU_FP32 = Precision("cpu", torch.float32)
# Where the Triton kernels run: compiled on a GPU when one is present, else in Triton's interpreter on CPU
KERNEL_FP32 = Precision("cuda" if torch.cuda.is_available() else "cpu", torch.float32)
_NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; the cpu variant of the same dtype checks the same on CPU"
)
EXACT_PRECISIONS = [
    pytest.param(CPU_FP32, id="cpu-fp32"),
    pytest.param(Precision("cuda", torch.float32), id="cuda-fp32", marks=_NEEDS_CUDA),
]
ALL_PRECISIONS = [
    *EXACT_PRECISIONS,
    # bf16 on CPU runs the same comparison as on a GPU (cheap at tiny shapes), so a CPU-only run covers it
    pytest.param(Precision("cpu", torch.bfloat16), id="cpu-bf16"),
    pytest.param(Precision("cuda", torch.bfloat16), id="cuda-bf16", marks=_NEEDS_CUDA),
]


@pytest.fixture
def no_tf32() -> Iterator[None]:
    """True fp32 on a GPU: cuDNN convolutions (the vision tower's patch embedding) default to TF32,
    which can differ between batch shapes by more than a greedy near-tie. No effect on CPU."""
    cudnn, cublas = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = cudnn, cublas


@pytest.fixture(params=EXACT_PRECISIONS)
def exact_precision(request: pytest.FixtureRequest, no_tf32: None) -> Precision:
    """fp32 on CPU, and on a GPU when one is present: greedy tokens are compared."""
    return request.param


@pytest.fixture(params=ALL_PRECISIONS)
def precision(request: pytest.FixtureRequest, no_tf32: None) -> Precision:
    """fp32 and bf16 on CPU, and on a GPU when one is present: logits are compared."""
    return request.param


@pytest.fixture(scope="session")
def checkpoint_dir():
    """checkpoint_dir(spec) -> path of a tiny checkpoint, built once in the checkpoint cache
    ($MMENGINE_CACHE_DIR: shared by the xdist workers and kept for later runs). Tests never write into it."""

    @functools.cache
    def build(spec: TinyLlavaSpec = TinyLlavaSpec()) -> Path:
        return tiny_llava_path(spec)  # the shared cache: built once for every xdist worker and later run

    return build


@pytest.fixture(scope="session")
def triton_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Triton cache for the tests that compile kernels for GPUs (cross-compiles on the CPU): fresh each run and
    shared by the run's xdist workers, so a kernel two such tests compile alike compiles once."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each worker's base is a folder of the run's
    return root / "triton-cache"


@pytest.fixture(scope="module")
def small_engine(checkpoint_dir):
    """One engine on the tiny checkpoint per test module (CPU or the GPU, as the machine has)."""
    from mmengine import MMEngine

    return MMEngine(str(checkpoint_dir()), max_model_len=128)


# -- model families ---------------------------------------------------------------------------

# Every family with pictures: the engine-level tests written against the `family` fixture run on each, the
# divisible-block matrix (test_family_engine.py) among them. A heavy check that each family's own test file
# also makes runs on REPRESENTATIVE_FAMILIES instead (docs/testing.md says which and why).
FAMILIES = ["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe", "gemma3", "gemma4",
            "internvl", "mistral3", "smolvlm", "llava_onevision", "llama4"]
REPRESENTATIVE_FAMILIES = ["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"]


@dataclass(frozen=True)
class FamilyCase:
    """One model family's tiny checkpoint and how its prompts mark images (as its chat template does)."""

    name: str
    path: Path

    def prompt(self, text: str, num_images: int = 0) -> str:
        return chat_formats.user_turn(self.name, text, num_images)

    def continue_chat(self, prompt: str, answer: str, text: str, num_images: int = 0) -> str:
        """The next turn's prompt: this one, the model's answer, and a new user message."""
        return chat_formats.continue_chat(self.name, prompt, answer, text, num_images)

    @property
    def image_marker(self) -> str:
        """One picture's marker as the family's template writes it (wrapped, where it wraps it)."""
        return chat_formats.image_marker(self.name)

    @property
    def image_token(self) -> str:
        """The token the family's processor expands into a picture's placeholders."""
        return chat_formats.image_token(self.name)


@pytest.fixture(scope="session")
def family_checkpoint():
    """family_checkpoint(name) -> path of the family's default tiny checkpoint, in the checkpoint cache
    as checkpoint_dir's."""
    return functools.cache(tiny_checkpoint_path)


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest, family_checkpoint) -> FamilyCase:
    """Each supported model family in turn: engine-level tests written against it run on every family."""
    return FamilyCase(request.param, family_checkpoint(request.param))


@functools.cache
def _hf_model(path: Path, precision: Precision) -> tuple[PreTrainedModel, object]:
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    if not hasattr(MoeCausalLMOutputWithPast, "image_outputs"):  # transformers 5.24's Llama4ForConditionalGeneration reads it
        MoeCausalLMOutputWithPast.image_outputs = None
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=precision.dtype).to(precision.device).eval()
    # loaded as the engine loads it: the PIL-backend image processor whatever is installed (Qwen's without a video processor)
    return model, load_hf_processor(path)


def _on_white(image: PIL.Image.Image) -> PIL.Image.Image:
    """Transparency composited onto white, as mmengine documents (and transformers >= 5.2x's
    convert_to_rgb does; older releases drop the alpha channel), so transformers sees the picture
    mmengine sees whatever its version."""
    if "A" not in image.getbands() and "transparency" not in image.info:
        return image
    white = PIL.Image.new("RGBA", image.size, (255, 255, 255, 255))
    return PIL.Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")


def _hf_inputs(processor: object, prompt: str, images: list | None, precision: Precision,
               audios: list | None = None) -> dict[str, torch.Tensor]:
    images = [_on_white(image) for image in images or ()]
    clips = {"audio": audios} if audios else {}  # 16 kHz waveforms (Gemma 4)
    inputs = processor(text=prompt, images=images or None, **clips, return_tensors="pt").to(precision.device)
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(precision.dtype)
    return inputs


def hf_greedy(
    path: Path, prompt: str, images: list | None, max_new_tokens: int, precision: Precision = CPU_FP32,
    ignore_eos: bool = False, audios: list | None = None,
) -> list[int]:
    """Greedy tokens from transformers' own model class's generate (the correctness anchor); it stops
    after an eos token (included) unless `ignore_eos`, like SamplingParams(ignore_eos=True)."""
    model, processor = _hf_model(Path(path), precision)
    inputs = _hf_inputs(processor, prompt, images, precision, audios)
    eos = {"eos_token_id": None} if ignore_eos else {}
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, **eos)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def hf_logits(path: Path, prompt: str, images: list | None, precision: Precision = CPU_FP32) -> torch.Tensor:
    """transformers' next-token logits for the prompt's last position, as fp32 on the precision's device."""
    model, processor = _hf_model(path, precision)
    inputs = _hf_inputs(processor, prompt, images, precision)
    with torch.inference_mode():
        return model(**inputs).logits[0, -1].float()


# -- LoRA adapters ------------------------------------------------------------------------------

LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (rank, alpha, rsLoRA, target projections of the language model)
LORA_ADAPTERS = {
    "qv4": (4, 8, False, ("q_proj", "v_proj")),
    "all8": (8, 16, True, LORA_PROJECTIONS),
    "mlp2": (2, 4, False, ("o_proj", "gate_proj", "down_proj")),
}


def save_peft_adapter(base_path: Path, out: Path, rank: int, alpha: int, rslora: bool, targets: tuple[str, ...] | str,
                      seed: int) -> Path:
    """A PEFT LoRA adapter (saved by `peft` itself) on the language model's projections `targets` (or
    on the modules a `targets` regex names), with random non-zero A and B, so it changes the answers."""
    import copy

    from peft import LoraConfig, get_peft_model

    model, _ = _hf_model(base_path, CPU_FP32)
    torch.manual_seed(seed)
    regex = targets if isinstance(targets, str) else rf".*language_model.*\.({'|'.join(targets)})"
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, init_lora_weights=False, target_modules=regex)
    get_peft_model(copy.deepcopy(model), config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def lora_adapters(family_checkpoint, tmp_path_factory):
    """lora_adapters(family) -> {name: adapter dir} for LORA_ADAPTERS, built once per session."""
    root = tmp_path_factory.mktemp("lora-adapters")

    @functools.cache
    def build(family: str) -> dict[str, Path]:
        base = family_checkpoint(family)
        return {
            name: save_peft_adapter(base, root / family / name, *spec, seed=seed)
            for seed, (name, spec) in enumerate(LORA_ADAPTERS.items())
        }

    return build
