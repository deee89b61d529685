"""The profiled step (`train.profile_step`): the grouped table and its numbers, the attribution of CUDA kernels
(synthetic events), and the optimizer-state size logged as `optim_state_gib`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from ling.analysis.profiling import (
    GRAD_REDUCE,
    PART_OF_SCOPE,
    attribute,
    busy_us,
    device_links,
    host_group,
    idle_before_us,
    summarize,
)
from ling.train.engine import build_engine
from ling.train.trainer import train
from tests.helpers import CONF

TINY = ["+exp=tiny_cpu", "data=synthetic", "data.vocab_size=512", "train.seq_len=32", "model.num_layers=2",
        "train.micro_batch_size=2", "train.grad_accum=2", "deepspeed=zero2", "logging.wandb.mode=disabled",
        "logging.progress_bar=false", "train.save_final=false", "train.resume=none", "optim.warmup_steps=1"]


def run(tmp_path: Path, name: str, extra: list[str]) -> tuple[list[dict], list]:
    """train() on the tiny model; → (metrics.jsonl lines, the module's parameters)."""
    engines = []
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*TINY, *extra])
    train(cfg, run_dir=tmp_path / name, build_engine=lambda *a: engines.append(build_engine(*a)) or engines[-1])
    lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return lines, list(engines[0][0].module.parameters())


def zero2_state_bytes(params: list, optim: str, min_fp8_numel: int = 4096, block: int = 128) -> int:
    """By hand: ZeRO-2 on one rank flattens each param group (matrices with weight decay, vectors without)
    into one fp32 partition padded to a multiple of 2 elements (DeepSpeed's 4-byte alignment × 1 rank) and
    keeps an fp32 master copy of it (4 bytes/element); AdamW adds exp_avg + exp_avg_sq in fp32 (8), FP8AdamW
    one E4M3 byte per moment plus an fp32 scale per 128-block for each (partitions under min_fp8_numel: fp32)."""
    total = 0
    for group in ([p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]):
        n = sum(p.numel() for p in group)
        n += n % 2
        moments = 8 * n if optim == "adamw" or n < min_fp8_numel else 2 * n + 2 * 4 * math.ceil(n / block)
        total += 4 * n + moments
    return total


@pytest.mark.slow
def test_profiled_step_writes_the_grouped_table_and_leaves_the_run_unchanged(tmp_path):
    plain, params = run(tmp_path, "plain", ["train.steps=3"])
    profiled, _ = run(tmp_path, "profiled", ["train.steps=3", "train.profile_step=2"])
    # the profiler ranges change nothing: the same losses and gradient norms, bit for bit (CPU, fp32)
    keys = ("loss", "lm_loss", "mtp_loss", "grad_norm")
    assert [{k: r[k] for k in keys} for r in profiled] == [{k: r[k] for k in keys} for r in plain]

    folder = tmp_path / "profiled" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["step2.json", "step2.md"]  # no trace unless asked
    assert not (tmp_path / "plain" / "profile").exists()
    data = json.loads((folder / "step2.json").read_text())
    parts = {p["part"]: p["ms"] for p in data["parts"]}
    assert data["step"] == 2 and data["unit"] == "CPU self ms" and data["busy_ms"] is None
    # the parts are a partition of the total (float sums in another order: 1e-9)
    assert sum(parts.values()) == pytest.approx(data["total_ms"], rel=1e-9) and data["total_ms"] > 0
    assert sum(p["share"] for p in data["parts"]) == pytest.approx(1.0, rel=1e-9)
    assert 0 < data["total_ms"] <= data["wall_ms"]  # CPU self time of one thread fits in the wall time
    for part in ("optimizer (DeepSpeed step)", GRAD_REDUCE, "experts", "dense linears", "LM head + loss",
                 "attention (QK-norm, RoPE, SDPA/flex)", "router", "dispatch"):
        assert parts.get(part, 0) > 0, part
    assert set(parts) <= set(PART_OF_SCOPE.values()) | {"other"}
    md = (folder / "step2.md").read_text()
    assert md.startswith("### Where optimizer step 2 spends its time (CPU self ms per step)")
    rows = [line.split(" | ")[0].lstrip("| ") for line in md.splitlines()[4:4 + len(parts)]]
    assert rows == [p["part"] for p in data["parts"]]  # largest first, as in the json
    assert "Top 15 kernels overall" in md

    # optimizer state, logged once, on the first step: fp32 moments + fp32 master partitions, by hand
    assert [("optim_state_gib" in r) for r in plain] == [True, False, False]
    assert plain[0]["optim_state_gib"] * 2**30 == zero2_state_bytes(params, "adamw")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_profiled_step_on_gpu_groups_kernels_and_measures_busy_time(tmp_path, precision):
    """On CUDA: kernels (not CPU ops), the backward on autograd's device thread, ZeRO's hooks on it too."""
    optim = "fp8_adamw" if precision == "fp8" else "adamw"
    run(tmp_path, "gpu", ["train.steps=2", "train.profile_step=2", "train.device=cuda", f"precision={precision}",
                          f"optim={optim}", "model.hidden_size=256", "train.profile_trace=true"])
    folder = tmp_path / "gpu" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["step2.json", "step2.md", "step2.trace.json"]
    data = json.loads((folder / "step2.json").read_text())
    parts = {p["part"]: p["ms"] for p in data["parts"]}
    assert data["unit"] == "GPU ms" and sum(parts.values()) == pytest.approx(data["total_ms"], rel=1e-9)
    assert 0 < data["busy_ms"] <= data["wall_ms"] and 0 < data["busy_over_wall"] <= 1
    # one stream: busy time (a union) cannot exceed the kernels' sum; copies/memsets not tied to an op aside,
    # so allow a little (was 4x off when the GPU-side record_function ranges were counted as busy)
    assert data["busy_ms"] <= 1.05 * data["total_ms"], (data["busy_ms"], data["total_ms"])
    for part in ("optimizer (DeepSpeed step)", GRAD_REDUCE, "experts", "dense linears", "LM head + loss",
                 "attention (QK-norm, RoPE, SDPA/flex)", "router", "dispatch"):
        assert parts.get(part, 0) > 0, (part, parts)
    assert "GPU busy" in (folder / "step2.md").read_text()
    # the idle gaps lie inside the step, between device work: no more than its wall time less the busy time
    idle = {p["part"]: p["idle_ms"] for p in data["parts"]}
    assert 0 <= data["idle_ms"] <= data["wall_ms"] - data["busy_ms"] + 1e-6
    assert sum(idle.values()) == pytest.approx(data["idle_ms"], rel=1e-9, abs=1e-9)
    # the gaps are paired with the ops that end them (torch 2.11 keeps the pairing only in the raw events): with
    # no pairing every gap would land in "other"
    assert any(ms > 0 for part, ms in idle.items() if part != "other"), idle


def test_optimizer_state_of_fp8_adamw_is_the_hand_computed_size(tmp_path):
    lines, params = run(tmp_path, "fp8", ["train.steps=1", "optim=fp8_adamw"])
    expected = zero2_state_bytes(params, "fp8_adamw")
    assert lines[0]["optim_state_gib"] * 2**30 == expected
    assert expected < zero2_state_bytes(params, "adamw")  # the decay partition is over min_fp8_numel
    summary = json.loads((tmp_path / "fp8" / "summary.json").read_text())
    assert summary["optim_state_gib"] == lines[0]["optim_state_gib"]


@pytest.mark.parametrize("key", ["profile_step", "profile_python_step"])
@pytest.mark.parametrize("value", ["1", "0", "-3", "4", "abc", "2.5", "true"])
def test_a_bad_profile_step_is_refused_naming_the_key(tmp_path, key, value):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*TINY, "train.steps=3", f"train.{key}={value}"])
    with pytest.raises(ValueError, match=f"train.{key}"):
        train(cfg, run_dir=tmp_path)


def test_both_profilers_on_one_step_are_refused(tmp_path):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*TINY, "train.steps=3", "train.profile_step=2",
                                                       "train.profile_python_step=2"])
    with pytest.raises(ValueError, match="train.profile_step and train.profile_python_step are both 2"):
        train(cfg, run_dir=tmp_path)


@pytest.mark.slow
def test_python_profile_of_a_step_groups_host_time_by_package(tmp_path):
    """train.profile_python_step=2 (beside the torch profile of step 3): step 2's host time by package, whose
    shares partition the profiled self time, with the project's model/ and fp8/ code and torch's C ops in it."""
    plain, _ = run(tmp_path, "plain", ["train.steps=3", "precision=fp8"])
    lines, _ = run(tmp_path, "py", ["train.steps=3", "precision=fp8", "train.profile_python_step=2",
                                    "train.profile_step=3"])
    keys = ("loss", "grad_norm")
    assert [{k: r[k] for k in keys} for r in lines] == [{k: r[k] for k in keys} for r in plain]  # unchanged run
    folder = tmp_path / "py" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["step2.python.md", "step3.json", "step3.md"]
    md = (folder / "step2.python.md").read_text()
    assert md.startswith("### Host time of optimizer step 2 (cProfile)")
    table = md[md.index("| where |"):md.index("Top 30 functions by self time")].strip().splitlines()[2:]
    groups = {r.split(" | ")[0].lstrip("| "): float(r.split(" | ")[1]) for r in table}
    shares = [float(r.split(" | ")[2].rstrip(" |%")) for r in table]
    assert sum(shares) == pytest.approx(100, abs=0.1 * len(shares))  # rounded to 0.1 % each
    assert list(groups.values()) == sorted(groups.values(), reverse=True)
    for group in ("model/", "fp8/", "ling/", "torch (Python)", "C: torch ops", "deepspeed"):
        assert groups.get(group, 0) > 0, (group, groups)
    for title in ("Top 30 functions by self time", "Top 30 functions by cumulative time"):
        assert title in md


def test_host_group_names_where_a_function_lives():
    root = Path(__file__).resolve().parents[2]
    assert host_group(str(root / "fp8" / "linear.py"), "forward") == "fp8/"
    assert host_group(str(root / "model" / "moe.py"), "forward") == "model/"
    assert host_group("/usr/lib/python3/site-packages/torch/autograd/function.py", "apply") == "torch (Python)"
    assert host_group("/x/site-packages/deepspeed/runtime/zero/stage_1_and_2.py", "step") == "deepspeed"
    assert host_group("/x/site-packages/triton/runtime/jit.py", "run") == "triton"
    assert host_group("~", "<built-in method torch._C._nn.linear>") == "C: torch ops"
    assert host_group("~", "<method 'item' of 'torch._C.TensorBase' objects>") == "C: torch ops"
    assert host_group("~", "<built-in method builtins.len>") == "C: other"
    assert host_group("/usr/lib/python3.12/contextlib.py", "__enter__") == "other Python"


# ------------------------------------------------------------------ CUDA attribution, synthetic events
@dataclass
class Span:
    start: float
    end: float


@dataclass
class Kernel:
    name: str
    duration: float


@dataclass
class Event:
    """The FunctionEvent fields the attribution reads."""

    name: str
    start: float
    end: float
    thread: int = 1
    parent: Event | None = None
    sequence_nr: int = -1
    kernels: list = field(default_factory=list)
    device: str = "cpu"
    is_user_annotation: bool = False
    id: int = 0
    linked_correlation_id: int = 0  # a device event: the id of the op that launched it

    def __post_init__(self):
        self.time_range, self.cpu_parent, self.fwd_thread = Span(self.start, self.end), self.parent, 1
        self.device_type = torch.autograd.DeviceType.CUDA if self.device == "cuda" else torch.autograd.DeviceType.CPU
        self.self_cpu_time_total = self.end - self.start


def test_cuda_kernels_go_to_their_forward_part_grad_reduction_and_other():
    """Main thread 1: an index op in `dispatch` that created no node, then the op in `experts` that created
    node 7 (both record the number 7), `grad_reduce` around backward (the node of seq 7, whose own op records 7
    too), `optimizer`; autograd's thread 2: an AccumulateGrad node, a DeepSpeed hook op outside any node
    (inside the grad_reduce range in time) and one after it (other)."""
    dispatch = Event("dispatch", -5, -1)
    index = Event("aten::index", -4, -3, parent=dispatch, sequence_nr=7, kernels=[Kernel("index", 0.25)])
    experts = Event("experts", 0, 10)
    fwd = Event("aten::mm", 1, 2, parent=experts, sequence_nr=7)
    launch_fwd = Event("cudaLaunchKernel", 1, 2, parent=fwd, kernels=[Kernel("gemm_fwd", 5.0)])
    reduce = Event("grad_reduce", 20, 40)
    node = Event("autograd::engine::evaluate_function: MmBackward0", 21, 25, parent=reduce, sequence_nr=7)
    inner = Event("MmBackward0", 21, 25, parent=node, sequence_nr=7)
    bwd = Event("aten::mm", 21, 22, parent=inner, kernels=[Kernel("gemm_dgrad", 6.0), Kernel("gemm_wgrad", 4.0)],
                id=101)
    acc = Event("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 26, 27, thread=2)
    acc_op = Event("aten::add_", 26, 27, thread=2, parent=acc, kernels=[Kernel("add", 1.5)])
    hook = Event("aten::copy_", 28, 29, thread=2, kernels=[Kernel("copy_bucket", 2.0)], id=102)
    late = Event("aten::copy_", 41, 42, thread=2, kernels=[Kernel("copy_late", 0.5)])
    opt = Event("optimizer", 50, 60)
    step = Event("aten::_fused_adamw_", 51, 52, parent=opt, kernels=[Kernel("adam", 3.0)])
    # device intervals: [0,5] and [3,8] overlap (8 µs busy), [20,26] (6 µs, launched by the backward's mm),
    # [30,31] (by the hook), [35,36] (by no op the profile holds); the gaps before them 12, 4 and 4 µs
    gpu = [Event("k", s, e, device="cuda", linked_correlation_id=op)
           for s, e, op in ((0, 5, 0), (3, 8, 0), (20, 26, 101), (30, 31, 102), (35, 36, 999))]
    # a record_function range as the profiler projects it onto the GPU timeline: not device work
    gpu.append(Event("experts", 0, 40, device="cuda", is_user_annotation=True))
    events = [experts, fwd, launch_fwd, reduce, node, inner, bwd, acc, acc_op, hook, late, opt, step, *gpu,
              dispatch, index]

    parts = attribute(events, cuda=True)
    assert {p: dict(k) for p, k in parts.items()} == {
        "experts": {"gemm_fwd": 5.0, "gemm_dgrad": 6.0, "gemm_wgrad": 4.0},
        "dispatch": {"index": 0.25},
        GRAD_REDUCE: {"add": 1.5, "copy_bucket": 2.0},
        "other": {"copy_late": 0.5},
        "optimizer (DeepSpeed step)": {"adam": 3.0},
    }
    assert busy_us(events) == 16.0
    # each gap goes to the part of the op whose device work ends it (the backward mm's forward part, the hook's)
    assert idle_before_us(events) == {"experts": 12.0, GRAD_REDUCE: 4.0, "other": 4.0}
    # the gaps and the busy time split the device timeline's extent (first start to last end) between them
    assert sum(idle_before_us(events).values()) + busy_us(events) == 36.0
    summary = summarize(events, steps=2, cuda=True, wall_s=40e-6)
    assert summary.total_ms == pytest.approx(22.25 / 2 / 1e3) and summary.busy_ms == pytest.approx(8e-3)
    data = summary.to_dict()
    assert data["busy_over_wall"] == pytest.approx(16 / 40)
    assert data["idle_ms"] == pytest.approx(20 / 2 / 1e3)
    assert {g["part"]: g["idle_ms"] for g in data["parts"]}["experts"] == pytest.approx(12 / 2 / 1e3)
    assert {g["part"]: g["idle_ms"] for g in data["parts"]}["dispatch"] == 0.0
    assert [k["kernel"] for k in data["top_kernels"][:2]] == ["gemm_dgrad", "gemm_fwd"]
    assert "GPU busy 0.0 ms of 0.0 ms wall per step (40%" in summary.markdown("t")
    assert "| GPU idle before ms |" in summary.markdown("t")
    assert {len(row) for row in summary.part_rows()} == {len(summary.part_header())} == {6}  # bench_model's table too
    # host: each CPU op's self time (here its span) goes to the same part as its kernels; totals 12 µs / 2 steps
    assert {p: dict(k) for p, k in summary.host_parts.items()} == {
        "experts": {"aten::mm": 2.0, "cudaLaunchKernel": 1.0, "MmBackward0": 4.0}, "dispatch": {"aten::index": 1.0},
        GRAD_REDUCE: {"aten::add_": 1.0, "aten::copy_": 1.0}, "other": {"aten::copy_": 1.0},
        "optimizer (DeepSpeed step)": {"aten::_fused_adamw_": 1.0},
    }
    assert data["host_ms"] == pytest.approx(12 / 2 / 1e3)
    assert {g["part"]: g["host_ms"] for g in data["parts"]}["experts"] == pytest.approx(7 / 2 / 1e3)
    assert "host ms (ops' CPU self time)" in summary.markdown("t")
    # torch 2.11's events do not carry the link: the same pairing from the profiler's raw events (`device_links`)
    for i, d in enumerate(gpu):
        d.id, d.linked_correlation_id = 1000 + i, 0
    links = {1002: 101, 1003: 102, 1004: 999}
    assert idle_before_us(events, links=links) == {"experts": 12.0, GRAD_REDUCE: 4.0, "other": 4.0}
    assert summarize(events, steps=2, cuda=True, links=links).to_dict()["idle_ms"] == pytest.approx(20 / 2 / 1e3)
    assert idle_before_us(events) == {"other": 20.0}  # unpaired, every gap lands in "other"


class _RawEvent:
    """A Kineto event as `prof.profiler.kineto_results.events()` yields it (methods, not attributes)."""

    def __init__(self, device, correlation, linked):
        self._d, self._c, self._l = device, correlation, linked

    def device_type(self):
        return self._d

    def correlation_id(self):
        return self._c

    def linked_correlation_id(self):
        return self._l


def test_device_links_pair_device_events_with_their_ops_from_raw_events():
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    raw = [_RawEvent(cpu, 7, 0), _RawEvent(cuda, 40, 7), _RawEvent(cuda, 41, 7), _RawEvent(cpu, 40, 7),
           _RawEvent(cuda, 42, 0)]  # a runtime call (CPU, same correlation as its kernel); a kernel of no op
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: raw)))
    assert device_links(prof) == {40: 7, 41: 7}
    assert device_links(SimpleNamespace(profiler=None)) == {}

