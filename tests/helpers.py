"""What several test modules share: the repository's paths and Hydra composition, the CPU/GPU device parameter,
tensor comparisons, FP8 layer and grouped-row builders, run-dir builders for the trainer and for compare mode, and
the small model of the DeepSpeed worker. Fixtures live in tests/conftest.py; no test module imports another."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import nn

from fp8.grouped import GroupedRows
from ling.analysis.compare import HEALTH_KINDS

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def load_bench(name: str):
    """bench/<name>.py as a module (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[name] = bench  # registered before it runs, as an import does (dataclasses look their module up)
    spec.loader.exec_module(bench)
    return bench


def compose_cfg(overrides: list[str]):
    """conf/config.yaml with `overrides` (Hydra's command-line syntax), composed as train.py composes it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


# ------------------------------------------------------------------------------------------------ devices
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def setup_device(device: str, request) -> None:
    """CPU: run kernels in the interpreter, which needs its float32->e4m3 cast fixed (triton #8322)."""
    if device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1")
        request.getfixturevalue("triton_interpreter")


# ------------------------------------------------------------------------------------------------ comparisons
def dynamo_graphs(fused) -> int:
    """How many graphs dynamo holds for a `kernels.fusable.Fusable` (one per input signature it was compiled for).
    Through torch's lazy `torch._dynamo` attribute: importing this module does not import dynamo (3 s of CPU)."""
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(fused.eager.__code__))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:  # bit-exact, except that any NaN encoding (0x7F / 0xFF) is NaN
        a, b = a.cpu(), b.cpu()
        nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
        bits_a, bits_b = a.view(torch.uint8).masked_fill(nan_a, 0), b.view(torch.uint8).masked_fill(nan_b, 0)
        return torch.equal(nan_a, nan_b) and torch.equal(bits_a, bits_b)
    return torch.equal(a.cpu(), b.cpu()) or torch.equal(a.cpu().nan_to_num(), b.cpu().nan_to_num())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b||_F / ||b||_F in float64 on the CPU (fp8.health.relative_error is the fp32 one the library logs)."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------------------------------------ FP8 builders
def run(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward and backward of `layer` on a fresh leaf copy of x with output gradient dy: (y, dx, dW)."""
    x = x.detach().clone().requires_grad_()
    layer.weight.grad = None
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad.detach(), layer.weight.grad.detach()


def layout(lengths: list[int], alignment: int, device: str) -> tuple[GroupedRows, list[tuple[int, int]]]:
    """Segments of the given data lengths, each rounded up to `alignment` with zero rows, plus unused rows."""
    padded = [-(-n // alignment) * alignment for n in lengths]
    offsets = torch.tensor([0] + padded, dtype=torch.int64).cumsum(0).to(torch.int32)
    num_rows = int(offsets[-1]) + 40  # unused rows at the end, as the dispatch allocates them
    rows = GroupedRows(offsets.to(device), num_rows, alignment,
                       data_lengths=torch.tensor(lengths, device=device))  # fmt: skip
    return rows, [(int(offsets[g]), int(offsets[g]) + n) for g, n in enumerate(lengths)]


def data_rows(segments, num_rows: int, width: int, device: str, scale: float = 1.0) -> torch.Tensor:
    """Random rows where a segment has data, zero rows elsewhere (pad rows and unused rows)."""
    x = torch.zeros(num_rows, width)
    for lo, hi in segments:
        x[lo:hi] = torch.randn(hi - lo, width) * scale
    return x.to(device)


MLP_SIZES = (48, 96, 40)  # in, hidden, out: 48·96 + 96 + 96·40 + 40 = 8584 params, not a multiple of 128 or of 2·dp


def small_mlp() -> nn.Module:
    """The seeded MLP that tests/fp8/dist_adam_worker.py trains under DeepSpeed (its initial parameters)."""
    d_in, d_hid, d_out = MLP_SIZES
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, d_hid), nn.GELU(), nn.Linear(d_hid, d_out))


# ------------------------------------------------------------------------------------------------ train runs
# train.py's overrides for a tiny CPU run on synthetic data
COMMON = ["+exp=tiny_cpu", "data=synthetic", "data.kind=markov", "logging.wandb.mode=disabled",
          "logging.progress_bar=false", "train.seq_len=32",
          "optim.warmup_steps=2", "model.num_layers=2", "data.vocab_size=512"]


def metrics_of(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records ([] before the first)."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def same_losses(a: list[dict], b: list[dict]) -> None:
    """Asserts the same steps with identical loss, grad norm and learning rate."""
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        assert (x["loss"], x["grad_norm"], x["lr"]) == (y["loss"], y["grad_norm"], y["lr"]), (x, y)


def overwrite_4k(path: Path) -> None:
    """4 KiB of other bytes inside the file, size unchanged (what only a checksum sees)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2 - 2048)
        old = f.read(4096)
        f.seek(size // 2 - 2048)
        f.write(bytes(b ^ 0x5A for b in old))
    assert path.stat().st_size == size


# ------------------------------------------------------------------------------------------------ compare mode
COMPARE_STEPS = 200  # the synthetic runs' length


def run_config(**changes) -> dict:
    """A synthetic run's resolved config, with dotted-key `changes`."""
    conf = {"run_name": "x", "train": {"steps": COMPARE_STEPS, "seed": 1, "seq_len": 256},
            "optim": {"name": "adamw", "lr": 3e-4},
            "precision": {"name": "bf16"}, "fp8": {"recipe": "blockwise", "health_every": 0},
            "model": {"hidden_size": 128}}
    node = OmegaConf.create(conf)
    for key, value in changes.items():
        OmegaConf.update(node, key, value, force_add=True)
    return OmegaConf.to_container(node)


def write_run(root: Path, name: str, loss: np.ndarray, config: dict, health: bool = False,
              held_out: float | None = None) -> Path:
    """A run dir as compare mode reads it: metrics.jsonl with `loss` per step (FP8 health every 10 steps if
    `health`), resolved_config.yaml and, with `held_out`, a final validation record."""
    run = root / name
    run.mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as f:
        for i, value in enumerate(loss):
            rec = {"step": i + 1, "loss": float(value), "lr": 1e-3}
            if health and i % 10 == 0:
                for layer in ("layers.0.attention.dense", "layers.1.attention.dense"):
                    for k, kind in enumerate(HEALTH_KINDS):
                        rec[f"fp8/{layer}/{kind}_underflow"] = 0.01 * (k + 1) + 1e-5 * i
                        rec[f"fp8/{layer}/{kind}_distortion"] = 0.1 * (k + 1)
            f.write(json.dumps(rec) + "\n")
    (run / "resolved_config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create({**config, "run_name": name})))
    if held_out is not None:
        (run / "eval").mkdir()
        rec = {"step": len(loss), "split": "val", "precision": config["precision"]["name"],
               "metrics": {"loss": held_out}}
        (run / "eval" / f"step{len(loss):08d}-val.json").write_text(json.dumps(rec))
    return run


def baseline_loss(seed: int = 0) -> np.ndarray:
    """A decaying loss curve of COMPARE_STEPS steps with Gaussian noise (std 0.05) from `seed`."""
    rng = np.random.default_rng(seed)
    steps = np.arange(1, COMPARE_STEPS + 1)
    return 2.0 + 8.0 * np.exp(-steps / 40) + 0.05 * rng.standard_normal(COMPARE_STEPS)
