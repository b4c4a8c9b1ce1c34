"""Each process imports what it uses: the family registry imports only the family a checkpoint asks for
(not every family's module, vision towers and processor code), so an engine, a tensor-parallel rank, a
front end and a preprocessing worker each pay for one family at start-up."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import PretrainedConfig

from mmengine.errors import UnsupportedModelError
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


@pytest.fixture(scope="module")
def fresh_interpreter(checkpoint_dir) -> dict[str, object]:
    """One fresh interpreter for both probes, in this order: Ray's sharing keys hash a prompt (the heavy modules
    imported by then), then each architecture is resolved in turn (its family class, and the family modules that
    resolving it imported beyond those before it)."""
    modules = sorted({entry.module for entry in FAMILIES.values()})
    probe = (
        "import sys\n"
        "from mmengine.ray.keys import SharingKeys\n"
        f"SharingKeys({str(checkpoint_dir())!r}).prefix_chain('hello world')\n"
        f"print(sorted(m for m in {_HEAVY!r} if m in sys.modules))\n"
        "from transformers import PretrainedConfig\n"
        "from mmengine.models.registry import family_class_for\n"
        f"modules = {modules!r}\n"
        f"for architecture in {_FAMILY_TURNS!r}:\n"
        "    before = {m for m in modules if m in sys.modules}\n"
        "    family = family_class_for(PretrainedConfig(architectures=[architecture]))\n"
        "    print(family.__name__, sorted(m for m in modules if m in sys.modules and m not in before))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    lines = result.stdout.strip().splitlines()[-1 - len(_FAMILY_TURNS):]
    turns = [(name, ast.literal_eval(found)) for name, found in (line.split(" ", 1) for line in lines[1:])]
    return {"heavy_after_sharing_keys": ast.literal_eval(lines[0]), "family_turns": turns}


def test_resolving_a_family_imports_that_family_only(fresh_interpreter):
    # LLaVA's module stands alone; Qwen3.5's builds on Qwen3-VL's, which builds on Qwen2-VL's
    assert fresh_interpreter["family_turns"] == [
        ("LlavaFamily", ["mmengine.models.llava"]),
        ("Qwen3_5Family", ["mmengine.models.qwen3_5", "mmengine.models.qwen3_vl", "mmengine.models.qwen_vl"])]


def test_sharing_keys_tokenize_as_the_processor_without_loading_it(checkpoint_dir, fresh_interpreter):
    """Ray's sharing keys need the tokenizer only: the driver loads it alone (not the processor, whose import
    pulls transformers' modeling code), and it tokenizes as the processor's own tokenizer does."""
    from mmengine.models.registry import load_hf_processor
    from mmengine.ray.keys import SharingKeys

    path = checkpoint_dir()
    prompt = "USER: <image>\nWhat is in this picture, and why? ASSISTANT:"
    assert SharingKeys(path).tokenizer(prompt)["input_ids"] == load_hf_processor(path).tokenizer(prompt)["input_ids"]
    assert fresh_interpreter["heavy_after_sharing_keys"] == []


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


def test_a_rank_and_the_tensor_parallel_driver_import_no_familys_model_but_their_own():
    """A rank imports ModelWorker's module (its factory's) and the worker loop; its family's module comes with the
    family it is handed. Neither they nor the driver's ParallelRunner import another family's model or split decoder
    (sharded_model.py imports a family's split when it splits that family): each process pays for one family."""
    from mmengine.distributed.sharded_model import SPLIT_DECODERS

    paths = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts[: -1 if p.name == "__init__.py" else None]): p
             for p in PACKAGE.rglob("*.py")}
    imported: set[str] = set()
    pending = ["mmengine.runner.worker", "mmengine.distributed.worker_loop", "mmengine.runner.parallel_runner"]
    while pending:
        module = pending.pop()
        if module not in imported:
            imported.add(module)
            pending.extend(_module_level_imports(module, paths))
    assert "mmengine.distributed.sharded_model" in imported and "mmengine.models.llama" in imported  # (the probe sees them)
    # (LLaMA's decoder is every dense family's: the ranks' and the driver's shared code builds on it)
    decoders = {kind.rpartition(".")[0] for kind in SPLIT_DECODERS} - {"mmengine.models.llama"}
    family_modules = {entry.module for entry in FAMILIES.values()}
    assert sorted(imported & (decoders | family_modules)) == []
