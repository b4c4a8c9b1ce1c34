"""Each process imports what it uses: the family registry imports only the family a checkpoint asks for
(not every family's module, vision towers and processor code), so an engine, a tensor-parallel rank, a
front end and a preprocessing worker each pay for one family at start-up; and a front end and a preprocessing
worker, which never run the model, import none of its code (layers, runner, kernels, Triton, transformers' modeling
code)."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError
from mmengine.models.family import ModelClass
from mmengine.models.registry import FAMILIES, family_class_for

PACKAGE = Path(__file__).resolve().parent.parent / "mmengine"


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_registry_entry_names_its_family_class(model_type):
    entry = FAMILIES[model_type]
    family = entry.load()
    assert family.model_type == model_type and family.architectures == (entry.architecture,)


def test_an_unknown_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="LlavaForConditionalGeneration"):
        family_class_for(PretrainedConfig(architectures=["NoSuchForCausalLM"]))


_FAMILY_TURNS = ["LlavaForConditionalGeneration", "Qwen3_5ForConditionalGeneration"]
_HEAVY = ("transformers.modeling_utils", "transformers.processing_utils", "mmengine.models.family")
# what only a process that runs the model needs: Triton, transformers' modeling code and its activations (which pull
# transformers' model loading and torch.distributed.tensor; transformers' own config classes import them too)
_MODEL_CODE = ("triton", "transformers.modeling_utils", "transformers.activations")
# what a front end (server_processes.front_end_main) and a preprocessing worker (preprocess_pool.worker_process_main,
# PicturePreparer.from_spec) import as they start; the static test below derives the same from their code
_HOST_SIDE_IMPORTS = (
    "from mmengine.entrypoints import api_server, server_processes\n"
    "from mmengine.engine.async_engine import AsyncMMEngine\n"
    "from mmengine.engine.core_client import EngineCoreClient\n"
    "from mmengine.multimodal import picture_preparer, preprocess_pool\n"
    "from mmengine.models import registry\n"
)


@pytest.fixture(scope="module")
def fresh_interpreter(checkpoint_dir) -> dict[str, object]:
    """One fresh interpreter for every probe, in this order (each step's findings printed under a tag): a front end's
    and a preprocessing worker's modules are imported (the model code imported by then); each architecture is
    resolved in turn (its family class, and the family modules that resolving it imported beyond those before it;
    then the model code imported by then); Ray's sharing keys hash a prompt (the heavy modules imported by then, and
    those of them imported before); every family is resolved (the layers, runner, kernels and distributed modules, and
    the model code, imported by then)."""
    modules = sorted({entry.module for entry in FAMILIES.values()})
    probe = (
        "import sys\n"
        "def found(names): return sorted(m for m in names if m in sys.modules)\n"
        + _HOST_SIDE_IMPORTS +
        f"print('model_code_after_host_side_imports', found({_MODEL_CODE!r}))\n"
        "from transformers import PretrainedConfig\n"
        "from mmengine.models.registry import family_class_for\n"
        f"modules = {modules!r}\n"
        f"for architecture in {_FAMILY_TURNS!r}:\n"
        "    before = found(modules)\n"
        "    family = family_class_for(PretrainedConfig(architectures=[architecture]))\n"
        "    print('family_turn', (family.__name__, [m for m in found(modules) if m not in before]))\n"
        f"print('model_code_after_family_turns', found({_MODEL_CODE!r}))\n"
        f"print('heavy_before_sharing_keys', found({_HEAVY!r}))\n"
        "from mmengine.ray.keys import SharingKeys\n"
        f"SharingKeys({str(checkpoint_dir())!r}).prefix_chain('hello world')\n"
        f"print('heavy_after_sharing_keys', found({_HEAVY!r}))\n"
        f"print('model_code_after_sharing_keys', found({_MODEL_CODE!r}))\n"
        f"for architecture in {sorted(entry.architecture for entry in FAMILIES.values())!r}:\n"
        "    family_class_for(PretrainedConfig(architectures=[architecture]))\n"
        f"print('model_side_after_every_family', sorted(m for m in sys.modules if m.startswith({_MODEL_SIDE_PACKAGES!r})))\n"
        f"print('model_code_after_every_family', found({_MODEL_CODE!r}))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    findings: dict[str, object] = {"family_turns": []}
    for tag, value in (line.split(" ", 1) for line in result.stdout.splitlines() if " " in line):
        if tag == "family_turn":
            findings["family_turns"].append(ast.literal_eval(value))
        elif tag in ("model_code_after_host_side_imports", "model_code_after_family_turns", "heavy_before_sharing_keys",
                     "heavy_after_sharing_keys", "model_code_after_sharing_keys", "model_side_after_every_family",
                     "model_code_after_every_family"):
            findings[tag] = ast.literal_eval(value)
    return findings


def test_resolving_a_family_imports_that_family_only(fresh_interpreter):
    # LLaVA's module stands alone; Qwen3.5's builds on Qwen3-VL's, which builds on Qwen2-VL's
    assert fresh_interpreter["family_turns"] == [
        ("LlavaFamily", ["mmengine.models.llava"]),
        ("Qwen3_5Family", ["mmengine.models.qwen3_5", "mmengine.models.qwen3_vl", "mmengine.models.qwen_vl"])]


def test_a_front_end_and_a_preprocessing_worker_import_no_model_code(fresh_interpreter):
    """Neither a front end nor a preprocessing worker runs the model: importing their modules (the first thing the
    probe does) loads no Triton and none of transformers' modeling code."""
    assert fresh_interpreter["model_code_after_host_side_imports"] == []


def test_importing_a_familys_module_loads_no_model_code(fresh_interpreter):
    """Front ends and preprocessing workers import the checkpoint's family module (for its ModelFamily), so a family's
    module and the layers it builds on look activations up when a model is built, not when they are imported."""
    assert [name for name, _ in fresh_interpreter["family_turns"]] == ["LlavaFamily", "Qwen3_5Family"]
    assert fresh_interpreter["model_code_after_family_turns"] == []


def test_resolving_every_family_imports_no_model_side_module(fresh_interpreter):
    """A front end and a preprocessing worker resolve their checkpoint's family (its module): whichever it is, no
    layers, runner, kernels or distributed module comes with it (the family's model is imported where it is built), nor
    Triton or transformers' modeling code (LLaVA-OneVision's tiling reads transformers' image processing code, which
    imports its modeling code unless imported as import_processing_code does)."""
    assert fresh_interpreter["model_side_after_every_family"] == []
    assert fresh_interpreter["model_code_after_every_family"] == []


def test_sharing_keys_tokenize_as_the_processor_without_loading_it(checkpoint_dir, fresh_interpreter):
    """Ray's sharing keys need the tokenizer only: the driver loads it alone (not the processor, whose import
    pulls transformers' modeling code), and it tokenizes as the processor's own tokenizer does."""
    from mmengine.models.registry import load_hf_processor
    from mmengine.ray.keys import SharingKeys

    path = checkpoint_dir()
    prompt = "USER: <image>\nWhat is in this picture, and why? ASSISTANT:"
    assert SharingKeys(path).tokenizer(prompt)["input_ids"] == load_hf_processor(path).tokenizer(prompt)["input_ids"]
    # (the front end's imports, before, bring the family interface, not transformers' processor or modeling code)
    assert fresh_interpreter["heavy_before_sharing_keys"] == ["mmengine.models.family"]
    assert fresh_interpreter["heavy_after_sharing_keys"] == ["mmengine.models.family"]
    # (and the tokenizer's load, which reads the checkpoint's config, imports no model code nor transformers' model loading)
    assert fresh_interpreter["model_code_after_sharing_keys"] == []
    # (which the probe's order cannot tell apart from the sharing keys' own: their module reaches no models/ module)
    keys_imports = _import_closure(["mmengine.ray.keys"], _package_paths())
    assert sorted(m for m in keys_imports if m.startswith("mmengine.models")) == [] and _model_side(keys_imports) == []


_FRONT_END_MODEL_CODE = ("triton", "transformers.modeling_utils")
# what a front end at ready leaves out beside: transformers' model loading (its activations, accelerate) and our layers
_FRONT_END_LOADING_CODE = ("transformers.activations", "accelerate", "mmengine.layers")


@pytest.fixture(scope="module")
def front_end_at_ready(checkpoint_dir, family_checkpoint, tmp_path_factory) -> dict[str, object]:
    """Two fresh interpreters: a front end's (its modules, then the intake's parts a front end builds for the tiny
    LLaVA and the tiny Qwen2.5-VL, each its processor's kind and the model code imported by then; Qwen's picture
    preparer's spec pickled, as the preprocessing pool sends it) and a preprocessing worker's (the spec unpickled
    and the preparer built and warmed up, then the model code imported by then)."""
    spec_file = tmp_path_factory.mktemp("spec") / "spec.pkl"
    front_end = (
        "import pickle, sys\n"
        "def found(names): return sorted(m for m in names if m in sys.modules)\n"
        + _HOST_SIDE_IMPORTS +
        "from mmengine.config import EngineConfig\n"
        "from mmengine.engine.input_parts import build_input_parts\n"
        f"for path in {[str(checkpoint_dir()), str(family_checkpoint('qwen2_5_vl'))]!r}:\n"
        "    parts = build_input_parts(EngineConfig(model=path, engine_core='process', device='cpu'))\n"
        "    print('processor', type(parts.input_processor.hf_processor).__name__)\n"
        f"    print('model_code', found({_FRONT_END_MODEL_CODE!r}))\n"
        f"    print('front_end_loading_code', found({_FRONT_END_LOADING_CODE!r}))\n"
        f"open({str(spec_file)!r}, 'wb').write(pickle.dumps(parts.input_processor.pictures.spec()))\n"
    )
    worker = (
        "import pickle, sys\n"
        "def found(names): return sorted(m for m in names if m in sys.modules)\n"
        "from mmengine.multimodal import preprocess_pool\n"
        "from mmengine.multimodal.picture_preparer import PicturePreparer\n"
        f"preparer = PicturePreparer.from_spec(pickle.loads(open({str(spec_file)!r}, 'rb').read()))\n"
        "preparer.warm_up()\n"
        "print('worker', type(preparer.image_processor).__name__)\n"
        f"print('model_code', found({_FRONT_END_MODEL_CODE!r}))\n"
        f"print('worker_loading_code', found({_FRONT_END_LOADING_CODE!r}))\n"
    )
    findings: dict[str, list] = {"processor": [], "model_code": [], "worker": [], "front_end_loading_code": [],
                                 "worker_loading_code": []}
    for probe in (front_end, worker):
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
        for tag, value in (line.split(" ", 1) for line in result.stdout.splitlines() if " " in line):
            if tag in findings:
                findings[tag].append(value if tag in ("processor", "worker") else ast.literal_eval(value))
    return findings


def test_a_front_ends_processor_and_its_workers_load_no_model_code(front_end_at_ready):
    """A front end loads its checkpoint's LightProcessor (tokenizer, image processor, chat template), not
    transformers' processor, and with it neither transformers' modeling code nor Triton; a preprocessing worker
    that unpickles its image processor neither (LLaVA, then Qwen2.5-VL; then Qwen's worker)."""
    assert front_end_at_ready["processor"] == ["LightProcessor", "LightProcessor"]
    assert front_end_at_ready["worker"] == ["Qwen2VLImageProcessorPil"]
    assert front_end_at_ready["model_code"] == [[], [], []]
    # (nor, in a front end, transformers' model loading or our layers: the config loads without them, and the family's
    # module imports none)
    assert front_end_at_ready["front_end_loading_code"] == [[], []]
    assert front_end_at_ready["worker_loading_code"] == [[]]  # (its image processor's class imports the validators too)


# what transformers.activations brings: transformers' model loading (accelerate, sympy, botocore)
_MODEL_LOADING = ("transformers.activations", "transformers.core_model_loading", "accelerate")


@pytest.fixture(scope="module")
def config_loads(family_checkpoint) -> dict[str, object]:
    """One fresh interpreter that loads every family's tiny checkpoint's config as a front end does
    (registry.load_hf_config): each config's to_dict(), the model loading code imported by then, and then what
    transformers' activation validator reads (the real ACT2FN, imported as it is read)."""
    paths = {model_type: str(family_checkpoint(model_type)) for model_type in sorted(FAMILIES)}
    probe = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "def found(names): return sorted(m for m in names if m in sys.modules)\n"
        "from mmengine.models.registry import load_hf_config\n"
        f"for model_type, path in {paths!r}.items():\n"
        "    print('config', json.dumps([model_type, load_hf_config(Path(path)).to_dict()], sort_keys=True, default=str))\n"
        f"print('model_loading_after_configs', found({_MODEL_LOADING!r}))\n"
        "from transformers.utils import type_validators\n"
        "print('validator_reads', [type(type_validators.ACT2FN.get('gelu')).__name__, 'no_such_activation' in type_validators.ACT2FN])\n"
        f"print('model_loading_after_validator', found({_MODEL_LOADING!r}))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    findings: dict[str, object] = {"configs": {}}
    for tag, value in (line.split(" ", 1) for line in result.stdout.splitlines() if " " in line):
        if tag == "config":
            model_type, config = json.loads(value)
            findings["configs"][model_type] = config
        elif tag in ("model_loading_after_configs", "validator_reads", "model_loading_after_validator"):
            findings[tag] = ast.literal_eval(value)
    return findings


def test_a_front_ends_config_load_imports_no_model_loading_code(config_loads):
    """Loading a checkpoint's config (every family's) leaves transformers' activations and the model loading it
    imports (accelerate, sympy, botocore) out; the activation validator still reads transformers' real ACT2FN,
    which it imports as it reads it."""
    assert sorted(config_loads["configs"]) == sorted(FAMILIES)
    assert config_loads["model_loading_after_configs"] == []
    assert config_loads["validator_reads"] == ["GELUActivation", False]
    assert config_loads["model_loading_after_validator"] == sorted(_MODEL_LOADING)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_config_loaded_without_model_loading_code_is_transformers_own(model_type, family_checkpoint, config_loads):
    """The front end's config is the one transformers' AutoConfig loads with its activations imported."""
    import transformers.activations  # noqa: F401  (the ordinary import of the validators)
    from transformers import AutoConfig

    expected = AutoConfig.from_pretrained(str(family_checkpoint(model_type)), local_files_only=True).to_dict()
    assert config_loads["configs"][model_type] == json.loads(json.dumps(expected, sort_keys=True, default=str))


def _module_level_imports(name: str, paths: dict[str, Path]) -> set[str]:
    """The mmengine modules `name` imports as it is imported (its module-level statements, TYPE_CHECKING aside; the
    imports inside functions run later, when called), with the packages each passes through."""
    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in paths:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    path = paths[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.If):
                visit(node.orelse if "TYPE_CHECKING" in ast.unparse(node.test) else node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + [s for h in node.handlers for s in h.body] + node.orelse + node.finalbody)
            elif isinstance(node, ast.Import):
                found.update(resolve(alias.name) for alias in node.names if alias.name.startswith("mmengine"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                if base.startswith("mmengine"):
                    found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in paths else resolve(base) for a in node.names)

    visit(ast.parse(path.read_text()).body)
    for module in list(found - {None}):
        parts = module.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return found - {None, name}


def _package_paths() -> dict[str, Path]:
    return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts[: -1 if p.name == "__init__.py" else None]): p
            for p in PACKAGE.rglob("*.py")}


def _import_closure(roots: list[str], paths: dict[str, Path]) -> set[str]:
    """The mmengine modules importing `roots` imports (module level, transitively), the roots included."""
    imported: set[str] = set()
    pending = list(roots)
    while pending:
        module = pending.pop()
        if module not in imported:
            imported.add(module)
            pending.extend(_module_level_imports(module, paths))
    return imported


def _imports_in_function(module: str, function: str, paths: dict[str, Path]) -> set[str]:
    """The mmengine modules a function (or method) of `module` imports in its body, as it runs."""
    (node,) = [n for n in ast.walk(ast.parse(paths[module].read_text()))
               if isinstance(n, ast.FunctionDef) and n.name == function]
    return {n.module for n in ast.walk(node) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("mmengine")}


# model code: what only the engine core and its ranks run
_MODEL_SIDE_PACKAGES = ("mmengine.layers", "mmengine.runner", "mmengine.kernels", "mmengine.distributed")
# the models/ modules a host-side process may import: the family interface and registry, and plain config readers
_HOST_SIDE_MODELS = {"mmengine.models", "mmengine.models.family", "mmengine.models.registry", "mmengine.models.quantization",
                     "mmengine.models.text_config", "mmengine.models.config_import"}


def _model_side(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in _MODEL_SIDE_PACKAGES)
                  or (m.startswith("mmengine.models.") and m not in _HOST_SIDE_MODELS))


def test_a_front_end_and_a_preprocessing_worker_import_no_model_side_module():
    """A front end (what front_end_main imports as it starts) and a preprocessing worker (its module, and what
    PicturePreparer.from_spec imports to build its family) prepare inputs and never run the model: their imports
    reach the family interface, never the layers, the runner, the kernels, the distributed code or a family's model.
    (The checkpoint's own family module is imported when its family is resolved, at start-up.)"""
    paths = _package_paths()
    front_end_roots = _imports_in_function("mmengine.entrypoints.server_processes", "front_end_main", paths)
    assert front_end_roots == {"mmengine.engine.async_engine", "mmengine.engine.core_client", "mmengine.entrypoints.api_server"}
    front_end = _import_closure(["mmengine.entrypoints.server_processes", *front_end_roots], paths)
    worker_roots = _imports_in_function("mmengine.multimodal.picture_preparer", "from_spec", paths)
    worker = _import_closure(["mmengine.multimodal.preprocess_pool", *worker_roots], paths)
    # (the walk reaches the intake, the processor and the family interface: it sees what they import)
    assert {"mmengine.engine.intake", "mmengine.multimodal.processor", "mmengine.models.family"} <= front_end
    assert {"mmengine.multimodal.picture_preparer", "mmengine.models.family", "mmengine.models.registry"} <= worker
    assert _model_side(front_end) == []
    assert _model_side(worker) == []


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_familys_module_imports_no_model_side_module(model_type):
    """The module the registry names for a family (what a front end and a preprocessing worker import to find its
    ModelFamily) imports no layers, runner, kernels or distributed module and not its model's module: its model
    class is a ModelClass, named by module and imported when the model is built (a family whose module imports
    model code at module level fails here)."""
    entry = FAMILIES[model_type]
    paths = _package_paths()
    model_class = inspect.getattr_static(entry.load(), "model_class")
    assert isinstance(model_class, ModelClass) and model_class.module in paths
    imported = _import_closure([entry.module], paths)
    assert "mmengine.models.family" in imported  # (the walk sees the family's imports)
    assert sorted(m for m in imported if m.startswith(_MODEL_SIDE_PACKAGES)) == []
    assert model_class.module not in imported and "mmengine.models.vlm" not in imported
    # (and the model's module is where the model code is: what the family's module no longer imports)
    assert any(m.startswith(_MODEL_SIDE_PACKAGES) for m in _import_closure([model_class.module], paths))


def test_a_rank_and_the_tensor_parallel_driver_import_no_familys_model_but_their_own():
    """A rank imports ModelWorker's module (its factory's) and the worker loop; its family's module comes with the
    family it is handed. Neither they nor the driver's ParallelRunner import another family's model or split decoder
    (sharded_model.py imports a family's split when it splits that family): each process pays for one family."""
    from mmengine.distributed.sharded_model import SPLIT_DECODERS

    imported = _import_closure(["mmengine.runner.worker", "mmengine.distributed.worker_loop", "mmengine.runner.parallel_runner"],
                               _package_paths())
    assert "mmengine.distributed.sharded_model" in imported and "mmengine.models.llama" in imported  # (the probe sees them)
    # (LLaMA's decoder is every dense family's: the ranks' and the driver's shared code builds on it)
    decoders = {kind.rpartition(".")[0] for kind in SPLIT_DECODERS} - {"mmengine.models.llama"}
    family_modules = {entry.module for entry in FAMILIES.values()}
    assert sorted(imported & (decoders | family_modules)) == []
