"""Held-out evaluation: token-weighted loss, perplexity, next-token and (per MTP depth) next-next-token accuracy.

`evaluate(model, batches, device)` is what the trainer calls every `train.eval_every` steps; `run_eval(cfg)`
is eval.py: a checkpoint (run dir, checkpoint folder or HF export) on a data config's held-out split, in the
checkpoint's precision or another, results to stdout and a JSON file.
"""

from __future__ import annotations

import inspect
import json
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from data import batch_to_device, build_loader
from fp8.linear import ABLATION_COMPONENTS, EMULATED
from ling.analysis.step_error import format_step_errors, step_errors
from ling.checkpoint.hf import load_hf_checkpoint, read_hf_config
from ling.checkpoint.layout import RESOLVED_CONFIG
from ling.checkpoint.weights import config_changes, find_checkpoint, load_into, read_model_state
from ling.config import EXPERTS_ABLATION, apply_fp8_ablation, fp8_model_options, model_config_from, resolve_device
from ling.files import atomic_write
from ling.ranks import env_world_size, init_distributed
from model.ling import LingForCausalLM, shift_left
from model.loss import IGNORE_INDEX

MODES = ("loss", "step_error")  # eval.py mode=: held-out metrics | FP8's one-step error (ling/analysis/step_error.py)
_ROWS_PER_CHUNK = 4  # sequences per CE chunk: bounds the fp32 copy of the logits (rows x T x V)


def _sums(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V] (any float dtype), targets int64 [B, T] (-100 = ignored) → fp64 [3]: summed CE (fp32
    maths), number of targets, number of correct argmax predictions."""
    out = torch.zeros(3, dtype=torch.float64, device=logits.device)
    for start in range(0, logits.shape[0], _ROWS_PER_CHUNK):
        lg = logits[start:start + _ROWS_PER_CHUNK].float()
        tg = targets[start:start + _ROWS_PER_CHUNK]
        valid = tg != IGNORE_INDEX
        ce = F.cross_entropy(lg.flatten(0, 1), tg.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        correct = ((lg.argmax(-1) == tg) & valid).sum()
        out += torch.stack([ce.double(), valid.sum().double(), correct.double()])
    return out


def _forward_kwargs(model: nn.Module) -> dict[str, Any]:
    """Ask for logits explicitly where the model can skip them (a fused LM-head loss)."""
    params = inspect.signature(model.forward).parameters
    return {"return_logits": True} if "return_logits" in params else {}


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]], device: torch.device | str, *,
             max_batches: int | None = None, progress: bool = False) -> dict[str, float]:
    """Evaluate `model` (a LingForCausalLM) on `batches` (the loader's dicts: input_ids, labels [, doc_ids]).

    Runs in eval mode under no_grad and restores the previous mode. Every figure is a token-weighted mean over
    all batches (and over all data-parallel ranks when torch.distributed is initialised: every rank must call
    this with the same number of batches). Keys: `loss` (the training objective: lm_loss + mtp_loss_weight ·
    mtp_loss + z_loss + aux_loss), `lm_loss`, `ppl` = exp(lm_loss), `acc` (next-token argmax accuracy),
    per MTP depth d `mtp_loss_{d}` and `mtp_acc_{d}` (accuracy on the token d+1 ahead), `mtp_loss` (mean over
    depths), `z_loss`, `aux_loss` (weighted, as in training), `tokens` (targets counted), `batches`.
    """
    config = model.config
    depths = int(config.num_mtp_layers)
    kwargs = _forward_kwargs(model)
    was_training = model.training
    model.eval()
    # [lm ce, lm n, lm correct, z·n, aux·n] + [ce, n, correct] per MTP depth, summed over batches (fp64)
    totals = torch.zeros(5 + 3 * depths, dtype=torch.float64, device=device)
    n_batches = 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=max_batches, desc="eval", dynamic_ncols=True)
    try:
        for batch in batches:
            if max_batches is not None and n_batches >= max_batches:
                break
            batch = batch_to_device(batch, device)
            labels = batch["labels"]
            out = model(batch["input_ids"], labels=labels, doc_ids=batch.get("doc_ids"), **kwargs)
            if out.logits is None:
                raise RuntimeError("the model returned no logits; evaluate needs them for the accuracy")
            lm = _sums(out.logits, labels)
            zero = torch.zeros((), dtype=torch.float64, device=device)
            router = torch.stack([zero if x is None else x.detach().double() for x in (out.z_loss, out.aux_loss)])
            parts = [lm, router * lm[1]]
            for d, mtp_logits in enumerate(out.mtp_logits[:depths], start=1):
                parts.append(_sums(mtp_logits, shift_left(labels, d, IGNORE_INDEX)))
            totals += torch.cat(parts)
            n_batches += 1
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)
    if n_batches == 0:
        raise ValueError("evaluate: no batches to evaluate")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    t = totals.tolist()
    n = max(t[1], 1.0)
    result: dict[str, float] = {"lm_loss": t[0] / n, "acc": t[2] / n, "z_loss": t[3] / n, "aux_loss": t[4] / n}
    mtp = []
    for d in range(1, depths + 1):
        ce, cnt, correct = t[5 + 3 * (d - 1): 8 + 3 * (d - 1)]
        result[f"mtp_loss_{d}"] = ce / max(cnt, 1.0)
        result[f"mtp_acc_{d}"] = correct / max(cnt, 1.0)
        mtp.append(result[f"mtp_loss_{d}"])
    result["loss"] = result["lm_loss"] + result["z_loss"] + result["aux_loss"]
    if mtp:
        result["mtp_loss"] = sum(mtp) / len(mtp)
        result["loss"] += float(config.mtp_loss_weight) * result["mtp_loss"]
    result["ppl"] = math.exp(min(result["lm_loss"], 700.0))
    result["tokens"] = t[1]
    result["batches"] = float(n_batches)
    return result


# ------------------------------------------------------------------------------------------------ eval.py
def split_steps(loader: Any, max_batches: int | None) -> int:
    """How many micro-batches cover a packed split once: floor(rows / (B · ranks)) (the < B · ranks rows
    left over are skipped so no row counts twice), at least one, at most `max_batches`. A loader without a
    row count (synthetic data) needs `max_batches`."""
    rows = getattr(loader, "num_rows", None)
    if rows is None:
        if max_batches is None:
            raise ValueError("batches must be set for a data source without a fixed size (data=synthetic)")
        return int(max_batches)
    steps = max(1, rows // (loader.micro_batch_size * loader.world_size))
    return min(steps, int(max_batches)) if max_batches is not None else steps


WHOLE_SPLIT = ("all", None)  # eval.py batches=all (or null): the whole split once
SYNTHETIC_BATCHES = 50  # ... of synthetic data, which has no end


def requested_batches(value: Any, synthetic: bool) -> int | None:
    """eval.py's `batches`: a positive number of micro-batches (per rank), or all / null: the whole split (None;
    synthetic data: SYNTHETIC_BATCHES)."""
    if value in WHOLE_SPLIT:
        return SYNTHETIC_BATCHES if synthetic else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"batches={value!r}: want a positive number of micro-batches, or all (the whole split once)")


def split_batches(loader: Any, steps: int, whole: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """`steps` micro-batches of the loader; with `whole` (the split's size in micro-batches, split_steps) larger,
    spread evenly over the split: micro-batch floor(i · whole / steps) for i < steps, the others read and skipped
    (a packed split is in corpus order: its first batches hold one source's documents)."""
    if whole is None or steps >= whole:
        for _ in range(steps):
            yield loader.next_batch()
        return
    picked = {i * whole // steps for i in range(steps)}
    for index in range(max(picked) + 1):
        batch = loader.next_batch()
        if index in picked:
            yield batch


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"bf16": torch.bfloat16, "fp32": torch.float32}
    if name not in table:
        raise ValueError(f"dtype={name!r} is unknown (known: auto, bf16, fp32)")
    return table[name]


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / RESOLVED_CONFIG).is_file()


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2) + "\n"))


def run_eval(cfg: DictConfig) -> dict[str, Any]:
    """eval.py: evaluate `cfg.checkpoint` on the held-out split; returns (and writes) the result record.

    cfg (conf/eval.yaml): checkpoint, tag, split, batches, micro_batch_size, seq_len, device, dtype, output,
    progress_bar, and optionally the groups `model`, `data`, `precision` (+ `fp8`) to override the run's.
    """
    if env_world_size() > 1:
        init_distributed()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    t0 = time.perf_counter()
    source = Path(str(cfg.checkpoint))
    precision = OmegaConf.select(cfg, "precision.name")
    if _is_hf_dir(source):
        if cfg.get("data") is None or cfg.get("seq_len") is None:
            raise ValueError(f"checkpoint={source} is an HF export (no run config): give data=... and seq_len=...")
        run_cfg = OmegaConf.create({"data": cfg.data, "train": {"seq_len": cfg.seq_len, "seed": 0,
                                                                "micro_batch_size": cfg.micro_batch_size or 1}})
        model_config = read_hf_config(source)
        if precision:
            model_config = model_config.replace(precision=precision, **fp8_model_options(cfg.fp8))
        state, step, tag, out_default = None, None, "hf", source.parent / f"eval-{source.name}-{cfg.split}.json"
    else:
        ref = find_checkpoint(source, cfg.get("tag"))
        run_cfg = ref.config.copy()
        for group in ("model", "data"):
            if cfg.get(group) is not None:
                run_cfg[group] = cfg[group]
        if precision:
            run_cfg.precision, run_cfg.fp8 = cfg.precision, cfg.fp8
        state = read_model_state(ref.folder)
        vocab = OmegaConf.select(run_cfg, "model.vocab_size")
        model_config = model_config_from(run_cfg, vocab or int(state["word_embeddings.weight"].shape[0]))
        model_config = model_config.replace(ep_size=1)  # every rank evaluates the whole model
        step, tag = ref.step, ref.tag
        suffix = f"-{precision}" if precision else ""
        out_default = ref.run_dir / "eval" / f"{tag}-{cfg.split}{suffix}.json"

    mode = str(cfg.get("mode") or "loss")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown (known: {', '.join(MODES)})")
    device_cfg = OmegaConf.create({"train": {"device": cfg.device}})
    device = resolve_device(device_cfg)
    # step_error: the fp32 reference holds the checkpoint's weights exactly; its bf16 / fp8 twins are cast from it
    dtype = torch.float32 if mode == "step_error" else _dtype(str(cfg.dtype), device)
    with torch.device(device):
        model = LingForCausalLM(model_config).to(dtype)
    if state is not None:
        load_into(model, state, f"checkpoint {ref.folder}", config_changes(ref.model_config(state), model_config))
        del state
    else:
        load_hf_checkpoint(model, source)

    seq_len = int(cfg.seq_len or run_cfg.train.seq_len)
    micro = int(cfg.micro_batch_size or run_cfg.train.micro_batch_size)
    data_cfg = run_cfg.data.copy()
    if data_cfg.get("name") == "synthetic":  # another stream than the training one
        data_cfg.seed = int(data_cfg.get("seed", 0)) + 1_000_003
    loader = build_loader(data_cfg, seq_len=seq_len, micro_batch_size=micro, rank=rank, world_size=world,
                          seed=int(run_cfg.train.seed), split=str(cfg.split))
    steps = split_steps(loader, requested_batches(cfg.batches, data_cfg.get("name") == "synthetic"))
    whole = split_steps(loader, None) if hasattr(loader, "num_rows") else None  # synthetic data has no end
    batches = split_batches(loader, steps, whole)
    if mode == "step_error":
        return _run_step_error(cfg, model, model_config, batches, steps, device,
                               out_default.with_name(out_default.stem + "-step_error.json"), source, tag, step)
    metrics = evaluate(model, batches, device, max_batches=steps, progress=bool(cfg.progress_bar) and rank == 0)
    record = {
        "checkpoint": str(source), "tag": tag, "step": step, "split": str(cfg.split),
        "precision": model_config.precision, "dtype": str(dtype).removeprefix("torch."), "device": device.type,
        "ranks": world, "seq_len": seq_len, "micro_batch_size": micro, "data": str(data_cfg.get("name")),
        "split_batches": whole,  # the whole split, per rank (null: synthetic data)
        "seconds": time.perf_counter() - t0, "metrics": metrics,
    }
    if rank == 0:
        out = Path(cfg.output) if cfg.get("output") else out_default
        _write_json(out, record)
        record["output"] = str(out)
        print(format_metrics(record))
    return record


def _step_error_ablations(cfg: DictConfig) -> list[frozenset[str]]:
    """`step_error_ablate`: entries of comma-separated FP8 components (README "FP8 ablation"), each one more FP8
    copy with those components in high precision."""
    known = (*ABLATION_COMPONENTS, EXPERTS_ABLATION)
    out = []
    for entry in cfg.get("step_error_ablate") or ():
        parts = frozenset(str(entry).split(","))
        unknown = sorted(parts - set(known))
        if unknown:
            raise ValueError(f"step_error_ablate: unknown component(s) {unknown} in {entry!r}; known: {list(known)} "
                             "(the optimizer's adam_m / adam_v play no part in one step's error)")
        if parts not in out:
            out.append(parts)
    return out


def _run_step_error(cfg: DictConfig, reference: nn.Module, model_config: Any, batches: Iterable, steps: int,
                    device: torch.device, out_default: Path, source: Path, tag: Any, step: Any) -> dict[str, Any]:
    """eval.py mode=step_error (ling/analysis/step_error.py): the loaded fp32 model, its bf16 twin and its FP8 twin."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("mode=step_error runs on one process (launch it with python, not torchrun)")
    fp8 = fp8_model_options(cfg.fp8) if cfg.get("fp8") else {}
    fp8_config = model_config.replace(precision="fp8", **fp8)  # the run's FP8 options unless precision= given
    variants = [("fp32", model_config.replace(precision="bf16"), torch.float32, frozenset()),
                ("bf16", model_config.replace(precision="bf16"), torch.bfloat16, frozenset()),
                ("fp8", fp8_config, torch.bfloat16, frozenset())]
    # an entry with FP8Linear components is measured against the FP8 copy whose FP8Linears take the same emulated
    # GEMM path with nothing in high precision (the Triton GEMMs sum in another order); "experts" alone against fp8
    ablations = _step_error_ablations(cfg)
    baselines = {}
    for a in ablations:
        name = "fp8-emulated" if a == {EMULATED} else f"fp8-no-{'+'.join(sorted(a))}"
        variants.append((name, fp8_config, torch.bfloat16, a))
        if a != {EMULATED}:
            baselines[name] = "fp8-emulated" if (a & set(ABLATION_COMPONENTS)) - {EMULATED} else "fp8"
    if "fp8-emulated" in baselines.values() and frozenset({EMULATED}) not in ablations:
        variants.append(("fp8-emulated", fp8_config, torch.bfloat16, frozenset({EMULATED})))
    models: dict[str, nn.Module] = {}
    for name, config, dtype, ablate in variants:
        with torch.device(device):
            models[name] = LingForCausalLM(config).to(dtype)
        models[name].load_state_dict(reference.state_dict())  # nn.Linear and FP8Linear share a state_dict
        apply_fp8_ablation(models[name], ablate)
    del reference
    t0 = time.perf_counter()
    record = {"checkpoint": str(source), "tag": tag, "step": step, "split": str(cfg.split), "mode": "step_error",
              "device": device.type, **step_errors(models, batches, device, steps, baselines)}
    record["seconds"] = time.perf_counter() - t0
    out = Path(cfg.output) if cfg.get("output") else out_default
    _write_json(out, record)
    record["output"] = str(out)
    print(format_step_errors(record))
    return record


def format_metrics(record: Mapping[str, Any]) -> str:
    m = record["metrics"]
    whole = record.get("split_batches")
    sample = (f" (spread over the split's {whole}; batches=all for all of them)"
              if whole is not None and int(m["batches"]) < whole else "")
    lines = [f"eval {record['checkpoint']} ({record['tag']}, step {record['step']}) on {record['data']} "
             f"{record['split']}: {int(m['tokens'])} tokens in {int(m['batches'])} batches{sample}, "
             f"precision={record['precision']}, {record['dtype']} on {record['device']}"]
    keys = ["loss", "lm_loss", "ppl", "acc"] + sorted(k for k in m if k.startswith("mtp_"))
    lines += [f"  {k:<12} {m[k]:.6g}" for k in keys if k in m]
    if "output" in record:
        lines.append(f"  written to {record['output']}")
    return "\n".join(lines)
