"""The whole run config checked before anything is built (train.py's first act, `exit_on_bad_config`): every key of
our groups known (one added with `+` too: the nearest valid key is named), every value of its type and range, the
paths that must exist, and what must divide what; each problem names its key, all of them in one message, printed
without a traceback (exit code 2), in about a second, where a typo used to fail minutes later inside a library or
train silently on.

The rules the project already has stay where they are and are called from here: ModelConfig's shape checks,
DataConfig's, the lr schedule's, the profiler's, the FP8 ablation's and monitor's, the DeepSpeed config's and the
non-finite guard's. What this module adds is the table of the keys of the `train`, `moe`, `logging`, `optim`,
`precision`, `fp8` and `deepspeed` nodes (their yaml defaults in conf/; tests/runtime/test_config_check.py keeps
both in step), the types of the `model` and `data` keys (their dataclasses' annotations), unknown keys and paths.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.config import DataConfig, SourceConfig, TokenizerConfig
from data.synthetic import SyntheticLoader
from fp8.adam import ROUNDINGS
from fp8.kernel_choice import GEMM_KERNELS
from fp8.monitor import KINDS, MonitorConfig
from ling.analysis.profiling import StepProfiler
from ling.config import FRESH, MOE_KEYS, fp8_ablation, model_config_from, resolve_device
from ling.ranks import barrier, env_rank, env_world_size
from ling.train.engine import (
    FP8_OPTIM_KEYS,
    GRAD_ACCUM_DTYPES,
    OPTIM_KEYS,
    bf16_enabled,
    check_deepspeed_config,
    deepspeed_config,
)
from ling.train.guard import check_can_skip
from ling.train.launch import StopRun
from ling.train.schedule import lr_multiplier
from model.config import COMPILE_OPS, DOCUMENT_ATTENTION, EXPERT_WGRAD, RECOMPUTE, ModelConfig

MISSING = "???"  # OmegaConf's mark of a value that must be given
# train.resume values that start fresh; anything else but "auto" names a checkpoint folder

Check = Callable[[Any], "str | None"]  # a value -> what is wrong with it, or None


class ConfigError(StopRun):
    """The run config has problems (each line names a key); nothing was started."""

    exit_code = 2


# ------------------------------------------------------------------------------------------------ value checks
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _bounds(lo: float | None, hi: float | None, above: float | None = None, below: float | None = None) -> str:
    low = f"> {above}" if above is not None else (f">= {lo}" if lo is not None else "")
    high = f"< {below}" if below is not None else (f"<= {hi}" if hi is not None else "")
    return " and ".join(b for b in (low, high) if b)


def integer(lo: int | None = None, hi: int | None = None, *, null: bool = False) -> Check:
    def check(v: Any) -> str | None:
        if v is None and null:
            return None
        if not _is_int(v):
            return f"expected an integer{' or null' if null else ''}, got {v!r}"
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            return f"must be {_bounds(lo, hi, None)}, got {v}"
        return None
    return check


def number(lo: float | None = None, hi: float | None = None, *, above: float | None = None,
           below: float | None = None, null: bool = False) -> Check:
    def check(v: Any) -> str | None:
        if v is None and null:
            return None
        if not _is_number(v):
            return f"expected a number{' or null' if null else ''}, got {v!r}"
        if ((above is not None and not v > above) or (below is not None and not v < below)
                or (lo is not None and v < lo) or (hi is not None and v > hi)):
            return f"must be {_bounds(lo, hi, above, below)}, got {v}"
        return None
    return check


def flag(*, null: bool = False) -> Check:
    def check(v: Any) -> str | None:
        if (v is None and null) or isinstance(v, bool):
            return None
        return f"expected true or false{' or null' if null else ''}, got {v!r}"
    return check


def one_of(*options: Any) -> Check:
    def check(v: Any) -> str | None:
        if any(v == o and type(v) is type(o) for o in options):
            return None
        return f"must be one of {', '.join('null' if o is None else str(o) for o in options)}; got {v!r}"
    return check


def text(*, null: bool = False) -> Check:
    def check(v: Any) -> str | None:
        if (v is None and null) or isinstance(v, str):
            return None
        return f"expected a string{' or null' if null else ''}, got {v!r}"
    return check


def list_of(item: Check, length: int | None = None) -> Check:
    def check(v: Any) -> str | None:
        if not isinstance(v, list) or (length is not None and len(v) != length):
            return f"expected a list{f' of {length}' if length is not None else ''}, got {v!r}"
        bad = [(i, p) for i, x in enumerate(v) if (p := item(x)) is not None]
        return f"item {bad[0][0]}: {bad[0][1]}" if bad else None
    return check


def mapping(v: Any) -> str | None:
    """A free-form mapping (merged into DeepSpeed's JSON as given)."""
    return None if isinstance(v, dict) else f"expected a mapping, got {v!r}"


def power_of_two(lo: int, hi: int) -> Check:
    def check(v: Any) -> str | None:
        if _is_int(v) and lo <= v <= hi and v & (v - 1) == 0:
            return None
        return f"must be a power of two in [{lo}, {hi}], got {v!r}"
    return check


def from_annotation(annotation: str) -> Check | None:
    """The check of a dataclass field's (string) annotation; None for the types the dataclass checks itself."""
    null = annotation.endswith(" | None")
    base = annotation.removesuffix(" | None")
    make = {"int": integer, "float": number, "bool": flag, "str": text}.get(base)
    return make(null=null) if make else (mapping if base.startswith("dict[") else None)


def typed_fields(cls: type) -> dict[str, Check | None]:
    return {f.name: from_annotation(str(f.type)) for f in dataclasses.fields(cls)}


# ------------------------------------------------------------------------------------------------ the key table
LOG_LEVELS = one_of("debug", "info", "warning", "error")
SPEC: dict[str, Any] = {
    "train": {
        "steps": integer(1), "stop_at": integer(1, null=True), "seq_len": integer(1), "micro_batch_size": integer(1),
        "grad_accum": integer(1), "seed": integer(0, 2**32 - 1), "deterministic": flag(),
        "device": one_of("auto", "cpu", "cuda"), "log_every": integer(1), "eval_every": integer(0),
        "eval_batches": integer(1), "save_every": integer(0, null=True), "save_final": flag(), "keep_last": integer(0),
        "verify_checksums": flag(), "checkpoint_dir": text(null=True), "resume": text(null=True),
        "overwrite": flag(), "on_locked": one_of("fail", "wait"), "max_bad_steps": integer(1),
        "inject_nan_steps": list_of(integer(1)), "init_from": text(null=True), "bias_update": flag(),
        "peak_tflops": number(above=0, null=True), "profile_step": integer(2, null=True), "profile_trace": flag(),
        "profile_python_step": integer(2, null=True), "async_save": flag(), "inject_save_delay_s": number(0),
        "inject_save_enospc_after_bytes": integer(0, null=True), "memory_check": flag(),
    },
    "moe": {"pad_for_fp8": flag(null=True), "pad_multiple": integer(1), "ep_size": integer(1)},
    "logging": {
        "progress_bar": flag(), "jsonl": flag(), "level": LOG_LEVELS, "deepspeed_level": LOG_LEVELS,
        "gpu_clock_interval_s": number(0),
        "wandb": {"mode": one_of("offline", "online", "disabled"), "project": text(), "entity": text(null=True),
                  "tags": list_of(text())},
    },
    "optim": {  # OPTIM_KEYS, and FP8_OPTIM_KEYS with optim.name=fp8_adamw (ling/train/engine.py)
        "name": one_of("adamw", "fp8_adamw"), "lr": number(0), "betas": list_of(number(0, below=1), 2),
        "eps": number(0), "weight_decay": number(0), "grad_clip": number(0),
        "schedule": one_of("cosine", "wsd", "constant"), "warmup_steps": integer(0), "min_lr_ratio": number(0, 1),
        "decay_fraction": number(0, 1), "block_size": power_of_two(16, 4096), "min_fp8_numel": integer(0),
        "rounding": one_of(*ROUNDINGS),
    },
    "precision": {"name": one_of("bf16", "fp8")},
    "fp8": {
        "recipe": one_of("blockwise", "tensorwise"), "pow2_scales": flag(), "expert_wgrad": one_of(*EXPERT_WGRAD),
        "gemm_kernel": one_of(*GEMM_KERNELS), "health_every": integer(0), "ablate": list_of(text()),
        "monitor": {"thresholds": {kind: {stat: number(0, null=True) for stat in stats}
                                   for kind, stats in KINDS.items()},
                    "recompute_dw": flag(), "fallback": flag()},
    },
    "deepspeed": {"zero_stage": one_of(0, 1, 2, 3), "bf16": one_of("auto", True, False),
                  "grad_accum_dtype": one_of(*GRAD_ACCUM_DTYPES, None), "zero_extra": mapping, "extra": mapping},
}
# ModelConfig fields the model node must not set: other nodes carry them into the model (ling.config)
SET_ELSEWHERE = {**{field: f"moe.{key}" for key, field in MOE_KEYS.items()}, "precision": "precision=bf16|fp8",
                 "fp8_recipe": "fp8.recipe", "fp8_pow2_scales": "fp8.pow2_scales",
                 "fp8_expert_wgrad": "fp8.expert_wgrad"}  # ling.config.fp8_model_options
MODEL_SPEC = {**{k: v for k, v in typed_fields(ModelConfig).items() if k not in SET_ELSEWHERE},
              "preset": text(), "name": text(),  # ModelConfig.from_dict: a preset to start from; ignored
              "document_attention": one_of(*DOCUMENT_ATTENTION), "recompute": one_of(*RECOMPUTE),
              "compile_ops": one_of(*COMPILE_OPS)}
SYNTHETIC_DATA_SPEC = {"name": one_of("synthetic"), "vocab_size": integer(2), "seed": integer(0),
                       "kind": one_of("uniform", "markov"), "branching": integer(1)}
TEXT_DATA_SPEC = {**typed_fields(DataConfig), "name": one_of("bundled", "files"),
                  "tokenizer": typed_fields(TokenizerConfig), "sources": None,
                  # keys of data=synthetic that the text sources ignore (an experiment may tune the synthetic source)
                  **{k: None for k in SYNTHETIC_DATA_SPEC if k not in DataConfig.__dataclass_fields__}}
ROOT_KEYS = ("run_name", "train", "moe", "logging", "model", "data", "optim", "precision", "fp8", "deepspeed")


# ------------------------------------------------------------------------------------------------ walking
def _unknown(key: str, where: str, known: Any, elsewhere: Mapping[str, str] | None = None) -> str:
    full = f"{where}.{key}" if where else key
    if elsewhere and key in elsewhere:
        return f"{full}: not a key here; set {elsewhere[key]} instead"
    near = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    if near:
        return f"{full}: unknown key; did you mean {where + '.' if where else ''}{near[0]}?"
    return f"{full}: unknown key (known: {', '.join(sorted(known))})"


def walk(node: Any, spec: Mapping[str, Any], where: str, elsewhere: Mapping[str, str] | None = None) -> list[str]:
    """Problems of a plain `node` against `spec` (key -> Check, nested spec, or None: known, checked elsewhere)."""
    if not isinstance(node, dict):
        return [f"{where}: expected a mapping of keys, got {node!r}"]
    problems = []
    for key, value in node.items():
        full = f"{where}.{key}" if where else str(key)
        if key not in spec:
            problems.append(_unknown(str(key), where, spec, elsewhere))
        elif value == MISSING:
            problems.append(f"{full}: required, no value given")
        elif isinstance(spec[key], Mapping):
            problems += walk(value, spec[key], full) if value is not None else []  # null: the node's defaults
        elif spec[key] is not None and (problem := spec[key](value)) is not None:
            problems.append(f"{full}: {problem}")
    return problems


def _attempt(problems: list[str], check: Callable[[], Any], where: str = "") -> Any:
    """Run one of the project's own validations; its ValueError (which names the key) becomes a problem."""
    try:
        return check()
    except (ValueError, TypeError, FileNotFoundError) as e:  # DataError is a ValueError
        message = str(e)
        problems.append(f"{where}: {message}" if where and not message.startswith(where) else message)
        return None


# ------------------------------------------------------------------------------------------------ the groups
def _optim_problems(optim: dict[str, Any]) -> list[str]:
    fp8_only = {k: "optim=fp8_adamw (its FP8AdamW key)" for k in FP8_OPTIM_KEYS}
    known = OPTIM_KEYS | (FP8_OPTIM_KEYS if optim.get("name") == "fp8_adamw" else set())
    spec = {k: v for k, v in SPEC["optim"].items() if k in known}
    return walk(optim, spec, "optim", {k: v for k, v in fp8_only.items() if k not in known})


def _data_problems(data: dict[str, Any]) -> list[str]:
    if data.get("name") == "synthetic":
        problems = walk(data, SYNTHETIC_DATA_SPEC, "data")
        if not problems:
            _attempt(problems, lambda: SyntheticLoader(
                vocab_size=data["vocab_size"], seq_len=1, micro_batch_size=1, seed=int(data.get("seed", 0)),
                kind=str(data.get("kind", "uniform")), branching=int(data.get("branching", 4))))
        return problems
    if data.get("name") not in ("bundled", "files"):
        return [f"data.name: must be one of bundled, files, synthetic; got {data.get('name')!r}"]
    problems = walk(data, TEXT_DATA_SPEC, "data")
    sources = data.get("sources") or []
    for i, src in enumerate(sources if isinstance(sources, list) else [sources]):
        where = f"data.sources[{i}]"
        if isinstance(src, dict):
            problems += walk(src, typed_fields(SourceConfig), where)
            src = src.get("path")
        if isinstance(src, str) and src != MISSING and (problem := _local_path_problem(src)):
            problems.append(f"{where}.path={src}: {problem}")
    if not problems:
        config = _attempt(problems, lambda: DataConfig.from_mapping(data), "data")
        model = config.tokenizer.model if config is not None else None
        if model and not os.path.isfile(os.path.expanduser(model)):
            problems.append(f"data.tokenizer.model={model}: no such file")
    return problems


def _local_path_problem(path: str) -> str | None:
    """A source path that is meant locally (data/corpus.py: one starting with /, . or ~) must name files."""
    if not path.startswith(("/", ".", "~")):
        return None  # bundled:NAME, a relative file or a hub dataset name: data/corpus.py decides
    full = os.path.expanduser(path)
    if os.path.exists(full) or (glob.has_magic(full) and glob.glob(full, recursive=True)):
        return None
    return "no such file or directory" if not glob.has_magic(full) else "the pattern matches no file"


def _model_problems(cfg: DictConfig, plain: dict[str, Any], earlier: list[str]) -> list[str]:
    problems = walk(plain["model"], MODEL_SPEC, "model", SET_ELSEWHERE)
    if problems or any(p.startswith(("moe.", "precision.", "fp8.", "data.")) for p in earlier):
        return problems  # ModelConfig would fail on a value already named
    data = plain.get("data") or {}
    vocab = data.get("vocab_size") if data.get("name") == "synthetic" else None
    if plain["model"].get("vocab_size") is None and vocab is None:
        vocab = 256 + 4  # a text source's tokenizer decides (its byte pieces and special ids at least)
    _attempt(problems, lambda: model_config_from(cfg, vocab))
    return problems


def _node_problems(plain: dict[str, Any]) -> list[str]:
    """Keys, types and ranges of the nodes with a fixed key table."""
    problems = []
    for group in ("train", "moe", "logging", "precision", "fp8", "deepspeed"):
        if group in plain:
            problems += walk(plain[group], SPEC[group], group)
    if isinstance(plain.get("optim"), dict):
        problems += _optim_problems(plain["optim"])
    return problems


def _cross_problems(cfg: DictConfig, plain: dict[str, Any], world: int) -> list[str]:
    """What needs several keys: the project's own checks of combinations, paths, and what must divide what."""
    problems: list[str] = []
    train, ds = plain["train"], plain["deepspeed"]
    steps = train["steps"]
    if train.get("stop_at") is not None and train["stop_at"] > steps:
        problems.append(f"train.stop_at={train['stop_at']}: expected a step in 1 … train.steps ({steps})")
    device = _attempt(problems, lambda: resolve_device(cfg))
    if device is not None:
        _attempt(problems, lambda: StepProfiler.from_config(cfg.train, steps, Path("."), device, False))
    optim = plain["optim"]
    _attempt(problems, lambda: lr_multiplier(optim["schedule"], steps, optim["warmup_steps"],
                                             optim["min_lr_ratio"], optim["decay_fraction"]))
    _attempt(problems, lambda: fp8_ablation(cfg))
    fp8 = plain["fp8"]
    _attempt(problems, lambda: MonitorConfig.from_dict(fp8.get("health_every", 0), fp8.get("monitor")))
    if device is not None:
        half = _attempt(problems, lambda: bf16_enabled(cfg, device))
        if half is not None:
            _attempt(problems, lambda: check_can_skip(ds["zero_stage"], half))
            conf = _attempt(problems, lambda: deepspeed_config(cfg, half))
            if conf is not None:
                _attempt(problems, lambda: check_deepspeed_config(conf, optim["name"]))
    problems += _cuda_graph_problems(plain, device)
    ep = plain["moe"].get("ep_size", 1)
    if ep > 1 and world % ep:
        problems.append(f"moe.ep_size={ep} does not divide the world size ({world} ranks): the experts are split over "
                        "groups of ep_size consecutive ranks")
    if ep > 1 and ds["zero_stage"] not in (1, 2):
        problems.append(f"moe.ep_size={ep} needs deepspeed.zero_stage 1 or 2 (got {ds['zero_stage']})")
    return problems


def _cuda_graph_problems(plain: dict[str, Any], device: Any) -> list[str]:
    """model.cuda_graphs=true: what a captured layer cannot do (model/graphs.py; ModelConfig checks recompute and
    moe.ep_size)."""
    model, data = plain["model"], plain.get("data") or {}
    if not model.get("cuda_graphs"):
        return []
    problems = []
    if device is not None and device.type != "cuda":
        problems.append(f"model.cuda_graphs=true needs train.device cuda (resolved to {device.type})")
    if plain["deepspeed"]["zero_stage"] == 3:
        problems.append("model.cuda_graphs=true needs deepspeed.zero_stage 0, 1 or 2: ZeRO-3 gathers parameters in "
                        "module hooks, which a replayed graph does not run")
    if data.get("document_mask") and model.get("document_attention", "auto") in ("auto", "flex"):
        problems.append("model.cuda_graphs=true with data.document_mask=true needs model.document_attention=dense: "
                        "FlexAttention's BlockMask is not a tensor a graph can take")
    return problems


def _path_problems(train: dict[str, Any]) -> list[str]:
    """train.init_from (an HF model folder) and a train.resume that names a checkpoint folder must exist."""
    problems = []
    for key in ("init_from", "resume"):
        value = train.get(key)
        if not isinstance(value, str) or (key == "resume" and value in (*FRESH, "auto")):
            continue
        path = Path(os.path.expanduser(value))
        if not path.exists():
            problems.append(f"train.{key}={value}: no such file or directory")
        elif key == "init_from" and not (path / "config.json").is_file():
            problems.append(f"train.init_from={value}: not an HF model folder (no config.json; `python -m "
                            "ling.checkpoint.hf export` writes one)")
    return problems


def config_problems(cfg: DictConfig, world_size: int | None = None) -> list[str]:
    """Every problem of the composed run config `cfg` (train.py's), one line each naming its key; [] when none.
    `world_size`: the number of ranks (default: the launcher's WORLD_SIZE)."""
    world = env_world_size() if world_size is None else world_size
    try:
        plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as e:  # an interpolation that does not resolve
        return [f"{e.full_key}: {e.msg}" if getattr(e, "full_key", None) else str(e)]
    problems = [_unknown(str(k), "", ROOT_KEYS) for k in plain if k not in ROOT_KEYS]
    problems += [f"{k}: missing (every run config has it: conf/config.yaml)" for k in ROOT_KEYS
                 if k not in plain and k != "run_name"]
    if problems:
        return problems
    problems += _node_problems(plain) + _path_problems(plain["train"]) + _data_problems(plain["data"])
    problems += _model_problems(cfg, plain, problems)
    if not problems:  # the combinations, once every value has its type
        problems += _cross_problems(cfg, plain, world)
    return list(dict.fromkeys(problems))


def check_run_config(cfg: DictConfig, world_size: int | None = None) -> None:
    """Raise ConfigError listing every problem of `cfg` (config_problems)."""
    problems = config_problems(cfg, world_size)
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise ConfigError(f"the run config has {len(problems)} problem{'s' if len(problems) > 1 else ''} (nothing "
                          f"was started):\n{lines}")


def exit_on_bad_config(cfg: DictConfig) -> None:
    """train.py, before anything is built: rank 0 prints every problem of the run config (no traceback) and every
    rank exits with ConfigError's exit code (2)."""
    try:
        check_run_config(cfg)
    except ConfigError as error:
        if env_rank() == 0:
            print(f"train.py: {error}", file=sys.stderr, flush=True)
        barrier()  # under torchrun: rank 0 has printed before any rank exits (the launcher then stops the others)
        raise SystemExit(error.exit_code) from None
