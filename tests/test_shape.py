"""The package's shape (docs/design.md): no import cycle between its modules, no private name imported
from another module, no file over 800 lines, and one streaming step per network class."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nvchat_torch"
BENCHMARKS = PACKAGE.parent / "benchmarks"
MAX_LINES = 800
# The rows-era names of a second streaming step beside forward_step.
SECOND_STEPS = {"forward_rows", "step_rows"}


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str]]:
    """``(module, imported name)`` for every import of a package module anywhere in the file (inside
    functions and ``TYPE_CHECKING`` blocks too: they are edges of the design all the same)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.append((target, "") if target in known else (base, alias.name))
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
    return [(m, n) for m, n in found if m in known and m != name]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles a depth-first search meets (each as the path that closes it)."""
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        state[u] = 2
        stack.pop()

    for u in sorted(graph):
        if u not in state:
            visit(u)
    return found


def import_graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports; package faces (``__init__``) only hand names on, so
    edges into them are left out."""
    faces = {m for m, p in known.items() if p.name == "__init__.py"}
    return {m: {t for t, _ in imports(m, p, known) if t not in faces} for m, p in known.items() if m not in faces}


def two_streaming_steps(source: str) -> list[str]:
    """Classes that define ``forward_step`` and a second per-row step beside it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            names = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
            if "forward_step" in names and names & SECOND_STEPS:
                found.append(node.name)
    return found


def test_one_streaming_step_per_class():
    """Each network has one streaming step, ``forward_step(x, cache)``, for one row or many."""
    two = {str(p.relative_to(PACKAGE.parent)): names for p in PACKAGE.rglob("*.py")
           if (names := two_streaming_steps(p.read_text()))}
    assert not two


@pytest.mark.parametrize("root", [PACKAGE, BENCHMARKS], ids=["package", "benchmarks"])
def test_no_import_cycle(root):
    found = cycles(import_graph(modules(root)))
    assert not found, "import cycles: " + "; ".join(" -> ".join(found_cycle) for found_cycle in found)


# The modules docs and users name that moved into packages (docs/design.md, "The map"): each old name
# still imports and hands on the same objects.
OLD_NAMES = {"nvchat_torch.adapters": ("nvchat_torch.training.adapters", "add_lora"),
             "nvchat_torch.training_labels": ("nvchat_torch.training.labels", "function_marker_ids"),
             "nvchat_torch.finetune": ("nvchat_torch.training.finetune", "main"),
             "nvchat_torch.training": ("nvchat_torch.training.objectives", "tts_forward")}


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_old_module_names_still_import(old):
    new, name = OLD_NAMES[old]
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    assert getattr(old_module, name) is getattr(new_module, name)
    assert set(new_module.__all__) <= set(dir(old_module))


def test_no_private_name_is_imported_from_another_module():
    known = modules()
    private = [f"{m} imports {n} from {t}" for m, p in known.items() for t, n in imports(m, p, known)
               if n.startswith("_") and not n.startswith("__")]
    assert not private


def test_no_file_is_over_800_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long


def test_the_checks_catch_what_they_look_for(tmp_path):
    """The checks above on made-up code: a cycle through a TYPE_CHECKING import, a private import, a
    class with two streaming steps."""
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("from .a import A\n")
    (root / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nclass A: ...\n")
    (root / "b.py").write_text("from .a import A\nfrom .c import _hidden\nclass B: ...\n")
    (root / "c.py").write_text("def _hidden(): ...\n")
    known = modules(root)
    assert cycles(import_graph(known)) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert ("pkg.c", "_hidden") in imports("pkg.b", root / "b.py", known)
    assert two_streaming_steps("class N:\n    def forward_step(self): ...\n    def forward_rows(self): ...\n"
                               "class M:\n    def forward_step(self): ...\n") == ["N"]

