"""LR schedules: warmup, cosine floor, warmup-stable-decay."""

import pytest

from ling.train.schedule import lr_multiplier


def test_warmup_then_cosine_to_floor():
    f = lr_multiplier("cosine", total_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert f(0) == pytest.approx(0.1)
    assert f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.55)  # half-way down the cosine
    assert f(100) == pytest.approx(0.1)
    values = [f(s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_is_flat_then_decays_linearly():
    f = lr_multiplier("wsd", total_steps=100, warmup_steps=10, min_lr_ratio=0.0, decay_fraction=0.2)
    assert f(10) == f(50) == f(79) == 1.0
    assert f(90) == pytest.approx(0.5)
    assert f(100) == pytest.approx(0.0)


def test_bad_schedule_name_fails_naming_the_key():
    with pytest.raises(ValueError, match="optim.schedule"):
        lr_multiplier("linear", 10, 1)
