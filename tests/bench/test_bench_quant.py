"""bench/bench_quant.py on CPU (the PyTorch references; the timings need a GPU): it lists every quantization of one
MoE layer's forward and backward with the least bytes each moves, and its --compare finds a single changed bit
between two trees' saved outputs."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import load_bench


def test_every_quantization_of_a_moe_layer_is_listed_with_its_least_traffic(tmp_path, capsys):
    bench = load_bench("bench_quant")
    rows = bench.main(["--model", "tiny", "--tokens", "256", "--out", str(tmp_path)])
    parts = [r["part"] for r in rows]
    # 4 FP8Linears x (x dual, dy rows, dy token-dim); 10 expert quantizations; 4 + 2 weights per optimizer step
    assert parts.count("attention") == 6 and parts.count("shared expert") == 6 and parts.count("experts") == 10
    assert parts.count("weights (per optimizer step)") == 6
    # dy [256 tokens, 256 = QKV's output] bf16 read once, E4M3 codes and one fp32 scale per 128 values written
    dy_rows = next(r for r in rows if r["quantizer"] == "dy rows, linear [256, 128]")
    assert dy_rows["min_mb"] == pytest.approx((256 * 256 * 2 + 256 * 256 + 256 * 256 // 128 * 4) / 1e6, rel=1e-12)
    assert json.loads((tmp_path / "bench_quant.json").read_text()) == rows
    table = capsys.readouterr().out
    assert "| experts | dh token-dim (wgrad) |" in table and "MoE layers x 8 micro-batches" in table


def test_compare_reports_same_bits_and_finds_one_flipped_bit(tmp_path, capsys):
    bench = load_bench("bench_quant")
    for name in ("a", "b"):
        bench.main(["--model", "tiny", "--tokens", "256", "--save", str(tmp_path / name)])
    capsys.readouterr()
    bench.main(["--compare", str(tmp_path / "a"), str(tmp_path / "b")])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 28 and all("same bits" in line for line in lines)
    # flip the lowest bit of one E4M3 code of the gathered token-dim output
    path = next(p for p in sorted((tmp_path / "b").glob("*.pt")) if "gathered token-dim" in torch.load(p)["name"])
    saved = torch.load(path)
    codes = saved["outputs"][0].view(torch.uint8)
    codes.view(-1)[5] ^= 1
    torch.save(saved, path)
    bench.main(["--compare", str(tmp_path / "a"), str(tmp_path / "b")])
    differ = [line for line in capsys.readouterr().out.splitlines() if "DIFFER" in line]
    assert len(differ) == 1 and "gathered token-dim" in differ[0] and "[1, 0]" in differ[0]
