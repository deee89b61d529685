"""Where a training step's time goes: torch.profiler events grouped by part of the model and of the step.

The parts come from named profiler ranges (`model.layers.scope`): the model's (`attention_core`, `experts`,
`lm_head_loss`, ...) and the trainer's (`optimizer` around DeepSpeed's `engine.step()`: unscale, gradient
clipping, the optimizer kernel, the copies back into the bf16 weights; `grad_reduce` around `engine.backward()`).
A kernel (on CUDA; on CPU an op's self time) goes to the part of the innermost range around the op that launched
it. Backward kernels run inside an autograd node (`autograd::engine::evaluate_function: XBackward0`) on
autograd's thread: they go to the part of the forward op that created the node (same thread and sequence
number; of the ops recording one number, the last). Gradient accumulation (`AccumulateGrad` nodes) and
DeepSpeed's gradient hooks (ZeRO's bucket copies and reductions, which autograd runs outside any node, on its
own thread on CUDA) go to `grad_reduce` when they run inside `engine.backward()` in time; the rest is "other".

`StepProfiler` is the trainer's hook (`train.profile_step`): step N runs under torch.profiler and rank 0 writes
`<run dir>/profile/step{N}.md` and `.json` (and the chrome trace with `train.profile_trace`). With
`train.profile_python_step` = M, step M runs under cProfile instead and rank 0 writes `step{M}.python.md`: the
host's time by where it is spent (the project's packages, torch's Python, DeepSpeed, Triton, C calls into torch
ops) and the top functions (`python_tables`), the view that explains a host-bound step.
"""

from __future__ import annotations

import contextlib
import cProfile
import json
import logging
import pstats
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ling.files import atomic_write

log = logging.getLogger(__name__)

OPTIMIZER_SCOPE, GRAD_REDUCE_SCOPE = "optimizer", "grad_reduce"  # the trainer's ranges
GRAD_REDUCE = "grad accumulation + reduction (DeepSpeed hooks)"
# profiler range → part of the table; the innermost range wins
PART_OF_SCOPE = {
    "attention_core": "attention (QK-norm, RoPE, SDPA/flex)",
    "attention_proj": "dense linears", "mlp": "dense linears", "mtp_proj": "dense linears",
    "experts": "experts", "dispatch": "dispatch", "router": "router", "shared_expert": "shared expert",
    "expert_parallel": "experts + expert-parallel all-to-all",
    "moe": "MoE, rest (router losses, reshapes)",
    "lm_head_loss": "LM head + loss",
    "embedding": "other",
    OPTIMIZER_SCOPE: "optimizer (DeepSpeed step)",
    GRAD_REDUCE_SCOPE: GRAD_REDUCE,
}
BACKWARD = "autograd::engine::evaluate_function"
ACCUMULATE_GRAD = "AccumulateGrad"
OTHER = "other"


def _scope_of(event) -> tuple[str | None, Any]:
    """(part, None) for the innermost named range around `event`, (None, backward node) if a backward node
    comes first, (None, None) for neither."""
    while event is not None:
        if event.name in PART_OF_SCOPE:
            return PART_OF_SCOPE[event.name], None
        if event.name.startswith(BACKWARD):
            return None, event
        event = event.cpu_parent
    return None, None


def _is_cpu_op(event) -> bool:
    return (event.device_type == torch.autograd.DeviceType.CPU and event.name not in PART_OF_SCOPE
            and not event.name.startswith(BACKWARD))


def attribute(events, cuda: bool) -> dict[str, dict[str, float]]:
    """Profiler events → {part: {kernel (CUDA) or op (CPU self time): µs}}. A backward kernel goes to the part
    of the forward op that created its autograd node (same thread and sequence number); AccumulateGrad nodes
    and the events outside any range that run on another thread while a `grad_reduce` range is open go to
    the gradient-reduction part."""
    return attribute_each(events, (cuda,))[0]


def _part_resolver(events) -> Callable[[Any], str | None]:
    """The part of each op of `events` (sorted by start): its innermost range's; a backward op's, the part of the
    forward op that created its autograd node (same thread and sequence number), AccumulateGrad's the gradient
    reduction's; an op outside any range that runs on another thread while a `grad_reduce` range is open, the
    gradient reduction's; None for an op outside every range otherwise (the caller's "other")."""
    forward_part, reduce_ranges = {}, []
    for e in events:
        if e.name == GRAD_REDUCE_SCOPE:
            reduce_ranges.append((e.time_range.start, e.time_range.end, e.thread))
        elif e.sequence_nr >= 0 and not e.name.startswith(BACKWARD):
            # every op records the number the *next* autograd node will get: the node's creator is the last
            # op that saw it (earlier ones, e.g. integer index ops in `dispatch`, created no node)
            part, node = _scope_of(e)
            if node is None:  # not an op run by backward itself
                forward_part[(e.thread, e.sequence_nr)] = part

    def in_reduce(e) -> bool:  # outside any range on its thread, inside engine.backward() in time
        return any(s <= e.time_range.start and e.time_range.end <= t and e.thread != th for s, t, th in reduce_ranges)

    def part_of(e) -> str | None:
        part, node = _scope_of(e)
        if node is not None:
            return (GRAD_REDUCE if node.name.endswith(ACCUMULATE_GRAD)
                    else forward_part.get((node.fwd_thread, node.sequence_nr)) or OTHER)
        if part is None and in_reduce(_root(e)):
            return GRAD_REDUCE
        return part

    return part_of


def _by_start(events) -> list:
    return sorted(events, key=lambda e: e.time_range.start)


def attribute_each(events, kinds: tuple[bool, ...], part_of: Callable[[Any], str | None] | None = None
                   ) -> list[dict[str, dict[str, float]]]:  # fmt: skip
    """`attribute(events, cuda)` for each `cuda` in `kinds`, in one pass over the events (each event's part is
    resolved once): e.g. (True, False) → [kernel time by part, the ops' host self time by part]. `part_of`: the
    `_part_resolver` of these events, when the caller has built it already (then `events` must be sorted by start)."""
    if part_of is None:
        events = _by_start(events)
        part_of = _part_resolver(events)

    def items(e, cuda: bool) -> list[tuple[str, float]]:
        if cuda:
            return [(k.name, k.duration) for k in e.kernels]
        return [(e.name, e.self_cpu_time_total)] if _is_cpu_op(e) else []

    results: list[dict[str, dict[str, float]]] = [defaultdict(lambda: defaultdict(float)) for _ in kinds]
    for e in events:
        found = [items(e, cuda) for cuda in kinds]
        if not any(found):
            continue
        part = part_of(e) or OTHER
        for parts, pairs in zip(results, found):
            for name, us in pairs:
                parts[part][name] += us
    return results


def _device_spans(events) -> list:
    """The device-side events (kernels, copies, memsets on any stream), by start. The profiler also projects every
    record_function range onto the GPU timeline (`gpu_user_annotation`, device type CUDA, `is_user_annotation`):
    those spans cover idle gaps and are left out (as torch's own device-time totals do)."""
    return sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                   and not getattr(e, "is_user_annotation", False)), key=lambda e: e.time_range.start)


def device_links(prof) -> dict[int, int]:
    """{device event id: id of the op that launched it} from a finished profiler's raw (Kineto) events, the pairing
    torch.profiler uses to list an op's `kernels`. torch 2.13's `FunctionEvent` keeps it (`linked_correlation_id`);
    2.11's drops it, so `idle_before_us` takes it from here. Empty when the profiler holds no raw events."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        return {}
    cpu = torch.autograd.DeviceType.CPU
    return {e.correlation_id(): e.linked_correlation_id() for e in results.events()
            if e.device_type() != cpu and e.linked_correlation_id() > 0}  # fmt: skip


def idle_before_us(events, part_of: Callable[[Any], str | None] | None = None,
                   links: dict[int, int] | None = None) -> dict[str, float]:  # fmt: skip
    """Where the GPU waits for the host: every gap in the union of the device intervals, µs, goes to the part of the
    op that launched the kernel (or copy) ending it — the work the GPU was waiting for. A device event names its
    op through `links` ({device event id: op id}, `device_links`), else through its own `linked_correlation_id`
    (torch 2.13's events carry it): the op's `id`, as torch.profiler pairs them to list an op's `kernels`. The
    time before the first device event and after the last is not a gap. Under the profiler the host runs slower
    than without it, so the gaps are larger than in an unprofiled step; their split by part says where the host
    falls behind. `part_of`: as in `attribute_each`."""
    if part_of is None:
        events = _by_start(events)
        part_of = _part_resolver(events)
    return _idle_by_part(_device_spans(events), events, part_of, links)


def _idle_by_part(spans: list, events, part_of: Callable[[Any], str | None],
                  links: dict[int, int] | None) -> dict[str, float]:  # fmt: skip
    """`idle_before_us` over the `_device_spans` of `events`."""
    launcher = {e.id: e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.kernels}
    if links is None:
        link = lambda d: getattr(d, "linked_correlation_id", 0)  # noqa: E731
    else:
        link = lambda d: links.get(d.id, 0)  # noqa: E731
    idle: dict[str, float] = defaultdict(float)
    end = None
    for d in spans:
        if end is not None and d.time_range.start > end:
            op_id = link(d)  # 0: linked to no op
            op = launcher.get(op_id) if op_id > 0 else None
            idle[(part_of(op) if op is not None else None) or OTHER] += d.time_range.start - end
        end = d.time_range.end if end is None else max(end, d.time_range.end)
    return dict(idle)


def _root(event):
    while event.cpu_parent is not None:
        event = event.cpu_parent
    return event


def busy_us(events) -> float:
    """Length of the union of all device-side intervals (`_device_spans`), µs."""
    return _union_us(_device_spans(events))


def _union_us(spans: list) -> float:
    """Length of the union of `spans` (device events sorted by start), µs."""
    total, end = 0.0, float("-inf")
    for d in spans:
        s, t = d.time_range.start, d.time_range.end
        if t > end:
            total += t - max(s, end)
            end = t
    return total


@dataclass
class ProfileSummary:
    """Time per part over `steps` profiled steps; `kind` says what is summed: GPU kernel time, or CPU self
    time of the ops without CUDA. `busy_ms` (CUDA only): the union of device intervals, per step."""

    parts: dict[str, dict[str, float]]  # µs over all profiled steps
    steps: int
    cuda: bool
    wall_ms: float | None = None  # per step
    busy_ms: float | None = None
    host_parts: dict[str, dict[str, float]] | None = None  # CUDA only: the ops' CPU self time per part, µs
    idle_parts: dict[str, float] | None = None  # CUDA only: GPU idle gaps by the part they wait for, µs

    @property
    def idle_ms(self) -> float | None:
        """The GPU's idle gaps inside the step (`idle_before_us`), per step."""
        return None if self.idle_parts is None else sum(self.idle_parts.values()) / self.steps / 1e3

    @property
    def host_ms(self) -> float | None:
        if self.host_parts is None:
            return None
        return sum(sum(k.values()) for k in self.host_parts.values()) / self.steps / 1e3

    @property
    def unit(self) -> str:
        return "GPU ms" if self.cuda else "CPU self ms"

    @property
    def total_ms(self) -> float:
        return sum(sum(k.values()) for k in self.parts.values()) / self.steps / 1e3

    def grouped(self, top: int = 3) -> list[dict[str, Any]]:
        """Parts, largest first: {part, ms (per step), share, top: [{kernel, ms}]}."""
        total = self.total_ms or 1.0
        out = []
        host = self.host_parts
        idle = self.idle_parts
        names = set(self.parts) | set(host or ()) | set(idle or ())
        for part in sorted(names, key=lambda p: (-sum(self.parts.get(p, {}).values()), p)):
            kernels = self.parts.get(part, {})
            ms = sum(kernels.values()) / self.steps / 1e3
            best = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
            row = {"part": part, "ms": ms, "share": ms / total,
                   "top": [{"kernel": n, "ms": us / self.steps / 1e3} for n, us in best]}
            if host is not None:
                row["host_ms"] = sum(host.get(part, {}).values()) / self.steps / 1e3
            if idle is not None:
                row["idle_ms"] = idle.get(part, 0.0) / self.steps / 1e3
            out.append(row)
        return out

    def top_kernels(self, n: int = 15) -> list[dict[str, Any]]:
        """Kernels (ops on CPU) by time over all parts: {kernel, ms (per step), share, parts: {part: ms}, largest
        first}."""
        merged: dict[str, dict[str, float]] = defaultdict(dict)
        for part, kernels in self.parts.items():
            for name, us in kernels.items():
                merged[name][part] = us
        total = self.total_ms or 1.0
        ranked = sorted(merged.items(), key=lambda kv: -sum(kv[1].values()))[:n]
        return [{"kernel": name, "ms": sum(by.values()) / self.steps / 1e3,
                 "share": sum(by.values()) / self.steps / 1e3 / total,
                 "parts": {p: us / self.steps / 1e3 for p, us in sorted(by.items(), key=lambda kv: -kv[1])}}
                for name, by in ranked]

    def to_dict(self, top_parts: int = 3, top_overall: int = 15) -> dict[str, Any]:
        return {"unit": self.unit, "steps": self.steps, "total_ms": self.total_ms, "wall_ms": self.wall_ms,
                "busy_ms": self.busy_ms, "host_ms": self.host_ms, "idle_ms": self.idle_ms,
                "busy_over_wall": self.busy_ms / self.wall_ms if self.busy_ms is not None and self.wall_ms else None,
                "parts": self.grouped(top_parts), "top_kernels": self.top_kernels(top_overall)}

    def part_header(self) -> list[str]:
        """The grouped table's header, matching `part_rows`: part, time, share, (on CUDA) the ops' host time and
        the GPU's idle gaps before the part's work, top kernels."""
        unit = self.unit
        host = ["host ms (ops' CPU self time)"] if self.host_parts is not None else []
        idle = ["GPU idle before ms"] if self.idle_parts is not None else []
        return ["part", unit, "share", *host, *idle, f"top kernels ({unit})"]

    def part_rows(self, top: int = 3) -> list[list[str]]:
        """The grouped table's rows (part, ms, share, top kernels) and a total row."""
        host, idle = self.host_parts is not None, self.idle_parts is not None
        rows = [[g["part"], f"{g['ms']:.1f}", f"{g['share']:.0%}", *([f"{g['host_ms']:.1f}"] if host else []),
                 *([f"{g['idle_ms']:.1f}"] if idle else []),
                 "; ".join(f"{_short(k['kernel'])} {k['ms']:.1f}" for k in g["top"])] for g in self.grouped(top)]
        return rows + [["**total**", f"{self.total_ms:.1f}", "100%", *([f"{self.host_ms:.1f}"] if host else []),
                        *([f"{self.idle_ms:.1f}"] if idle else []), ""]]

    def markdown(self, title: str, top_overall: int = 15) -> str:
        """The grouped table, GPU busy vs wall, the top kernels overall."""
        unit = self.unit
        lines = [f"### {title} ({unit} per step)", "", markdown(self.part_header(), self.part_rows()), ""]
        if self.busy_ms is not None and self.wall_ms:
            lines += [f"GPU busy {self.busy_ms:.1f} ms of {self.wall_ms:.1f} ms wall per step "
                      f"({self.busy_ms / self.wall_ms:.0%}; the union of all device intervals; the wall time "
                      "includes the profiler's own overhead)", ""]
        if self.idle_ms is not None:
            lines += [f"GPU idle before: the gaps between device work ({self.idle_ms:.1f} ms in all), each counted to "
                      "the part whose kernel ends it (what the GPU waited for); the profiler slows the host, so the "
                      "gaps are larger than in an unprofiled step", ""]
        if self.host_ms is not None and self.wall_ms:
            lines += [f"Host: the ops' CPU self time is {self.host_ms:.1f} ms of the {self.wall_ms:.1f} ms wall; the "
                      "rest is Python and framework time between ops, waits, and the profiler's overhead", ""]
        if not self.cuda and self.wall_ms:
            lines += [f"wall {self.wall_ms:.1f} ms per step (no GPU: CPU self time of the ops above)", ""]
        rows = [[_short(k["kernel"], 80), f"{k['ms']:.2f}", f"{k['share']:.1%}", _main_parts(k["ms"], k["parts"])]
                for k in self.top_kernels(top_overall)]
        lines += [f"Top {len(rows)} kernels overall:", "", markdown(["kernel", unit, "share", "in parts"], rows)]
        return "\n".join(lines) + "\n"


def summarize(events, steps: int, cuda: bool, wall_s: float | None = None,
              links: dict[int, int] | None = None) -> ProfileSummary:  # fmt: skip
    """Profiler events of `steps` steps → ProfileSummary (wall time `wall_s` over all of them, if measured; `links`:
    the device events' launching ops, `device_links` of the profiler, for the idle gaps)."""
    events = _by_start(events)
    part_of = _part_resolver(events)  # once, for the kernels, the host time and the idle gaps
    parts = attribute_each(events, (True, False) if cuda else (False,), part_of)
    spans = _device_spans(events) if cuda else []  # once, for the busy time and the idle gaps
    return ProfileSummary(parts[0], steps, cuda,
                          wall_ms=wall_s / steps * 1e3 if wall_s is not None else None,
                          busy_ms=_union_us(spans) / steps / 1e3 if cuda else None,
                          host_parts=parts[1] if cuda else None,
                          idle_parts=_idle_by_part(spans, events, part_of, links) if cuda else None)


@contextlib.contextmanager
def profiled(device: torch.device) -> Iterator[dict[str, Any]]:
    """Run the block under torch.profiler (CPU, + CUDA on a CUDA device), synchronised at both ends; the
    yielded dict gets `profile` (the profiler) and `wall_s` on exit."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    result: dict[str, Any] = {}
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        sync()
        t0 = time.perf_counter()
        yield result
        sync()
        result["wall_s"] = time.perf_counter() - t0
    result["profile"] = prof


class StepProfiler:
    """`with profiler.step(n):` around optimizer step n runs it under torch.profiler when n is `train.profile_step`
    (all ranks, so collectives are timed as usual); rank 0 writes `out_dir/step{n}.md` and `.json` (and
    `step{n}.trace.json` with `train.profile_trace`). When n is `train.profile_python_step` the step runs under
    cProfile and rank 0 writes `out_dir/step{n}.python.md` (`python_tables`). A no-op for every other step."""

    def __init__(self, step: int | None, out_dir: Path, device: torch.device, write: bool, trace: bool = False,
                 python_step: int | None = None):
        self.at, self.out_dir, self.device, self.write, self.trace = step, out_dir, device, write, trace
        self.python_at = python_step

    @classmethod
    def from_config(cls, train_cfg, total_steps: int, out_dir: Path, device: torch.device, write: bool):
        """From `train.profile_step` and `train.profile_python_step` (each null, or an int N >= 2: step 1 carries
        one-time costs such as compilation and lazy optimizer state; not the same step) and `train.profile_trace`."""
        steps = {}
        for key in ("profile_step", "profile_python_step"):
            step = train_cfg.get(key)
            if step is not None and (isinstance(step, bool) or not isinstance(step, int)
                                     or not 2 <= step <= total_steps):
                raise ValueError(f"train.{key}={step!r}: want null or an integer step in 2..train.steps "
                                 f"({total_steps}); step 1 carries one-time costs (compilation, optimizer state)")
            steps[key] = step
        if steps["profile_step"] is not None and steps["profile_step"] == steps["profile_python_step"]:
            raise ValueError(f"train.profile_step and train.profile_python_step are both {steps['profile_step']}: "
                             "one profiler per step (each distorts the other's timing)")
        return cls(steps["profile_step"], out_dir, device, write, bool(train_cfg.get("profile_trace", False)),
                   steps["profile_python_step"])

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        if n == self.python_at:
            with self._python(n):
                yield
            return
        if n != self.at:
            yield
            return
        with profiled(self.device) as result:
            yield
        if self.write:
            self._write(n, result["profile"], result["wall_s"])

    @contextlib.contextmanager
    def _python(self, n: int) -> Iterator[None]:
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else (lambda: None)
        prof = cProfile.Profile()
        sync()
        t0 = time.perf_counter()
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
        sync()
        wall_s = time.perf_counter() - t0
        if self.write:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            md = self.out_dir / f"step{n}.python.md"
            text = python_tables(pstats.Stats(prof), wall_s, f"Host time of optimizer step {n} (cProfile)")
            atomic_write(md, lambda tmp: tmp.write_text(text))
            log.info("python profile of step %d: %s (%.2f s wall)", n, md, wall_s)

    def _write(self, n: int, prof, wall_s: float) -> None:
        summary = summarize(prof.events(), 1, self.device.type == "cuda", wall_s, device_links(prof))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        md, js = self.out_dir / f"step{n}.md", self.out_dir / f"step{n}.json"
        text = summary.markdown(f"Where optimizer step {n} spends its time")
        atomic_write(md, lambda tmp: tmp.write_text(text))
        data = json.dumps({"step": n, **summary.to_dict()}, indent=1)
        atomic_write(js, lambda tmp: tmp.write_text(data))
        if self.trace:
            atomic_write(self.out_dir / f"step{n}.trace.json", lambda tmp: prof.export_chrome_trace(str(tmp)))
        log.info("profile of step %d: %s (%.1f %s in all)", n, md, summary.total_ms, summary.unit)


ROOT = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = ("model", "fp8", "ling", "data")


def host_group(filename: str, name: str) -> str:
    """Where a profiled function's own time is spent: 'model/', 'fp8/', … (this project), 'torch (Python)',
    'deepspeed', 'triton', 'C: torch ops' (calls into torch's C++: an op's dispatch and, on CUDA, its kernel
    launch), 'C: other', or 'other Python' (the standard library, hydra, …)."""
    if filename == "~":  # a built-in: cProfile names it '<built-in method …>' / "<method 'x' of 'torch…' objects>"
        return "C: torch ops" if "torch" in name else "C: other"
    path = Path(filename)
    try:
        rel = path.resolve().relative_to(ROOT)
        if rel.parts and rel.parts[0] in PROJECT_PACKAGES:
            return rel.parts[0] + "/"
    except ValueError:
        pass
    parts = path.parts
    for lib in ("deepspeed", "triton", "torch"):
        if lib in parts:
            return "torch (Python)" if lib == "torch" else lib
    return "other Python"


def python_tables(stats: pstats.Stats, wall_s: float, title: str, top: int = 30) -> str:
    """cProfile statistics of one step → Markdown: self time by `host_group`, then the top functions by self
    time and by cumulative time. cProfile slows Python-heavy code (about 2x), so read shares, not absolutes."""
    rows = []  # (group, label, calls, self s, cumulative s)
    for (filename, line, name), (_, ncalls, self_s, cum_s, _) in stats.stats.items():  # type: ignore[attr-defined]
        group = host_group(filename, name)
        where = name if filename == "~" else f"{Path(filename).name}:{line} {name}"
        rows.append((group, where, ncalls, self_s, cum_s))
    total = sum(r[3] for r in rows)
    groups: dict[str, float] = defaultdict(float)
    for r in rows:
        groups[r[0]] += r[3]
    out = [f"### {title}", "",
           f"Wall time {wall_s * 1e3:.0f} ms under cProfile; {total * 1e3:.0f} ms of it in profiled functions' own "
           "time. cProfile slows Python-heavy code (about 2x): read the shares.", "",
           markdown(["where", "self ms", "share"],
                    [[g, f"{t * 1e3:.1f}", f"{t / total:.1%}" if total else "-"]
                     for g, t in sorted(groups.items(), key=lambda kv: -kv[1])]),
           "", f"Top {top} functions by self time:", "",
           markdown(["function", "where", "calls", "self ms", "µs per call", "cumulative ms"],
                    [[_short(w, 70), g, str(n), f"{s * 1e3:.1f}", f"{s / max(n, 1) * 1e6:.1f}", f"{c * 1e3:.1f}"]
                     for g, w, n, s, c in sorted(rows, key=lambda r: -r[3])[:top]]),
           "", f"Top {top} functions by cumulative time:", "",
           markdown(["function", "where", "calls", "cumulative ms", "self ms"],
                    [[_short(w, 70), g, str(n), f"{c * 1e3:.1f}", f"{s * 1e3:.1f}"]
                     for g, w, n, s, c in sorted(rows, key=lambda r: -r[4])[:top]])]
    return "\n".join(out) + "\n"


def _main_parts(ms: float, parts: dict[str, float], n: int = 2) -> str:
    """'experts 90%, router 8%, …' (the n largest parts of a kernel's time)."""
    shown = [f"{p} {t / ms:.0%}" for p, t in list(parts.items())[:n]] if ms else list(parts)[:n]
    return ", ".join(shown + (["…"] if len(parts) > n else []))


def _short(name: str, width: int = 48) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def markdown(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
