"""The package's import graph keeps the house's rules (docs/architecture.md): no circles, kernels take
plain arguments, plain data imports no manager, the engine's layers import downward only, and no
private name crosses a module. Every import counts: module level, inside functions, TYPE_CHECKING."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mmengine"

# Plain data: what every layer passes around. It imports only other plain data (and the errors).
PLAIN_DATA = {
    "mmengine.config", "mmengine.errors", "mmengine.outputs", "mmengine.core.request", "mmengine.sample.params",
    "mmengine.sample.structured_output.params", "mmengine.lora.request",
}
# The layers above the engine: only they (and the engine itself) may import it.
ABOVE_THE_ENGINE = ("mmengine.engine", "mmengine.entrypoints", "mmengine.ray", "mmengine.cli", "mmengine.__main__",
                    "mmengine.testing")


@dataclass
class Module:
    name: str
    imports: set[str] = field(default_factory=set)  # mmengine modules this one imports
    private_uses: list[str] = field(default_factory=list)  # "_name from module" crossing into this one


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def build_graph(root: Path = PACKAGE) -> dict[str, Module]:
    paths = {module_name(p, root): p for p in root.rglob("*.py")}

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in paths:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph = {}
    for name, path in paths.items():
        module = graph[name] = Module(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        module_aliases: dict[str, str] = {}
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("mmengine") and (target := resolve(alias.name)):
                        module.imports.add(target)
                        if alias.asname:
                            module_aliases[alias.asname] = target
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if not base.startswith("mmengine"):
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in paths:  # a submodule
                        module.imports.add(full)
                        module_aliases[alias.asname or alias.name] = full
                    elif target := resolve(base):
                        module.imports.add(target)
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            module.private_uses.append(f"{alias.name} from {target}")
        for node in ast.walk(tree):  # module._name, for a module imported under a name
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in module_aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                module.private_uses.append(f"{node.attr} of {module_aliases[node.value.id]}")
        module.imports.discard(name)
    return graph


def cycles(graph: dict[str, Module]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start].imports)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor].imports))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def in_package(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


@pytest.fixture(scope="module")
def graph() -> dict[str, Module]:
    return build_graph()


def test_the_walker_sees_imports_of_every_form(tmp_path):
    package = tmp_path / "mmengine"
    (package / "a").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a" / "__init__.py").write_text("")
    (package / "a" / "x.py").write_text("from mmengine.a import y\nimport mmengine.b as b\nb._secret\n")
    (package / "a" / "y.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mmengine.a.x import thing\n")
    (package / "b.py").write_text("def f():\n    from .a.y import _hidden\n")
    built = build_graph(package)
    assert built["mmengine.a.x"].imports == {"mmengine.a.y", "mmengine.b"}
    assert built["mmengine.b"].imports == {"mmengine.a.y"}
    assert cycles(built) == [["mmengine.a.x", "mmengine.a.y", "mmengine.b"]]  # x -> b -> y -> x
    assert built["mmengine.a.x"].private_uses == ["_secret of mmengine.b"]
    assert built["mmengine.b"].private_uses == ["_hidden from mmengine.a.y"]


def test_no_import_circles(graph):
    assert cycles(graph) == []


def test_kernels_take_plain_arguments_and_import_only_kernels(graph):
    outside = {m.name: sorted(i for i in m.imports if not in_package(i, "mmengine.kernels"))
               for m in graph.values() if in_package(m.name, "mmengine.kernels")}
    assert {name: found for name, found in outside.items() if found} == {}


def test_plain_data_imports_no_manager(graph):
    assert {name: sorted(graph[name].imports - PLAIN_DATA) for name in PLAIN_DATA if graph[name].imports - PLAIN_DATA} == {}


def test_only_the_layers_above_the_engine_import_it(graph):
    upward = {m.name: sorted(i for i in m.imports if in_package(i, *ABOVE_THE_ENGINE))
              for m in graph.values() if not in_package(m.name, *ABOVE_THE_ENGINE) and m.name != "mmengine"}
    assert {name: found for name, found in upward.items() if found} == {}


def test_no_private_name_crosses_a_module(graph):
    assert {m.name: m.private_uses for m in graph.values() if m.private_uses} == {}


def test_the_root_holds_only_the_face():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "cli.py", "config.py", "errors.py", "outputs.py"]
