"""kernels/interpreter.py: `lean_interpreter` changes no bit a kernel computes, restores the interpreter on exit, and
patches nothing on a Triton version it was not checked on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kernels import interpreter as patches
from tests.helpers import ROOT

# One process, the interpreter as Triton ships it, then inside lean_interpreter: the dense FP8 GEMM (jit helpers,
# integer index arithmetic) and the 1x128 quantizer on fresh random inputs, outputs compared bit for bit.
SAME_BITS = """
import torch
from fp8.gemm import fp8_gemm
from fp8.quant import quantize_1x128_triton, quantize_128x128
from kernels.interpreter import fixed_fp8_cast, lean_interpreter

torch.manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
x = torch.randn(160, 256) * 3
w = torch.randn(256, 256) * 0.02

def run():
    with fixed_fp8_cast():
        xq, xs = quantize_1x128_triton(x, False)
        wq, ws = quantize_128x128(w, backend="triton")
        return xq.view(torch.uint8), xs, fp8_gemm(xq, xs, wq, ws, out_dtype=torch.float32, backend="triton")

plain = run()
with lean_interpreter() as patched:
    assert patched, "lean_interpreter patched nothing on this Triton"
    lean = run()
for a, b in zip(plain, lean):
    assert torch.equal(a, b), "lean_interpreter changed a kernel's output"
print("same bits")
"""


def _state():
    return (patches.interpreter._patch_lang, patches.interpreter.GridExecutor.__call__,
            patches.interpreter.interpreter_builder.options)


@pytest.mark.skipif(not patches.interpreter_available(), reason="triton is not installed")
@pytest.mark.skipif(patches.triton is None or patches.triton.__version__ not in patches.CHECKED_TRITON_VERSIONS,
                    reason="lean_interpreter patches only the checked Triton versions")
def test_lean_interpreter_same_bits_as_the_plain_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SAME_BITS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "same bits" in proc.stdout


@pytest.mark.skipif(not patches.interpreter_available(), reason="triton is not installed")
def test_lean_interpreter_restores_on_exit_and_skips_unchecked_versions(monkeypatch):
    before = _state()
    with patches.lean_interpreter() as patched:
        if patched:
            assert _state()[:2] != before[:2]
            assert not patches.interpreter.interpreter_builder.options.sanitize_overflow
    assert _state() == before
    monkeypatch.setattr(patches.triton, "__version__", "0.0.0-unchecked")
    with patches.lean_interpreter() as patched:
        assert not patched
        assert _state() == before
