"""`kernels.tuning.Tuning`: a launch config's default, its interpreter default, and overrides that are scoped to
their `with` block (nested, undone on an exception), seen by every thread while it runs: also by the autograd
engine's device threads, which run a CUDA backward."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from kernels.tuning import Tuning
from tests.helpers import DEVICES, setup_device


@dataclass(frozen=True)
class Cfg:
    a: int = 1
    b: int = 2


def test_override_is_scoped_nested_and_undone_on_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tuning = Tuning("test", Cfg(), interpreter=Cfg(9, 9))
    assert tuning.current() == Cfg(1, 2)
    with tuning.override(a=3) as cfg:
        assert cfg == tuning.current() == Cfg(3, 2)
        with tuning.override(b=4):
            assert tuning.current() == Cfg(3, 4)
        assert tuning.current() == Cfg(3, 2)
        seen = []
        thread = threading.Thread(target=lambda: seen.append(tuning.current()))
        thread.start()
        thread.join()
        assert seen == [Cfg(3, 2)]  # another thread sees the open override
    assert tuning.current() == Cfg(1, 2)
    thread = threading.Thread(target=lambda: seen.append(tuning.current()))
    thread.start()
    thread.join()
    assert seen[-1] == Cfg(1, 2)  # and the default after the block
    with pytest.raises(RuntimeError, match="inside"):
        with tuning.override(Cfg(5, 5)):
            raise RuntimeError("inside")
    assert tuning.current() == Cfg(1, 2)
    with pytest.raises(TypeError):
        with tuning.override(c=1):
            pass
    assert tuning.current() == Cfg(1, 2)


def test_the_interpreter_default_applies_under_the_interpreter_and_an_override_still_wins(monkeypatch):
    tuning = Tuning("test", Cfg(), interpreter=Cfg(9, 9))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tuning.current() == Cfg(9, 9)
    with tuning.override(a=0):
        assert tuning.current() == Cfg(0, 9)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert tuning.current() == Cfg(1, 2)
    assert Tuning("plain", Cfg(7, 7)).current() == Cfg(7, 7)


@pytest.mark.parametrize("device", DEVICES)
def test_a_backward_inside_the_block_sees_the_override(device, request):
    """The autograd engine runs a CUDA backward on a device thread of its own: the override reaches it."""
    setup_device(device, request)
    tuning = Tuning("test", Cfg())
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(tuning.current())
            return grad * 2

    x = torch.ones(4, device=device, requires_grad=True)
    with tuning.override(a=7):
        Probe.apply(x).sum().backward()
    Probe.apply(x).sum().backward()
    assert seen == [Cfg(7, 2), Cfg(1, 2)]
    assert torch.equal(x.grad.cpu(), torch.full((4,), 4.0))
