"""Smoke test of bench/bench_model.py on CPU: every table prints, the model table last, kernels grouped by part."""

from __future__ import annotations

import pytest

from tests.helpers import load_bench


@pytest.mark.slow
def test_bench_model_runs_on_cpu_and_prints_the_model_table_last(capsys):
    bench = load_bench("bench_model")
    bench.main(["--device", "cpu", "--models", "tiny", "--seq-len", "64", "--steps", "1", "--warmup", "1",
                "--variants", "fast,old_loss,selective", "--loss-chunks", "16,64"])
    out = capsys.readouterr().out
    assert "LM head + loss" in out and "attention core" in out
    assert "chunks of 16 tokens" in out and "chunks of 64 tokens" in out
    profile = out[out.index("### Where"):out.index("| **total**")]
    for part in ("attention (QK-norm", "dense linears", "LM head + loss", "MoE"):
        assert part in profile, part
    table = out[out.rindex("### Model forward + backward"):].splitlines()
    assert [line.split(" | ")[1] for line in table if line.startswith("| tiny")] == ["fast", "old_loss", "selective"]
