"""Training throughput and memory, BF16 vs FP8, through train.py: the headline table.

    python bench/bench_train.py [--model ling_mini_2_0_e64] [--steps 12] [--warmup 4] [--seq-len 4096]
        [--micro 1] [--grad-accum 8] [--recompute none] [--variants bf16,fp8,bf16_nomtp,fp8_nomtp,bf16+full@4]
        [--profile fp8] [--profile-python fp8] [--extra 'key=value ...'] [--device cuda] [--max-micro 64]
        [--max-search bisect] [--deepspeed zero1]

A variant is NAME[_nomtp][+RECOMPUTE][@M|@max]: a name from VARIANTS, optionally `_nomtp`
(`model.num_mtp_layers=0`), `+none` / `+full` / `+selective` (`model.recompute`, default `--recompute`) and `@M`
(that row runs at `train.micro_batch_size=M` instead of `--micro`; grad_accum stays `--grad-accum`, so the tokens
per optimizer step grow with M), or `@max` (the largest micro-batch that fits: doubled from `--micro` in 2-step
trials until one runs out of memory or passes `--max-micro`, then bisected between the last that fitted and the
first that did not (`--max-search double` skips that), then measured; the trials are listed under the table). Each is a
fresh `python train.py` process (so peak memory is its own) on synthetic data, under `deepspeed=--deepspeed`
(default zero1, the GPU experiments'; the `*_zero2` rows and an `--extra` naming the group override it); the table
reports medians over the steps after the first `--warmup` (tokens/s, model TFLOPS and MFU per GPU) and the slowest
and fastest of those steps' tokens/s (the row's spread: a host stall shows there), the GPU's median SM clock and the
share of clock samples held down by the power cap (`logging.gpu_clock_interval_s`, NVML; "n/a" without it: a
throttled row shows there), the peak memory over all steps, the optimizer state (moments + fp32 master weights,
`optim_state_gib`) and the speed and memory against the `bf16` row of the same micro-batch and MTP setting. A
variant that runs out of memory is an "OOM" row. `--profile V1,V2` runs those variants' last step under
torch.profiler (`train.profile_step`, left out of the medians) and prints the grouped tables after the main one,
each followed (on a GPU) by how much of an unprofiled step the GPU works (its busy time against the timed steps'
median); `--profile-python V` runs one step of those variants under cProfile (`train.profile_python_step`, the step
before the torch-profiled one when both are asked) and prints the host-time tables. Not imported by the library
(bench/bench_scaling.py reuses `summarize_run`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ling.analysis.profiling import markdown  # noqa: E402
from model.graphs import ALLOCATOR_ENV  # noqa: E402

VARIANTS = {
    "bf16": ["precision=bf16", "optim=adamw"],
    "fp8": ["precision=fp8", "optim=fp8_adamw"],
    "fp8_bf16wgrad": ["precision=fp8", "optim=fp8_adamw", "fp8.expert_wgrad=bf16"],  # experts' dW from bf16 operands
    # each layer's forward and backward replayed from CUDA graphs (model.cuda_graphs): the host-bound steps. Step 1
    # runs eagerly (the FP8 monitor samples it), step 2 captures: time these rows with --warmup 2 (with --warmup 1
    # the capture step is among the medians' steps and the median leans slow)
    "fp8_graphs": ["precision=fp8", "optim=fp8_adamw", "model.cuda_graphs=true"],
    "bf16_graphs": ["precision=bf16", "optim=adamw", "model.cuda_graphs=true"],
    "fp8_bf16wgrad_graphs": ["precision=fp8", "optim=fp8_adamw", "fp8.expert_wgrad=bf16", "model.cuda_graphs=true"],
    # the warp-specialised Gluon GEMM for the dense forward/dgrad (fp8.gemm_kernel=gluon_ws; Triton off sm_90 GPUs)
    "fp8_ws": ["precision=fp8", "optim=fp8_adamw", "fp8.gemm_kernel=gluon_ws"],
    "fp8_ws_graphs": ["precision=fp8", "optim=fp8_adamw", "fp8.gemm_kernel=gluon_ws", "model.cuda_graphs=true"],
    "fp8_linear_only": ["precision=fp8", "optim=adamw"],
    "bf16_fp8_adam": ["precision=bf16", "optim=fp8_adamw"],
    # ZeRO-2 (fp32 accumulation into its gradient partitions) instead of --deepspeed's ZeRO-1: the grad path
    "bf16_zero2": ["precision=bf16", "optim=adamw", "deepspeed=zero2"],
    "fp8_zero2": ["precision=fp8", "optim=fp8_adamw", "deepspeed=zero2"],
    "fp8_bf16wgrad_zero2": ["precision=fp8", "optim=fp8_adamw", "fp8.expert_wgrad=bf16", "deepspeed=zero2"],
}
DEEPSPEED = "zero1"  # the GPU experiments' ZeRO stage (conf/exp/*: fp32 sums in DeepSpeed's BF16_Optimizer)
NO_MTP = "_nomtp"
RECOMPUTE = ("none", "full", "selective")  # model.recompute
OOM = re.compile(r"OutOfMemoryError|out of memory", re.IGNORECASE)
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # a child is its own 1-rank run


MAX = "max"  # NAME@max: the largest micro-batch that fits (found by doubling)


def parse_variant(spec: str, default_micro: int, default_recompute: str = "none") -> tuple[str, bool, int | None, str]:
    """'fp8_nomtp+full@4' → ('fp8', no MTP, micro-batch 4, recompute 'full'); 'fp8@max' → ('fp8', MTP, None: to
    be searched, `default_recompute`)."""
    head, at, micro = spec.partition("@")
    name, plus, recompute = head.partition("+")
    base = name.removesuffix(NO_MTP)
    recompute = recompute if plus else default_recompute
    if (base not in VARIANTS or recompute not in RECOMPUTE
            or (at and micro != MAX and not (micro.isdigit() and int(micro) > 0))):
        raise SystemExit(f"--variants: {spec!r} is not NAME[{NO_MTP}][+RECOMPUTE][@MICRO|@{MAX}] with NAME in "
                         f"{', '.join(VARIANTS)}, RECOMPUTE in {', '.join(RECOMPUTE)} and MICRO a positive integer")
    return base, name != base, None if micro == MAX else int(micro) if micro else default_micro, recompute


def family(spec: str) -> str:
    """'fp8_nomtp+full@4' → 'fp8_nomtp': the row's precision and MTP setting, whatever its recompute and micro."""
    return spec.partition("@")[0].partition("+")[0]


def largest_micro(spec: str, args, run=None) -> tuple[int | None, list[str]]:
    """For 'NAME[_nomtp]@max': double the micro-batch from --micro (short trial runs of 2 steps: the optimizer
    state and the activations are allocated by then) until one runs out of memory or --max-micro is passed, then
    (`--max-search bisect`, the default) bisect between the largest that fitted and the first that did not →
    (the largest that fitted or None, the trials' log lines). `run` (default run_variant) is for tests."""
    run = run or run_variant
    name = spec.partition("@")[0]  # NAME[_nomtp][+RECOMPUTE]
    trial = argparse.Namespace(**{**vars(args), "steps": 2, "warmup": 0})
    log: list[str] = []

    def fits_at(micro: int) -> bool:
        result = run(f"{name}@{micro}", trial)
        log.append(f"{name}@{micro}: {result.get('error', 'fits')}")
        if "error" in result and result["error"] != "OOM":
            raise SystemExit(f"{spec}: the trial at micro-batch {micro} failed: {result['error']}")
        return "error" not in result

    fits, micro = None, args.micro
    while micro <= args.max_micro:
        if not fits_at(micro):
            break
        fits, micro = micro, micro * 2
    if fits is not None and args.max_search == "bisect":
        too_big = min(micro, args.max_micro + 1)  # the first that ran out of memory, or past the cap
        while too_big - fits > 1:
            middle = (fits + too_big) // 2
            fits, too_big = (middle, too_big) if fits_at(middle) else (fits, middle)
    return fits, log


def variant_overrides(spec: str, args) -> tuple[int, list[str]]:
    """(micro-batch, train.py overrides) of one variant."""
    base, no_mtp, micro, recompute = parse_variant(spec, args.micro, args.recompute)
    rows = VARIANTS[base]
    named = any(o.startswith("deepspeed=") for o in [*rows, *shlex.split(args.extra)])  # Hydra takes one per group
    return micro, [*([] if named else [f"deepspeed={args.deepspeed}"]), *rows, f"train.micro_batch_size={micro}",
                   f"model.recompute={recompute}", *(["model.num_mtp_layers=0"] if no_mtp else [])]


def _die_with_parent() -> None:
    """In the child: SIGKILL when the bench process dies (e.g. killed by `timeout`), so that no orphaned
    train.py keeps the GPU's memory for the next row (Linux prctl PR_SET_PDEATHSIG; a no-op elsewhere). Not
    SIGTERM: train.py answers that by finishing its step and writing a checkpoint, which on e64 held 134 GiB of
    the GPU while the next bench's first row started (and ran out of memory)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_variant(spec: str, args, profile_step: int | None = None, python_step: int | None = None) -> dict:
    micro, overrides = variant_overrides(spec, args)
    out_dir = Path(tempfile.mkdtemp(prefix=f"bench_{spec.replace('@', '_at')}_"))
    profile = [f"train.profile_step={profile_step}"] if profile_step else []
    profile += [f"train.profile_python_step={python_step}"] if python_step else []
    cmd = [sys.executable, "train.py", f"model={args.model}", "data=synthetic", f"data.vocab_size={args.vocab}",
           f"train.steps={args.steps}", f"train.seq_len={args.seq_len}", f"train.grad_accum={args.grad_accum}",
           f"train.device={args.device}", "train.save_final=false", "train.memory_check=false",  # the real peak
           "logging.wandb.mode=disabled", "logging.progress_bar=false", f"hydra.run.dir={out_dir}",
           "optim.warmup_steps=2", *overrides, *profile, *shlex.split(args.extra)]
    print("$", " ".join(cmd), flush=True)
    env = {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, preexec_fn=_die_with_parent)
    row = {"variant": spec, "micro": micro, "recompute": parse_variant(spec, micro, args.recompute)[3]}
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-6000:], flush=True)
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"
        return {**row, "error": "OOM" if OOM.search(proc.stderr) else f"failed: {last[:80]}"}
    row.update(summarize_run(out_dir, args.warmup, skip_steps=tuple(s for s in (profile_step, python_step) if s)))
    if profile_step:
        md = out_dir / "profile" / f"step{profile_step}.md"
        row["profile"] = (md, md.read_text())
        row["profile_busy_ms"] = json.loads(md.with_suffix(".json").read_text()).get("busy_ms")
    if python_step:
        md = out_dir / "profile" / f"step{python_step}.python.md"
        row["python_profile"] = (md, md.read_text())
    return row


def summarize_run(run_dir: Path, warmup: int, skip_steps: tuple[int, ...] = ()) -> dict:
    """A train.py run's metrics.jsonl → medians over the steps after `warmup` but `skip_steps` (tokens/s global,
    TFLOPS and MFU per GPU) and the slowest and fastest of those steps' tokens/s (the row's spread), the peak memory
    over all steps, the optimizer state (logged once), the first and last loss; on a GPU whose clocks the trainer
    sampled (`logging.gpu_clock_interval_s`), the median of the steps' SM clocks and the mean of their power-capped
    shares (else None); on CUDA the caching allocator's release-and-retry stalls over the timed steps (else None)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows[warmup:] if r["step"] not in skip_steps] or rows
    med = lambda key: statistics.median(r[key] for r in timed if r.get(key) is not None)  # noqa: E731
    speeds = [r["tokens_per_s"] for r in timed if r.get("tokens_per_s") is not None]
    step_s = [r["step_time_s"] for r in timed if r.get("step_time_s") is not None]
    clocks = [r["sm_clock_mhz"] for r in timed if r.get("sm_clock_mhz") is not None]
    capped = [r["power_capped_share"] for r in timed if r.get("power_capped_share") is not None]
    retries = [r["alloc_retries"] for r in timed if r.get("alloc_retries") is not None]
    return {"tokens_per_s": statistics.median(speeds), "tokens_per_s_range": (min(speeds), max(speeds)),
            "sm_clock_mhz": statistics.median(clocks) if clocks else None,
            "power_capped_share": statistics.fmean(capped) if capped else None,
            "alloc_retries": sum(retries) if retries else None,
            "step_ms": statistics.median(step_s) * 1e3 if step_s else None,
            "tflops": med("tflops_per_gpu"),
            "mfu": med("mfu") if timed[0].get("mfu") is not None else float("nan"),
            "peak_mem_gib": max(r["peak_mem_gib"] for r in rows),
            "optim_state_gib": next((r["optim_state_gib"] for r in rows if "optim_state_gib" in r), float("nan")),
            "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"]}


HEADER = ["variant", "micro-batch", "recompute", "tokens/s", "vs bf16", "model TFLOPS/GPU", "MFU", "peak memory GiB",
          "vs bf16", "optimizer state GiB", "loss first→last", "tokens/s, slowest–fastest timed step",
          "SM clock MHz", "power-capped", "allocator retries"]


def table_rows(results: list[dict]) -> list[list[str]]:
    """The headline table: one row per variant; speed and memory against the bf16 row with the same
    micro-batch, MTP setting and recompute mode (blank without one)."""

    def baseline(r: dict) -> dict | None:
        name = "bf16" + (NO_MTP if family(r["variant"]).endswith(NO_MTP) else "")
        return next((b for b in results if "error" not in b and b["micro"] == r["micro"]
                     and family(b["variant"]) == name and b.get("recompute") == r.get("recompute")), None)

    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["variant"], str(r["micro"]), r.get("recompute", ""), r["error"],
                         *[""] * (len(HEADER) - 4)])
            continue
        base = baseline(r)
        speed, mem = (f"{r[k] / base[k]:.2f}x" if base else "" for k in ("tokens_per_s", "peak_mem_gib"))
        mfu = "n/a" if math.isnan(r["mfu"]) else f"{r['mfu']:.1%}"
        spread = "–".join(f"{v:,.0f}" for v in r["tokens_per_s_range"]) if "tokens_per_s_range" in r else ""
        clock, capped, retries = r.get("sm_clock_mhz"), r.get("power_capped_share"), r.get("alloc_retries")
        rows.append([r["variant"], str(r["micro"]), r.get("recompute", ""), f"{r['tokens_per_s']:,.0f}", speed,
                     f"{r['tflops']:.0f}", mfu, f"{r['peak_mem_gib']:.1f}", mem,
                     f"{r['optim_state_gib']:.2f}", f"{r['loss_first']:.3f}→{r['loss_last']:.3f}", spread,
                     "n/a" if clock is None else f"{clock:,.0f}", "n/a" if capped is None else f"{capped:.0%}",
                     "n/a" if retries is None else str(retries)])
    return rows


def host_stall_line(row: dict) -> str | None:
    """How much of an unprofiled step the GPU works: the profiled step's GPU busy time (the union of its device
    intervals) over the timed steps' median step time. The profiled step's own wall time includes the profiler's
    overhead, so it overstates the host's share; the unprofiled steps do not. None without a GPU profile."""
    busy, step = row.get("profile_busy_ms"), row.get("step_ms")
    if busy is None or not step:
        return None
    return (f"GPU busy {busy:,.1f} ms (the profiled step) against the unprofiled timed steps' median of "
            f"{step:,.1f} ms: the GPU works {busy / step:.0%} of a step; the other {max(step - busy, 0.0):,.1f} ms "
            "it waits for the host")


def largest_vs_largest(results: list[dict]) -> list[str]:
    """For each NAME[_nomtp] beside a bf16[_nomtp] row: its fastest row against BF16's fastest. A family with @max
    rows is represented by its fastest @max row (over the recompute modes searched: each at its own largest
    micro-batch, the issue's "FP8 at its largest vs BF16 at its largest"); a family without by its fastest row of
    those run (explicit micro-batches, e.g. the largest known to fit; the line says they were not searched)."""
    best: dict[str, dict] = {}
    for r in results:
        if "error" in r:
            continue
        name, have = family(r["variant"]), best.get(family(r["variant"]))
        searched = "largest_of" in r
        if have is None or (searched, r["tokens_per_s"]) > ("largest_of" in have, have["tokens_per_s"]):
            best[name] = r
    lines = []
    for name, r in best.items():
        base = best.get("bf16" + (NO_MTP if name.endswith(NO_MTP) else ""))
        if base is None or base is r:
            continue
        ratios = (f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x tokens/s, "
                  f"{r['peak_mem_gib'] / base['peak_mem_gib']:.2f}x peak memory")
        if "largest_of" in r and "largest_of" in base:
            lines.append(f"{name} at its largest micro-batch ({r['variant']}) vs {family(base['variant'])} "
                         f"at its largest ({base['variant']}): {ratios}")
        else:
            how = ("only one of them searched with @max" if "largest_of" in r or "largest_of" in base
                   else "micro-batches as given, not searched with @max")
            lines.append(f"{name}'s fastest row ({r['variant']}) vs {family(base['variant'])}'s fastest "
                         f"({base['variant']}): {ratios} ({how})")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="ling_mini_2_0_e64")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro", type=int, default=1, help="micro-batch of the variants without @M")
    ap.add_argument("--grad-accum", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=157184)
    ap.add_argument("--variants", default="bf16,fp8")
    ap.add_argument("--profile", default=None, metavar="VARIANTS", help="some of --variants (comma-separated), "
                    "each profiled once (torch.profiler: GPU time by part)")
    ap.add_argument("--profile-python", default=None, metavar="VARIANTS",
                    help="some of --variants, each with one step under cProfile (host time by package and function)")
    ap.add_argument("--recompute", default="none", choices=RECOMPUTE,
                    help="model.recompute of the variants without +RECOMPUTE")
    ap.add_argument("--extra", default="", help="more train.py overrides for every row")
    ap.add_argument("--deepspeed", default=DEEPSPEED, help="the rows' deepspeed config group (a row or --extra that "
                    "names one wins), default the GPU experiments' zero1")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-micro", type=int, default=64, help="upper bound of the NAME@max search")
    ap.add_argument("--max-search", default="bisect", choices=("bisect", "double"),
                    help="NAME@max: bisect after the doubling (the largest that fits) or stop at the last doubling")
    args = ap.parse_args(argv)
    specs = args.variants.split(",")
    for spec in specs:
        parse_variant(spec, args.micro, args.recompute)
    profiled = set(args.profile.split(",")) if args.profile else set()
    python_profiled = set(args.profile_python.split(",")) if args.profile_python else set()
    for flag, value, chosen in (("--profile", args.profile, profiled),
                                ("--profile-python", args.profile_python, python_profiled)):
        if not chosen <= set(specs):
            raise SystemExit(f"{flag} {value}: not among --variants ({args.variants})")
    # the last step: the profiler's after-effects (CUPTI still attached, freed buffers) slow the steps after it
    # (measured on e64 fp8, README), so the timed steps all come before it; cProfile takes the step before it when
    # both profile one variant
    profile_step = args.steps
    both = bool(profiled & python_profiled)
    need = args.warmup + 2 + both
    if (profiled or python_profiled) and args.steps < max(need, 2):
        raise SystemExit(f"--profile/--profile-python need --steps >= {need} (the last step{'s' if both else ''} "
                         "profiled and left out of the medians, at least one timed step after --warmup)")
    results, searched = [], []
    for s in specs:
        if parse_variant(s, args.micro, args.recompute)[2] is None:  # NAME@max: search, then measure the largest
            fits, log = largest_micro(s, args)
            searched += log
            if fits is None:
                results.append({"variant": s, "micro": args.micro, "error": "OOM",
                                "recompute": parse_variant(s, args.micro, args.recompute)[3]})
                continue
            results.append({**run_variant(f"{s.partition('@')[0]}@{fits}", args), "largest_of": s})
            continue
        results.append(run_variant(s, args, profile_step if s in profiled else None,
                                   (args.steps - 1 if s in profiled else args.steps) if s in python_profiled else None))

    print(f"\n### {args.model}, seq {args.seq_len} x micro-batch (per row) x grad_accum {args.grad_accum}, "
          f"{args.steps} steps (medians after {args.warmup}; tokens per step grow with the micro-batch)\n")
    allocator = [f"{name}={os.environ[name]}" for name in ALLOCATOR_ENV if os.environ.get(name)]
    if allocator:  # every row's process inherits it: what fits (and how fast) can depend on it
        print(f"Every row ran with {', '.join(allocator)}.\n")
    print(markdown(HEADER, table_rows(results)))
    for line in largest_vs_largest(results):
        print("\n" + line)
    if searched:
        how = "doubling, then bisecting," if args.max_search == "bisect" else "doubling"
        print(f"\nLargest micro-batch search (2-step trials, {how} up to --max-micro {args.max_micro}): "
              + "; ".join(searched))
    for r in results:
        if "profile" in r:
            path, text = r["profile"]
            print(f"\n#### Profile of `{r['variant']}` ({path})\n")
            print(text)
            stall = host_stall_line(r)
            if stall:
                print(stall)
        if "python_profile" in r:
            path, text = r["python_profile"]
            print(f"\n#### Host (Python) profile of `{r['variant']}` ({path})\n")
            print(text)


if __name__ == "__main__":
    main()
