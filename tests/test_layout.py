"""The project's import graph, read with `ast` (nothing is imported): no import cycle among the project's modules,
the layer rules between packages, no private name taken from another module, no test, script or benchmark
imported by the library, no `unittest.mock` in it, and lazy (function-level) imports of project modules only
where the allow-list below gives a reason."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tests.helpers import ROOT

PACKAGES = ("model", "fp8", "data", "ling", "kernels")  # the library; a package not (yet) there is skipped
NOT_LIBRARY = ("tests", "scripts", "bench")  # nothing in the library imports these
# package -> the packages it must not import (fp8 is numerics only, data is tokens only, model is the network)
FORBIDDEN = {
    "model": {"ling", "data"},
    "fp8": {"model", "ling", "data"},
    "data": {"model", "fp8", "ling"},
}
# Lazy imports of project modules, (importing module, imported module): each with its reason. Anything else
# belongs at the top of its module (house rules: imports run one way, at the top).
LAZY_IMPORTS = {
    ("data.loader", "data.text_loader"): "pulls in `datasets` and sentencepiece (seconds); synthetic data never "
                                         "needs them",
    ("data.prepare", "data.text_loader"): "pulls in `datasets` and sentencepiece (seconds); only a preparation run "
                                          "needs them",
    ("data.loader", "data.synthetic"): "picked by name beside data.text_loader; no start-up cost of its own",
    ("ling.checkpoint.weights", "data.corpus"): "pulls in `datasets` (about a second at every start of train.py, "
                                                "eval.py, export); only a run dir from before 2026-12 without its "
                                                "own tokenizer copy needs the corpus",
    ("ling.ranks", "ling.train.deepspeed_compat"): "imports DeepSpeed (seconds, and a banner): loaded where "
                                                   "init_distributed starts DeepSpeed",
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing project module
    target: str  # the imported module (the package itself for `from package import name` of a non-module)
    names: tuple[str, ...]  # names taken from it with `from target import ...` (empty for `import target`)
    lazy: bool  # inside a function
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def project_modules(root: Path) -> dict[str, Path]:
    """Every module of the packages under `root` that exist: dotted name -> file."""
    return {module_name(f, root): f for pkg in PACKAGES if (root / pkg).is_dir()
            for f in sorted((root / pkg).rglob("*.py"))}


def lazy_nodes(tree: ast.Module) -> set[int]:
    """ids of the import statements inside a function (at any depth)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inside


def source_of(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


@cache
def imports(root: Path) -> tuple[Import, ...]:
    """Every import statement of every project module (of project modules and of anything else)."""
    modules = project_modules(root)
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        lazy = lazy_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [Import(module, a.name, (), id(node) in lazy, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = source_of(module, path, node)
                for a in node.names:  # `from pkg import mod` imports the module pkg.mod
                    target = f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src
                    found.append(Import(module, target, () if target != src else (a.name,), id(node) in lazy,
                                        node.lineno))
    return tuple(found)


def project_target(target: str, root: Path) -> str | None:
    """The project module an import of `target` loads (its nearest enclosing project module), else None."""
    modules = project_modules(root)
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def top(module: str) -> str:
    return module.partition(".")[0]


def where(i: Import) -> str:
    return f"{i.module}:{i.line} imports {i.target}" + (f" ({', '.join(i.names)})" if i.names else "")


# ------------------------------------------------------------------------------------------------ the rules
def import_cycles(root: Path) -> list[list[str]]:
    """Tarjan's strongly connected components (> 1 module) of the graph of module- and function-level imports."""
    graph: dict[str, set[str]] = {m: set() for m in project_modules(root)}
    for i in imports(root):
        target = project_target(i.target, root)
        if target and target != i.module:
            graph[i.module].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def layer_breaks(root: Path) -> list[str]:
    return [where(i) for i in imports(root)
            if (target := project_target(i.target, root)) and top(target) in FORBIDDEN.get(top(i.module), ())]


def private_name_imports(root: Path) -> list[str]:
    """`from module import _name` where module is another project module."""
    return [where(i) for i in imports(root) if (target := project_target(i.target, root)) and target != i.module
            and any(n.startswith("_") for n in i.names)]


def private_module_imports(root: Path) -> list[str]:
    """Private modules (`pkg._mod`) imported from outside their package."""
    return [where(i) for i in imports(root) if (target := project_target(i.target, root))
            and top(target) != top(i.module) and any(p.startswith("_") for p in target.split("."))]


def non_library_imports(root: Path) -> list[str]:
    return [where(i) for i in imports(root) if top(i.target) in NOT_LIBRARY]


def mock_uses(root: Path) -> list[str]:
    found = [where(i) for i in imports(root)
             if i.target == "unittest.mock" or (i.target == "unittest" and "mock" in i.names)]
    for module, path in project_modules(root).items():  # `import unittest` then `unittest.mock`
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "mock" and isinstance(node.value, ast.Name)
                    and node.value.id == "unittest"):
                found.append(f"{module}:{node.lineno} uses unittest.mock")
    return found


def lazy_project_imports(root: Path) -> dict[tuple[str, str], list[str]]:
    """(module, imported project module) -> where, for the imports inside functions."""
    found: dict[tuple[str, str], list[str]] = {}
    for i in imports(root):
        target = project_target(i.target, root)
        if i.lazy and target and target != i.module:
            found.setdefault((i.module, target), []).append(where(i))
    return found


# ------------------------------------------------------------------------------------------------ the tests
def test_the_packages_are_found():
    modules = project_modules(ROOT)
    assert {"model", "fp8", "data", "ling"} <= {top(m) for m in modules}
    assert len(modules) > 20 and imports(ROOT)


def test_no_import_cycle():
    assert import_cycles(ROOT) == []


def test_layer_rules():
    assert layer_breaks(ROOT) == []


def test_no_private_name_is_imported_from_another_module():
    assert private_name_imports(ROOT) == []


def test_no_private_module_is_imported_from_another_package():
    assert private_module_imports(ROOT) == []


def test_the_library_imports_no_test_script_or_benchmark():
    assert non_library_imports(ROOT) == []


def test_no_unittest_mock_in_the_library():
    assert mock_uses(ROOT) == []


def test_lazy_imports_of_project_modules_are_allow_listed():
    unlisted = [w for pair, ws in lazy_project_imports(ROOT).items() if pair not in LAZY_IMPORTS for w in ws]
    assert unlisted == [], f"move these to the top of their module or allow-list them with a reason: {unlisted}"


def test_the_lazy_import_allow_list_is_current():
    stale = sorted(set(LAZY_IMPORTS) - set(lazy_project_imports(ROOT)))
    assert stale == [], f"no longer lazy, drop them from LAZY_IMPORTS: {stale}"


def test_each_rule_finds_its_breach_in_a_made_up_tree(tmp_path):
    """A tree with one breach of each rule: every check above can fail."""
    files = {
        "fp8/__init__.py": "",
        "fp8/a.py": "from .b import _hidden\nfrom unittest import mock\n\n\ndef f():\n    import fp8.b\n",
        "fp8/b.py": "import model.net\nfrom fp8 import a\n\n_hidden = 1\n",
        "fp8/_util.py": "",
        "model/__init__.py": "",
        "model/net.py": "import unittest\nfrom fp8._util import x\nfrom tests.helpers import ROOT\n"
                        "y = unittest.mock\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert import_cycles(tmp_path) == [["fp8.a", "fp8.b"]]
    assert layer_breaks(tmp_path) == ["fp8.b:1 imports model.net"]
    assert private_name_imports(tmp_path) == ["fp8.a:1 imports fp8.b (_hidden)"]
    assert private_module_imports(tmp_path) == ["model.net:2 imports fp8._util (x)"]
    assert non_library_imports(tmp_path) == ["model.net:3 imports tests.helpers (ROOT)"]
    assert sorted(mock_uses(tmp_path)) == ["fp8.a:2 imports unittest (mock)", "model.net:4 uses unittest.mock"]
    assert lazy_project_imports(tmp_path) == {("fp8.a", "fp8.b"): ["fp8.a:6 imports fp8.b"]}
